"""Where an LLM.int8() decode projection's time goes on the GPU: kernels/llm_int8.py's two kernels (the
statistics pass and the int8 GEMM) beside bitsandbytes' own forward and cuBLAS on the bf16 weight of
the same shape, per Llama-3-8B projection and rows count.

    PYTHONPATH=. python benchmarks/llm_int8_probe.py [--rows 1,32,128] [--json out.json]

Ours and cuBLAS are timed replayed from CUDA graphs (kernels/graph_timing.py), weights rotated over
copies larger than the L2 (a decode step finds none in L2); bitsandbytes' own forward cannot be
captured (it sizes its outlier columns on the host), so it is timed eagerly with CUDA events, its
launches and host round trip included, which is what a step pays for it. Activations hold one
outlier column (the threshold 6.0 reached in one row), as real models' do; `--outlier-share 0.1`
flags that share of the columns instead (each in one random row), as random weights' down-projection
inputs do (on a random bf16 Llama-3-8B about 80% of them over 512 tokens, a few per 128-column
chunk at 32 rows: every chunk then takes the outlier product). Also reports the achieved bandwidth
of ours over the int8 weight's bytes. `--kernel-from FILE` times another copy of kernels/llm_int8.py (an
earlier commit's, `git show REV:hf_async_cb/kernels/llm_int8.py > FILE`) in place of the package's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}


def main(argv=None) -> int:
    import bitsandbytes as bnb

    from hf_async_cb.kernels.graph_timing import cold_copies, eager_ms, graph_ms

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32,128")
    p.add_argument("--outlier-share", type=float, default=0.0,
                   help="share of the columns holding an outlier (0: one column)")
    p.add_argument("--kernel-from", help="a kernels/llm_int8.py file to time in place of the package's")
    p.add_argument("--json")
    args = p.parse_args(argv)
    llm_int8_linear = _kernel(args.kernel_from)
    device = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        copies = cold_copies(n * k)
        modules = []
        for i in range(copies):
            m = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=6.0)
            m.weight = bnb.nn.Int8Params(torch.randn(n, k) * 0.02, requires_grad=False, has_fp16_weights=False)
            modules.append(m.to(device).eval())
        plain = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(cold_copies(2 * n * k))]
        states = [(m.weight.data, (m.state.SCB if m.state.SCB is not None else m.weight.SCB)) for m in modules]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            x[0, 7] = 9.0
            if args.outlier_share > 0:
                columns = torch.randperm(k, device=device)[:max(1, int(args.outlier_share * k))]
                x[torch.randint(0, rows, (len(columns),), device=device), columns] = 9.0
            real = torch.ones(rows, dtype=torch.int8, device=device)
            ours = graph_ms(lambda i: llm_int8_linear(x, *states[i % copies], 6.0, real=real))
            cublas = graph_ms(lambda i: torch.nn.functional.linear(x, plain[i % len(plain)]))
            with torch.no_grad():
                own = eager_ms(lambda i: modules[i % copies](x))
                exact = torch.equal(llm_int8_linear(x, *states[0], 6.0), modules[0](x))
            row = dict(kernel=args.kernel_from or "package", projection=name, n=n, k=k, rows=rows, outlier_share=args.outlier_share, ours_us=round(ours * 1e3, 1),
                       bnb_own_us=round(own * 1e3, 1), cublas_bf16_us=round(cublas * 1e3, 1),
                       ours_tb_s=round(n * k / (ours * 1e-3) / 1e12, 2), equal_to_bnb=exact)
            results.append(row)
            print(row, flush=True)
        del modules, plain, states
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _kernel(path: str | None):
    """llm_int8_linear from the package, or from the file at `path` (loaded as a module of its own)."""
    if path is None:
        from hf_async_cb.kernels.llm_int8 import llm_int8_linear
        return llm_int8_linear
    import importlib.util
    spec = importlib.util.spec_from_file_location("llm_int8_from_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.llm_int8_linear


if __name__ == "__main__":
    sys.exit(main())
