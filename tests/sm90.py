"""Compile Triton kernels for an H200 (sm_90) without a GPU: a fresh process without Triton's
interpreter (the test process runs with it), so CI catches a kernel that would not build."""

import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for module, name, signature, constexprs, *own in {kernels!r}:
    fn = getattr(importlib.import_module(module), name)
    signature = {{**signature, **{{k: "constexpr" for k in constexprs}}}}
    own = dict(own[0]) if own else {{}}
    attrs = {{(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in own.pop("divisible_by_16", ())}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 64), options={{**{options!r}, **own}})
    print("compiled", name, kernel.metadata.shared)
"""


def assert_compiles_for_sm90(kernels: list[tuple], options: dict | None = None) -> list[int]:
    """kernels: (module, kernel name, signature of the runtime arguments, constexpr values[, this
    kernel's own options over `options`, e.g. num_warps, and "divisible_by_16": the arguments a launch
    would see 16-divisible (aligned pointers, sizes), without which Triton does not pipeline loads
    through shared memory]). Returns each kernel's shared memory in bytes."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    script = _SCRIPT.format(kernels=kernels, options=options or {})
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("compiled ")]
    assert len(lines) == len(kernels), result.stdout
    return [int(line[2]) for line in lines]
