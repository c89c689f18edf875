"""The pipeline's parts that need no second process: micro-batches by slot group, the head's cache
operations replayed on a worker's cache, ranks from torchrun's environment, and -pp's rules."""
from __future__ import annotations

import pytest
import torch

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.errors import ConfigError
from engine.files.weights import open_model
from engine.model.batch import Row
from engine.model.kv_cache import PagedKVCache
from engine.pipeline.head import MirroredCache, micro_batches
from engine.pipeline.ranks import Rank, from_env
from engine.pipeline.worker import WorkerStage
from engine.preflight import read_headers
from engine.settings import EngineConfig, SpecConfig


def rows(*slots: int) -> list[Row]:
    return [Row(s, 0, [1]) for s in slots]


def test_micro_batches_group_consecutive_slots_evenly():
    assert micro_batches(rows(3, 0, 2, 1), 2) == [[1, 3], [2, 0]]  # slots 0, 1 | 2, 3 (indices into the rows)
    assert micro_batches(rows(0, 1, 2), 2) == [[0], [1, 2]]
    assert micro_batches(rows(5), 4) == [[0]]  # never an empty micro-batch
    assert micro_batches(rows(0, 1), 1) == [[0, 1]]


def test_a_worker_replaying_the_heads_cache_operations_holds_the_same_pages():
    """The scheduler works on the head's pool; the worker's pool, given the operations in order,
    must hand out the same pages, including when the pool runs short and a request is preempted."""
    head = PagedKVCache(1, 3, 96, 1, 4)
    worker = WorkerStage.__new__(WorkerStage)  # its cache alone: the layers play no part here
    worker.cache = PagedKVCache(1, 3, 96, 1, 4)
    keys = torch.randn(head.k[0].shape)
    for cache in (head, worker.cache):
        cache.k[0].copy_(keys)
    queued: list = []
    mirrored = MirroredCache(head, queued)
    assert mirrored.ensure(0, 20) and mirrored.ensure(1, 17) and mirrored.ensure(2, 5)
    assert not mirrored.ensure(2, 40)  # the pool is short: nothing taken
    mirrored.truncate(0, 3)
    assert mirrored.ensure(2, 30)
    mirrored.move(1, 16, 12)  # a kept tree sibling's K/V
    worker.apply(queued)
    assert worker.cache.pool.pages == head.pool.pages and worker.cache.pool.free == head.pool.free
    assert all(torch.equal(a, b) for a, b in zip(worker.cache._index, head._index))
    assert torch.equal(worker.cache.k[0], head.k[0]) and not torch.equal(head.k[0], keys)


def test_ranks_come_from_torchruns_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert from_env(2, env) == Rank(1, 2, "env://")
    assert from_env(2, {}) is None  # not started by torchrun: the head starts its workers
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3: must equal the WORLD_SIZE=2"):
        from_env(3, env)
    # With the draft on a rank of its own, the world is one larger, and its last rank is the draft.
    assert from_env(1, env, draft=True) == Rank(1, 2, "env://", True) and Rank(1, 2, "env://", True).is_draft
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 with spec_draft_rank: must be one less than the "
                                          r"WORLD_SIZE=2"):
        from_env(2, env, draft=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    config = tiny_config()  # 3 layers
    return str(write_tiny_model(config, tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.mark.parametrize("fields, message", [
    ({"pipeline_parallel_size": 4}, r"pipeline_parallel_size=4: must be at most the model's 3 trunk layers"),
    ({"pipeline_parallel_size": 2, "devices": ("cpu", "cpu", "cpu")},
     r"devices='cpu,cpu,cpu': with pipeline_parallel_size=2, must list one device per stage \(2\)"),
    ({"pipeline_parallel_size": 2, "layer_split": (1, 1)}, r"layer_split='1,1': must sum to the model's 3"),
    ({"draft_rank": True}, r"spec_draft_rank=True: needs a draft model to place .*not spec_type=none"),
    ({"draft_rank": True, "spec": SpecConfig(type="ngram-simple")}, r"not spec_type=ngram-simple"),
])
def test_bad_pipelines_are_refused_before_loading(tiny, fields, message):
    with pytest.raises(ConfigError, match=message):
        read_headers(EngineConfig(model=tiny, **fields))


def test_pipeline_layer_split_is_per_stage(tiny):
    headers = read_headers(EngineConfig(model=tiny, pipeline_parallel_size=2, layer_split=(2, 1)))
    assert headers.placement.stage_ranges() == [range(0, 2), range(2, 3)] and headers.placement.devices == ("cpu",) * 2


def test_a_worker_reads_only_its_layers(tiny):
    tensors = open_model(tiny).load_tensors(range(1, 3), ends=False)
    assert tensors and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in tensors)
