"""Cross-check against libCacheSim, an independent simulator (optional: GPL, never vendored).

libCacheSim counts block hits one by one, not prefix runs, so the stream is
fed to both as one-block requests; LRU and FIFO must then agree exactly.
"""

from pathlib import Path

import pytest

from engine.block_pool import BlockPool
from engine.context import RequestContext
from engine.traces import load_trace

lcs = pytest.importorskip("libcachesim", reason="libcachesim not installed (pip install kvgate[sim])")

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def block_stream():
    trace = load_trace(MOONCAKE)
    return [key for request in trace.requests for key in request.keys][:60000]


@pytest.mark.parametrize("policy, cache_cls", [("lru", "LRU"), ("fifo", "FIFO")])
@pytest.mark.parametrize("capacity", [500, 4392])
def test_block_level_hits_equal_libcachesim(block_stream, policy, cache_cls, capacity):
    reference = getattr(lcs, cache_cls)(capacity)
    expected = 0
    for key in block_stream:
        req = lcs.Request()
        req.obj_id, req.obj_size = key, 1
        expected += bool(reference.get(req))
    pool = BlockPool(capacity, policy=policy)
    ctx = RequestContext()
    ours = 0
    for t, key in enumerate(block_stream):
        blocks, hits = pool.touch_or_insert([key], ctx, float(t))
        pool.release(blocks, ctx, float(t))
        ours += hits
    assert expected > 500  # the stream has real reuse at this size
    assert ours == expected
