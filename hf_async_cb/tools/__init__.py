"""Tools around the engine: the benchmarks on random weights in real shapes, and the demo's model.

    bench.py       the same workload through every generation path, with the bandwidth floor
    timing.py      one call timed with the device synced, on an emptied prefix cache where asked
    serving.py     requests arriving over time at a held engine: TTFT, ITL and E2E latency (its
                   parts in serving_workload, _warmup, _client, _engine, _hf_cb, _metrics)
    shared_prefix.py  shared-prefix workloads: what prefix caching saves
    breakdown.py   where a step's time goes: kernel time by kind, each GEMM's TB/s
    demo_model.py  SmolLM2-135M-Instruct from a GGUF file shipped on PyPI (no download at run time)
"""
