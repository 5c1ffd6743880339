"""The node rules as text (cluster/rulesets.py) and the choice of the tool that makes them. Pure."""

import pytest

from cluster import doors, rulesets

pytestmark = pytest.mark.pure


def test_nftables_first_then_iptables_with_ip6tables_else_why_not():
    assert rulesets.choose(0, {"nft", "iptables", "ip6tables"}) == ("nft", "")
    assert rulesets.choose(0, {"nft"}) == ("nft", "")
    assert rulesets.choose(0, {"iptables", "ip6tables"}) == ("iptables", "")
    assert rulesets.choose(1000, {"nft", "iptables", "ip6tables"}) == ("", "not root")
    tool, why = rulesets.choose(0, {"iptables"})
    assert tool == "" and "ip6tables" in why, "IPv4 closed and IPv6 open is not closed"
    assert rulesets.choose(0, set()) == ("", "neither nft (nftables) nor iptables is installed")


def test_the_refusal_where_no_tool_exists_is_one_line_naming_the_flag():
    line = doors.node_refusal(rulesets.choose(0, set())[1])
    assert "\n" not in line and "--allow-open-ports" in line and "neither nft (nftables) nor iptables" in line


def test_the_nftables_table_admits_the_peers_and_loopback_and_resets_the_rest():
    text = rulesets.nft_ruleset("pstrain_7", [2222, 2221, 2222], ["10.0.0.2", "fd00::1", "10.0.0.1"])
    assert text.startswith("table inet pstrain_7 {")
    assert "tcp dport { 2221, 2222 } ip saddr { 10.0.0.1, 10.0.0.2 } accept" in text
    assert "tcp dport { 2221, 2222 } ip6 saddr { fd00::1 } accept" in text
    assert text.index('iif "lo" accept') < text.index("reject with tcp reset")
    assert text.rstrip().endswith("}")


def test_the_iptables_chain_per_family_jumped_to_for_the_tf_ports_only():
    ports = list(range(3000, 3017))  # 17: more than one multiport match takes
    v4 = rulesets.iptables_restore("pstrain_7", ports, ["10.0.0.1", "fd00::1"], 4).splitlines()
    assert v4[:2] == ["*filter", ":pstrain_7 - [0:0]"] and v4[-1] == "COMMIT"
    jumps = [line for line in v4 if line.startswith("-I INPUT 1 ")]
    assert jumps == [
        "-I INPUT 1 -p tcp -m multiport --dports " + ",".join(map(str, ports[:15])) + " -j pstrain_7",
        "-I INPUT 1 -p tcp -m multiport --dports 3015,3016 -j pstrain_7",
    ]
    chain = [line for line in v4 if line.startswith("-A pstrain_7 ")]
    assert chain == [
        "-A pstrain_7 -i lo -j ACCEPT",
        "-A pstrain_7 -s 10.0.0.1 -j ACCEPT",
        "-A pstrain_7 -p tcp -j REJECT --reject-with tcp-reset",
    ], "accepts before the reset; each family admits its own peers only"
    v6 = rulesets.iptables_restore("pstrain_7", [2222], ["10.0.0.1", "fd00::1"], 6)
    assert "-A pstrain_7 -s fd00::1 -j ACCEPT" in v6 and "10.0.0.1" not in v6


LISTING = """\
-P INPUT ACCEPT
-P FORWARD ACCEPT
-N pstrain_7
-N pstrain_8
-N other
-A INPUT -p tcp -m multiport --dports 2221,2222 -j pstrain_7
-A INPUT -p tcp -m multiport --dports 2223 -j pstrain_7
-A INPUT -p tcp -m multiport --dports 2224 -j pstrain_8
-A INPUT -j pstrain_70
-A pstrain_7 -i lo -j ACCEPT
"""


def test_the_iptables_removal_takes_the_chain_and_its_jumps_only():
    assert rulesets.iptables_names(LISTING) == ["pstrain_7", "pstrain_8"]
    assert rulesets.iptables_removal(LISTING, "pstrain_7").splitlines() == [
        "*filter",
        "-D INPUT -p tcp -m multiport --dports 2221,2222 -j pstrain_7",
        "-D INPUT -p tcp -m multiport --dports 2223 -j pstrain_7",
        "-F pstrain_7",
        "-X pstrain_7",
        "COMMIT",
    ]
    assert rulesets.iptables_removal(LISTING, "pstrain_9") == "", "nothing of it: nothing to run"


def test_stale_rules_are_those_whose_guardian_is_gone():
    listing = "table inet filter\ntable inet pstrain_7\ntable ip pstrain_8\ntable inet pstrain_9\ntable inet pstrain_x\n"
    assert rulesets.nft_names(listing) == ["pstrain_7", "pstrain_9"]
    assert rulesets.stale(["pstrain_7", "pstrain_9"], lambda pid: pid == 9) == ["pstrain_7"]
    assert rulesets.owner("pstrain_42") == 42 and rulesets.owner("pstrain_x") is None and rulesets.owner("filter") is None
