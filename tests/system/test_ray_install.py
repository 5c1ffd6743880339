"""The Ray extra as docs/ray.md installs it (`deploy/install_ray.sh`) keeps the one TensorFlow and the
editable pstrain, and `pstrain doctor` passes afterwards.

`pip install .[ray]` pulled the full `tensorflow` (572 MB; tf_keras depends on that name) beside
tensorflow-cpu and replaced the editable install with a copy (issue 36). The test installs Ray for real,
with pip, into a new venv that sees the project's .venv through a view of its site-packages without
Ray (symlinks, one `site.addsitedir`): the same TensorFlow, tf_keras and editable pstrain, at no
TensorFlow download. Ray's wheel (~70 MB) comes from pip's cache or the package index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.cluster
TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly")


def site_packages(prefix: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


def new_venv_viewing_ours(tmp_path: Path) -> Path:
    """A venv whose sys.path holds a view of this .venv's site-packages without Ray."""
    ours = site_packages(Path(sys.prefix))
    view = tmp_path / "view"
    view.mkdir()
    for entry in ours.iterdir():
        if not entry.name.lower().startswith("ray"):
            (view / entry.name).symlink_to(entry)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    (site_packages(env_dir) / "zz_pstrain_view.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    # The same set-up as .venv: bootstrap.sh (sourced by install_ray.sh) finds it done.
    (env_dir / ".pstrain-bootstrap").write_text((Path(sys.prefix) / ".pstrain-bootstrap").read_text())
    return env_dir


def test_the_documented_ray_install_keeps_one_tensorflow_and_the_editable_pstrain(tmp_path):
    if not (Path(sys.prefix) / ".pstrain-bootstrap").exists():
        pytest.skip("runs from the .venv that deploy/bootstrap.sh made")
    env_dir = new_venv_viewing_ours(tmp_path)
    python = str(env_dir / "bin" / "python")
    env = {**os.environ, "PSTRAIN_VENV": str(env_dir), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    installed = subprocess.run(["bash", "deploy/install_ray.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "TensorFlow and the editable pstrain kept" in installed.stdout, installed.stdout
    probe = subprocess.run(
        [
            python,
            "-c",
            "import json, re, importlib.metadata as m, ray, cluster;"
            "names = sorted({re.sub('[-_.]+', '-', d.metadata['Name']).lower() for d in m.distributions()});"
            "print(json.dumps({'names': names, 'ray': ray.__file__, 'version': ray.__version__, 'cluster': cluster.__file__}))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    tensorflows = [n for n in seen["names"] if n in TF_DISTRIBUTIONS]
    assert tensorflows in (["tensorflow-cpu"], ["tensorflow"]), seen["names"]  # (tensorflow: a GPU machine's bootstrap)
    assert seen["ray"].startswith(str(env_dir)), "Ray installed into the new venv"
    assert seen["version"] == "2.60.0"
    assert seen["cluster"] == str(ROOT / "cluster" / "__init__.py"), "pstrain still the editable install of this checkout"
    doctor = subprocess.run([python, "-m", "cluster.cli", "doctor"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert not [line for line in doctor.stdout.splitlines() if line.startswith(("FAIL", "WARN  tensorflow"))], doctor.stdout
