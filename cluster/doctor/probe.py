"""`python -m cluster.doctor.probe [--matmul]`: what TensorFlow sees in this process, as one JSON line.

The doctor runs it once per worker with that worker's CUDA_VISIBLE_DEVICES, so the answer is what
the worker itself would see: its build, its GPUs, and (with --matmul) where a small matmul ran.
"""

from __future__ import annotations

import json
import os
import sys

from cluster.taskenv import gpu_visibility

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the doctor's console shows findings, not TF's start-up lines


def main() -> int:
    out: dict = {"cuda_visible_devices": gpu_visibility()}
    try:
        import tensorflow as tf

        out["build"] = {k: str(v) for k, v in tf.sysconfig.get_build_info().items()}
        gpus = tf.config.list_physical_devices("GPU")
        out["gpus"] = [d.name for d in gpus]
        if gpus and "--matmul" in sys.argv:
            with tf.device("/GPU:0"):
                a = tf.random.uniform((512, 512))
                product = tf.linalg.matmul(a, a)
            if not bool(tf.reduce_all(tf.math.is_finite(product))):
                raise RuntimeError("the matmul gave non-finite values")
            out["matmul_device"] = product.device
    except Exception as e:  # reported as the probe's finding
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
