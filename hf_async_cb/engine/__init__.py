"""The engine core: requests in, tokens out, one step at a time.

    engine.py          Engine: owns the pool, scheduler, builder, runner and loops
    requests.py        Request, SamplingParams, RequestOutput, FinishReason
    seeding.py         which seed each sampled request gets
    scheduler.py       which requests run in the next step (pure Python)
    step_plan.py       a step's plan: the chunks it feeds, the requests preempted, the pages it copies
    page_allocator.py  the KV pool's free list with reference counts (pure Python)
    page_table.py      every running request's pages as one numpy row
    batch.py           a step plan -> packed host arrays, uploaded through an I/O slot
    io_slots.py        the two alternating pinned/device buffer sets of the pipeline
    pipeline.py        the loop, sync or async (CPU prepares step N+1 while the GPU runs step N)
    runner.py          the device work of one step: carry-over, forward, processors, draw
    cuda_graphs.py     steps replayed from CUDA graphs, one per bucket
    graph_keys.py      the buckets steps are padded to, and their graphs' keys
    captured_graph.py  one bucket's graph: static copies of its inputs, capture, replay
    online.py          the background loop and request handles
    profiling.py       per-step CPU/GPU spans and the timeline picture
"""

from hf_async_cb.engine.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str):
    """The 0.2 module hf_async_cb.engine is now engine/engine.py: its other names still resolve."""
    from hf_async_cb.engine import engine

    if name.startswith("__") or not hasattr(engine, name):
        raise AttributeError(f"module 'hf_async_cb.engine' has no attribute {name!r}")
    return getattr(engine, name)
