"""Where checkpoints are written (chief/state/route.py) and what an interrupted save leaves (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf
import tf_keras

from chief.state.checkpoints import Checkpoints
from chief.state.model_state import ModelState
from chief.state.route import chief_memory_bytes, route, unreachable_ps
from cluster.errors import PstrainError
from cluster.rundir import checkpoint_prefixes

pytestmark = pytest.mark.pure


def test_every_ps_reaching_the_directory_writes_its_own_shards():
    assert route([], size=10 << 30, free=1 << 30, directory=Path("/r/checkpoints")) == "direct"


def test_a_ps_without_the_directory_falls_back_to_the_chief_for_a_model_that_fits():
    assert route(["ps:1"], size=1 << 30, free=2 << 30, directory=Path("/r/checkpoints")) == "mirror"


def test_a_model_larger_than_the_chief_is_refused_saying_what_to_share():
    with pytest.raises(PstrainError) as refused:
        route(["ps:0", "ps:1"], size=60 << 30, free=20 << 30, directory=Path("/r/checkpoints"))
    message = str(refused.value)
    assert message.startswith("ps:0, ps:1 cannot write to /r/checkpoints, and the model's state (60.00 GiB)")
    assert "(20.00 GiB free): share /r with every ps at the same path (a shared mount)" in message


def test_a_keras3_variable_split_over_ps_is_checkpointed_by_the_chief_or_refused_naming_one_ps():
    assert route([], size=1 << 30, free=2 << 30, directory=Path("/r/checkpoints"), keras3_split=True) == "mirror"
    with pytest.raises(PstrainError) as refused:
        route([], size=60 << 30, free=20 << 30, directory=Path("/r/checkpoints"), keras3_split=True)
    assert str(refused.value).startswith("a Keras 3 variable split across ps tasks is checkpointed from a full copy")
    assert "use --ps 1" in str(refused.value)


def test_this_process_reaches_its_directory_and_not_a_missing_one(tmp_path):
    local = "/job:localhost/replica:0/task:0/device:CPU:0"
    assert unreachable_ps(tmp_path / "checkpoints", [local]) == []
    assert not list((tmp_path / "checkpoints").iterdir()), "the probe file is removed"
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory's parent should be: nothing can be written below it
    with pytest.raises(OSError):
        unreachable_ps(blocked / "checkpoints", [local])
    assert 0 < chief_memory_bytes()


def test_a_save_keeps_three_and_an_interrupted_one_leaves_nothing(tmp_path):
    model = tf_keras.Sequential([tf_keras.layers.Dense(2)])
    model.build((None, 3))
    state = ModelState(model, tf_keras.optimizers.legacy.SGD(), tf.Variable(0, dtype=tf.int64))
    checkpoints = Checkpoints(state, tmp_path)
    for step in (1, 2, 3, 4):
        state.global_step.assign(step)
        checkpoints.save(step)
    assert [p.name for p in checkpoint_prefixes(tmp_path)] == ["ckpt-2", "ckpt-3", "ckpt-4"]
    assert checkpoints.latest == str(tmp_path / "ckpt-4")
    (tmp_path / "ckpt-5_temp").mkdir()  # a save cut short: its parts, and data files merged without their index
    (tmp_path / "ckpt-5_temp" / "part-00000-of-00002.data-00000-of-00001").write_bytes(b"x")
    (tmp_path / "ckpt-5.data-00000-of-00002").write_bytes(b"x")
    assert checkpoints.restore_latest() == 4
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt-5" in p.name) == []
    assert [p.name for p in checkpoint_prefixes(tmp_path)] == ["ckpt-2", "ckpt-3", "ckpt-4"], "complete ones stay"
    assert list(tmp_path.glob("ckpt-4.data-*")), "and their data files"
