"""The CPU sampler that `pstrain plan` and the benchmarks share: a process's role from its command line
and its TF_CONFIG, read from the process itself (psutil) through cluster/tfconfig.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from cluster.forecast.measure import cpu_by_role, role_of

pytestmark = pytest.mark.cluster

SPIN = "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass\nimport sys; sys.stdin.read()"


def test_roles_and_their_cpu_come_from_each_process_tf_config():
    ps_config = json.dumps({"cluster": {"ps": ["127.0.0.1:1"]}, "task": {"type": "ps", "index": 0}})
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    started = [
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, env={**env, "TF_CONFIG": ps_config}),
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, env={**env, "TF_CONFIG": "not json"}),
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, env=env),
    ]
    try:
        processes = [psutil.Process(p.pid) for p in started]
        assert [role_of(p) for p in processes] == ["ps", "launcher", "launcher"]
        assert role_of(processes[0], by_task=True) == "ps 0"
        for p in processes:  # each has spun its 0.2 s of CPU once it waits on stdin
            deadline = time.monotonic() + 60
            while p.cpu_times().user + p.cpu_times().system < 0.2 and time.monotonic() < deadline:
                time.sleep(0.05)
        cpu = cpu_by_role(processes, by_task=True)
        assert set(cpu) == {"ps 0", "launcher"} and cpu["ps 0"] >= 0.2 and cpu["launcher"] >= 0.4, cpu
    finally:
        for p in started:
            p.stdin.close()
            p.wait(timeout=30)
    assert role_of(processes[0]) == "gone"
