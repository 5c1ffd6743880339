"""The adapted-layer record (chief/state/adapted.py): written at a run's first start, matched on a resume."""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras

from chief.contract.job import JobError
from chief.state.adapted import check_adapted

pytestmark = pytest.mark.pure


def text_model(words: list[str]) -> tf_keras.Model:
    column = tf_keras.Input((), dtype="string")
    lookup = tf_keras.layers.StringLookup(output_mode="one_hot")
    lookup.adapt(np.array(words))
    return tf_keras.Model(column, tf_keras.layers.Dense(1)(lookup(column)))


def test_a_resume_must_adapt_the_same_vocabulary(tmp_path):
    record = tmp_path / "adapted.json"
    check_adapted(text_model(["a", "b", "b"]), record, resumed=False)
    assert record.exists()
    check_adapted(text_model(["a", "b", "b"]), record, resumed=True)  # the same data: the same vocabulary
    with pytest.raises(JobError, match="its adapted StringLookup differs from the one this run started with"):
        check_adapted(text_model(["a", "c", "c"]), record, resumed=True)
    check_adapted(text_model(["a", "c", "c"]), record, resumed=False)  # a run started afresh records anew
    check_adapted(text_model(["a", "c", "c"]), record, resumed=True)


def test_a_model_without_adapted_layers_writes_no_record(tmp_path):
    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(1)])
    check_adapted(model, tmp_path / "adapted.json", resumed=False)
    assert not (tmp_path / "adapted.json").exists()
