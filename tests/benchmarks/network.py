"""The benchmarks' A/B switch for issue 38: pstrain's local cluster in its private network namespace (the
default, as users run it) or on the host's network with its TF ports open, as before the namespace.

`--no-private-network` on bench.py or embeddings.py turns every pstrain run of that invocation open (it
sets NO_NETNS_ENV, which the runs read); the peer `pstrain-open` is one open run beside the default
`pstrain` in the same rounds. Each run records what it ran with (cluster.json's `private_network`).
"""

from __future__ import annotations

import argparse
import os

OPEN = ["--no-private-network", "--allow-open-ports"]  # the launch flags of an open run
NO_NETNS_ENV = "PSTRAIN_BENCH_NO_PRIVATE_NETWORK"


def add_network_flag(parser: argparse.ArgumentParser) -> None:
    help_ = "every pstrain run with its tasks on the host's network, TF ports open (issue 38's A/B; docs/benchmarks.md)"
    parser.add_argument("--no-private-network", action="store_true", help=help_)


def apply_network_flag(args: argparse.Namespace) -> bool:
    """Set the switch from the parsed flag; returns whether pstrain runs in its private namespace."""
    if args.no_private_network:
        os.environ[NO_NETNS_ENV] = "1"
    return private_network()


def private_network() -> bool:
    return os.environ.get(NO_NETNS_ENV) != "1"


def network_text(private: bool) -> str:
    return "pstrain's tasks in a private network namespace" if private else "pstrain's tasks on the host's network, ports open"
