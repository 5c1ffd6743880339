"""Regenerate control_pb2*.py from control.proto (checked in; a test checks they are current).

Run: python -m cluster.control.proto.generate
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = "cluster/control/proto/control.proto"
OUTPUTS = ("control_pb2.py", "control_pb2.pyi", "control_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    # A child process: protoc inside a process that already loaded TensorFlow's protobuf can crash.
    args = [f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", PROTO]
    result = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed on {PROTO}: {result.stderr.strip()}")


def generated_files() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return {name: (Path(tmp) / "cluster" / "control" / "proto" / name).read_text() for name in OUTPUTS}


if __name__ == "__main__":
    for name, text in generated_files().items():
        (ROOT / "cluster" / "control" / "proto" / name).write_text(text)
    sys.exit(0)
