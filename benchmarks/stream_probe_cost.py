"""What model/stream_probe.py adds to an engine's build on CUDA: the first probe of a process (the
profiler's start-up included) and a later one, on a Llama of the 8B shape's width with one projection
of a class from outside torch (what a quantized library's linear is to the probe).

    PYTHONPATH=. python benchmarks/stream_probe_cost.py
"""

import time

import torch

from hf_async_cb.model import stream_probe


def foreign(name: str) -> type:
    return type(name, (torch.nn.Linear,), {"__module__": "mylib.layers"})


def main() -> None:
    device = torch.device("cuda")
    layers = torch.nn.ModuleList([foreign("FirstLinear")(4096, 4096, bias=False),
                                  foreign("SecondLinear")(4096, 14336, bias=False)]).to(device, torch.bfloat16)
    for module in layers:
        holder = torch.nn.ModuleDict({"proj": module})
        start = time.perf_counter()
        found = stream_probe.probe(holder, torch.bfloat16)
        seconds = time.perf_counter() - start
        print(f"probe of {type(module).__name__}: {seconds * 1e3:.1f} ms; off-stream: {found or 'none'}; "
              f"verdict {stream_probe.verdict(module)}", flush=True)


if __name__ == "__main__":
    main()
