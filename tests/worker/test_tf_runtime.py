"""worker/tf_runtime.py: a server process loads TensorFlow's runtime without its Python API, serves what a
full client sends it, and falls back to the full import where the lean one fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import _free_port
from tests.helpers import ROOT

pytestmark = pytest.mark.cluster

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}

SERVE_LEAN = """
import json, os, sys
from worker import tf_runtime
tf = tf_runtime.load()
full_api = sorted(m for m in ("tensorflow._api.v2.compat.v1", "tensorflow.python.keras", "tf_keras", "keras") if m in sys.modules)
server = tf.Server(tf.ClusterSpec({"ps": [sys.argv[1]]}), job_name="ps", task_index=0, protocol="grpc", start=True)
devices = [d.device_type for d in tf.list_physical_devices()]
print(json.dumps({"lean": tf.lean, "full_api": full_api, "devices": devices}), flush=True)
sys.stdin.read()  # serve until the test closes stdin
sys.stdout.flush()
os._exit(0)  # a running TF server cannot be stopped in-process (worker/server.py leaves the same way)
"""

CLIENT = """
import sys
import tensorflow as tf
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({"ps": [sys.argv[1]]}), job_name="client")
with tf.device("/job:ps/task:0/device:CPU:0"):
    v = tf.Variable(tf.range(4.0))
@tf.function
def step(x):
    with tf.device("/job:ps/task:0/device:CPU:0"):
        v.assign_add(x)
        return tf.reduce_sum(v)
print(float(step(tf.ones(4))), v.device, ",".join(d.device_type for d in tf.config.list_physical_devices()))
"""


def test_a_lean_server_builds_no_python_api_and_runs_what_a_full_client_sends():
    address = f"127.0.0.1:{_free_port()}"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE_LEAN, address], cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        facts = json.loads(server.stdout.readline())
        assert facts["lean"] is True and facts["full_api"] == []
        command = [sys.executable, "-c", CLIENT, address]
        client = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr[-2000:]
        total, device, devices = client.stdout.split()
        assert float(total) == 10.0  # (0 + 1 + 2 + 3) + 4 ones, computed on the lean server
        assert device.startswith("/job:ps/")
        assert facts["devices"] == devices.split(","), "the lean runtime sees the devices the full import sees"
        server.stdin.close()
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


FALLBACK = """
import sys
from worker import tf_runtime
def moved(*args):
    raise AttributeError("an internal that moved")
tf_runtime._load_plugins = moved  # fails after the bare package and most of the runtime are imported
tf = tf_runtime.load()
import tensorflow
spec = tf.ClusterSpec({"ps": ["127.0.0.1:1"]})
print(tf.lean, tensorflow.__version__ != "", spec.as_dict()["ps"], float(tensorflow.constant(2.0) * 3))
"""


def test_where_the_lean_import_fails_the_full_import_still_serves():
    done = subprocess.run([sys.executable, "-c", FALLBACK], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "['127.0.0.1:1']", "6.0"]
