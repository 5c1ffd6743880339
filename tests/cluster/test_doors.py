"""The doors decisions (cluster/doors.py), the flag that opens them, and the /proc listener reader's parsing."""

from pathlib import Path

import pytest

from cluster import doors
from cluster.config import ConfigError, resolve
from cluster.doctor.listeners import Listener, parse_table
from cluster.launch.netns import kinds_to_try
from cluster.rundir import describe

pytestmark = pytest.mark.pure


def test_only_a_loopback_cluster_placed_here_is_closed_by_a_namespace():
    assert doors.closable_by_namespace(resolve({}).cluster, None)
    assert doors.closable_by_namespace(resolve({"cluster": {"host": "localhost", "control": "0.0.0.0:0"}}).cluster, None)
    two_hosts = resolve({"cluster": {"workers": ["127.0.0.1:0", "10.0.0.2:2222"]}}).cluster
    assert not doors.closable_by_namespace(two_hosts, None)
    assert not doors.closable_by_namespace(resolve({}).cluster, set()), "a Slurm node or pod: tasks elsewhere"
    assert not doors.closable_by_namespace(resolve({"cluster": {"engine": "ray"}}).cluster, None)


def test_the_control_socket_lives_in_the_run_dir_unless_its_path_is_too_long(tmp_path):
    assert doors.socket_in_run_dir(tmp_path) == tmp_path / "control.sock"
    assert doors.socket_in_run_dir(Path("runs/x")) == Path.cwd() / "runs/x/control.sock", "absolute"
    assert doors.socket_in_run_dir(Path("/" + "d" * 100)) is None
    assert doors.unix_target(tmp_path / "control.sock") == f"unix:{tmp_path}/control.sock"


def test_a_control_target_is_an_absolute_unix_path_or_host_port():
    doors.check_control_target("--chief", "unix:/run/x/control.sock")
    doors.check_control_target("--chief", "10.0.0.1:2229")
    for bad in ("unix:control.sock", "chief", "unix:"):
        with pytest.raises(ConfigError, match="--chief"):
            doors.check_control_target("--chief", bad)


def test_the_refusal_is_one_line_naming_the_exposure_and_the_flag():
    line = doors.refusal("unshare: Operation not permitted")
    assert "\n" not in line and "--allow-open-ports" in line and "all interfaces without authentication" in line
    assert "Operation not permitted" in line


def test_allow_open_ports_is_a_checked_boolean_recorded_in_cluster_json():
    assert not resolve({}).cluster.allow_open_ports
    config = resolve({}, {"allow_open_ports": True})
    assert describe("cluster", config.train, config.cluster)["allow_open_ports"] is True
    with pytest.raises(ConfigError, match="cluster.allow_open_ports: expected true or false"):
        resolve({"cluster": {"allow_open_ports": "yes"}})


def test_root_makes_its_own_namespace_and_anyone_else_an_unprivileged_one():
    assert kinds_to_try(0) == ("root", "user") and kinds_to_try(1000) == ("user",)


TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0
   1: 0100007F:1F91 0100007F:8000 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when ...
   0: 00000000000000000000000000000000:C350 00000000000000000000000000000000:0000 0A 0:0 00:00000000 0 0 0 5151 1
   1: 00000000000000000000000001000000:C351 00000000000000000000000000000000:0000 0A 0:0 00:00000000 0 0 0 5252 1
"""


def test_proc_net_tables_give_each_listening_socket_its_address_and_port():
    assert parse_table(TCP) == {4242: ("127.0.0.1", 8080), 4444: ("0.0.0.0", 22)}, "only LISTEN rows"
    assert parse_table(TCP6) == {5151: ("::", 50000), 5252: ("::1", 50001)}


def test_who_reaches_a_listener():
    assert "any host" in Listener(1, "::", 5, private=False).reach
    assert "loopback" in Listener(1, "127.0.0.1", 5, private=False).reach
    assert "private network namespace" in Listener(1, "0.0.0.0", 5, private=True).reach


def test_doctor_warns_of_a_tf_port_anyone_reaches_and_not_of_the_control_plane():
    from cluster.doctor.reach import doors as door_checks

    anyone, private = "any host that reaches this machine", "the run's own tasks only (private network namespace)"
    found = door_checks([(7, "-m worker", "::", 2222, anyone), (6, "launch", "0.0.0.0", 2229, anyone)], "10.0.0.1:2229")
    assert [(c.level, c.name) for c in found] == [("WARN", "doors.2222"), ("INFO", "doors.2229")]
    assert "[::]:2222" in found[0].message and "control plane" in found[1].message and found[0].fix
    closed = door_checks([(7, "-m worker", "0.0.0.0", 40000, private)], "unix:/r/control.sock")
    assert [c.level for c in closed] == ["INFO", "INFO"] and "unix socket" in closed[0].message


def test_doctor_says_whether_the_runs_node_rules_are_in_place():
    from cluster.doctor.reach import Guardian, guarded, node_rules

    placed_rules = Guardian(9, "nft", "pstrain_9", (2221, 2222), True)
    assert node_rules([placed_rules], "unix:/r/control.sock") == [], "a private namespace needs none"
    [none] = node_rules([], "10.0.0.1:2229")
    assert none.level == "INFO" and "no node rules" in none.message
    [placed] = node_rules([placed_rules], "10.0.0.1:2229")
    assert placed.level == "INFO" and placed.message.startswith("nftables table pstrain_9 (guardian pid 9) in place")
    assert "2221, 2222" in placed.message
    [gone] = node_rules([Guardian(9, "iptables", "pstrain_9", (2222,), False)], "10.0.0.1:2229")
    assert gone.level == "WARN" and "iptables chain pstrain_9" in gone.message and "2222 are open" in gone.message and gone.fix
    [unknown] = node_rules([Guardian(9, "nft", "pstrain_9", (2222,), None)], "10.0.0.1:2229")
    assert unknown.level == "INFO" and "not root" in unknown.message
    anyone = "any host that reaches this machine"
    assert guarded(anyone, 2222, [placed_rules]) == "the cluster's hosts only (nftables table pstrain_9)"
    assert guarded(anyone, 2229, [placed_rules]) == anyone, "the control port is not in the rules"
    assert guarded(anyone, 2222, [Guardian(9, "nft", "pstrain_9", (2222,), False)]) == anyone, "rules gone: open"
