"""The tests the docs cite as proof of what cannot be checked in one process on one machine: two machines,
closed ports, Ray, Kubernetes, Slurm, a memory cgroup and a full disk. A skip of one of these, a module that
skips as it is imported included, is never silent in CI (tests/conftest.py); every test the docs cite that can
skip is here (tests/test_proof_skips.py)."""

from __future__ import annotations

from collections.abc import Iterable

PROOF = (
    "tests/system/test_two_machines.py",  # docs/two-machines.md
    "tests/system/test_doors_two_machines.py",  # README Security, docs/two-machines.md: outsiders refused, rules removed
    "tests/cluster/launch/test_private_network.py",  # README Security: a local cluster's private network namespace
    "tests/cluster/launch/test_firewall_guardian.py",  # docs/two-machines.md: no signal leaves the node rules behind
    "tests/system/test_worker_data_hosts.py",  # docs/data.md: each machine its own files
    # docs/embeddings.md: a ps that cannot reach the checkpoint directory
    "tests/system/test_unshared_checkpoints.py::test_a_ps_without_the_run_dir_checkpoints_through_the_chief_and_ends_as_standalone",
    # docs/faults.md, docs/embeddings.md: the chief in a memory cgroup smaller than the model
    "tests/system/test_unshared_checkpoints.py::test_a_ps_without_the_run_dir_and_a_model_larger_than_the_chief_is_refused_in_one_line",
    # docs/embeddings.md, docs/faults.md: a chief limited below a table trains, is killed and resumes
    "tests/system/test_embeddings.py::test_a_chief_limited_below_the_table_trains_is_killed_and_resumes_on_another_ps_count",
    "tests/benchmarks/test_links_netns.py",  # docs/benchmarks.md: --link's shaped hosts, their rate, nothing left
    "tests/system/test_ray.py",  # docs/ray.md: the Ray engine on one machine
    "tests/system/test_ray_two_nodes.py",  # docs/ray.md: a Ray cluster of two nodes
    "tests/system/test_ray_install.py",  # docs/ray.md: the Ray extra keeps one TensorFlow
    # docs/faults.md: a read-only run dir and one on a full disk, each one line
    "tests/system/test_mistakes.py::test_a_read_only_run_dir_is_one_line",
    "tests/system/test_mistakes.py::test_a_full_disk_is_one_line",
    "tests/system/test_tfjob.py::test_tfjob_end_to_end_one_namespace_per_pod_with_a_chief_restart",  # docs/kubernetes.md
    "tests/system/test_slurm.py::test_slurm_end_to_end_on_two_namespaces",  # docs/slurm.md
    "tests/system/test_slurm.py::test_real_slurm_sbatch_stops_with_a_checkpoint_on_the_time_limit_signal_and_resumes",
    # docs/faults.md
    "tests/system/test_faults.py::test_a_disk_that_refuses_writes_stops_with_one_line_and_the_last_checkpoint_intact",
)


def covers(name: str, nodeid: str) -> bool:
    """Whether `name` (a file path or a node id, its parameters left out) names the test `nodeid`."""
    return nodeid == name or nodeid.startswith(name + "::") or nodeid.startswith(name + "[")


def unallowed_skips(skipped: Iterable[str], allowed: str, proof: Iterable[str] = PROOF) -> list[str]:
    """The proof tests among `skipped` (node ids, or a module's path where the module skipped as it was
    imported: every proof test in it skipped) that `allowed` (comma-separated names) does not name."""
    names = [a.strip() for a in allowed.split(",") if a.strip()]
    proof = tuple(proof)
    found = set()
    for n in skipped:
        found |= {n for p in proof if covers(p, n)} | {p for p in proof if covers(n, p)}
    return sorted(n for n in found if not any(covers(a, n) for a in names))
