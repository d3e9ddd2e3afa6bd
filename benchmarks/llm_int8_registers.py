"""Registers, spills and shared memory of the LLM.int8() kernels (kernels/llm_int8.py) for an H200
(sm_90), compiled on any machine, no GPU: Triton builds the PTX for the target and its bundled ptxas
reports each kernel's resources (`-v`). A kernel that spills, or whose registers cut the blocks an SM
holds, shows here before any device time is spent.

    python benchmarks/llm_int8_registers.py [--kernel-from FILE] [--rows 1,32,256]

Run it with TRITON_INTERPRET unset. `--kernel-from` reads another copy of kernels/llm_int8.py (an
earlier commit's: `git show REV:hf_async_cb/kernels/llm_int8.py > FILE`).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
_POINTERS = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
             torch.int32: "*i32"}


def _module(path: str | None):
    if path is None:
        from hf_async_cb.kernels import llm_int8
        return llm_int8
    spec = importlib.util.spec_from_file_location("llm_int8_from_file", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def resources(variant) -> str:
    """ptxas -v's register and spill line of one compiled variant, with its shared memory."""
    fn = getattr(variant.kernel, "fn", variant.kernel)
    names = list(inspect.signature(fn).parameters)[:len(variant.args)]
    signature = {a: (_POINTERS[t] if isinstance(t, torch.dtype) else "fp32" if isinstance(t, float) else "i32")
                 for a, t in zip(names, variant.args)}
    aligned = [a for a, t in zip(names, variant.args) if isinstance(t, torch.dtype) or (type(t) is int and t % 16 == 0)]
    attrs = {(variant.kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    kernel = triton.compile(ASTSource(fn=variant.kernel, signature={**signature, **{c: "constexpr" for c in variant.constexprs}},
                                      constexprs=variant.constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 64), options=dict(variant.options))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                capture_output=True, text=True)
    lines = [line.split("info    :")[-1].strip() for line in (report.stderr + report.stdout).splitlines()
             if "registers" in line or "spill" in line]
    return f"shared {kernel.metadata.shared} B; " + "; ".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel-from")
    p.add_argument("--rows", default="1,32,256")
    args = p.parse_args(argv)
    module = _module(args.kernel_from)
    for name, (n, k) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            for variant in module.variants(n, k, torch.bfloat16, None, True, rows):
                kernel = getattr(variant.kernel, "fn", variant.kernel).__name__
                print(f"{name:>8} {rows:>4} rows {kernel:<22} {resources(variant)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
