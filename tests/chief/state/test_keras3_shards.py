"""A Keras 3 table split over 2 ps (chief/state/keras3_shards.py), on real in-process TF servers: its
optimizer is built on the shards, the checkpoint mirror pairs each shard's slots with the full-size slot
they stack into (not by shape alone: Keras 3 makes one variable's momentum and velocity before the next
variable's, so two consecutive shards of the same shape are a momentum and a velocity), and what would
apply per shard is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.contract.framework import sharded_value, trainable_of
from chief.contract.job import JobError, load_job
from chief.state.checkpoints import checkpointed_variables
from chief.state.mirror import MirrorCheckpoints
from chief.state.model_state import build_state
from chief.state.sharding import partitioner
from chief.step.strategy import PeeredPSStrategy
from tests.jobs.keras3 import ids_data

pytestmark = pytest.mark.inprocess

SAMPLE = ids_data(1, 0)[0]["ids"]


@pytest.fixture(scope="module")
def strategy(in_process_cluster):
    return PeeredPSStrategy(in_process_cluster, variable_partitioner=partitioner(2))


def test_table_and_its_slots_are_shards_paired_with_the_full_size_slots(strategy, tmp_path):
    job = load_job("tests.jobs.keras3:Sharded")
    with strategy.scope():
        live = build_state(job, seed=0, sample=SAMPLE, ps_init_min_bytes=1 << 30)
    table = live.model.get_layer("big_table").embeddings
    shards = sharded_value(table).variables
    assert [s.shape.as_list() for s in shards] == [[1500, 48], [1500, 48]]
    assert {s.device for s in shards} == {"/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"}
    assert trainable_of(live.model)[:2] == list(shards)  # gradients are taken for the shards
    optimizer = live.optimizer
    momentum, velocity = optimizer._momentums[:2], optimizer._velocities[:2]  # Adam's slots of the two shards
    assert [m.value.device for m in momentum] == [s.device for s in shards]  # each slot beside its shard
    for i, (m, v) in enumerate(zip(momentum, velocity, strict=True)):
        m.assign(np.full([1500, 48], 1.0 + i, np.float32))
        v.assign(np.full([1500, 48], 10.0 + i, np.float32))
    mirror = MirrorCheckpoints(live, job, SAMPLE, tmp_path)
    mirror.sync()
    full = mirror._mirror.optimizer
    np.testing.assert_array_equal(full._momentums[0].numpy(), np.repeat([1.0, 2.0], 1500)[:, None] * np.ones(48))
    np.testing.assert_array_equal(full._velocities[0].numpy(), np.repeat([10.0, 11.0], 1500)[:, None] * np.ones(48))
    np.testing.assert_array_equal(mirror.model().get_layer("big_table").embeddings.numpy(), tf.concat(shards, 0).numpy())
    assert len(checkpointed_variables(live)) == len(checkpointed_variables(mirror._mirror)) + 3  # table, m, v: 2 shards


def test_an_update_over_the_whole_variable_is_refused_in_one_line(strategy):
    job = load_job("tests.jobs.keras3:ShardedLamb")
    with strategy.scope(), pytest.raises(JobError) as refused:
        build_state(job, seed=0, sample=SAMPLE, ps_init_min_bytes=1 << 30)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("--job tests.jobs.keras3:ShardedLamb: optimizer_fn: a Keras 3 Lamb updates big_table/embeddings")
    assert "use --ps 1" in message
