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

for module, name, signature, constexprs in {kernels!r}:
    fn = getattr(importlib.import_module(module), name)
    signature = {{**signature, **{{k: "constexpr" for k in constexprs}}}}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 64),
                   options={options!r})
    print("compiled", name)
"""


def assert_compiles_for_sm90(kernels: list[tuple[str, str, dict, dict]], options: dict | None = None) -> None:
    """kernels: (module, kernel name, signature of the runtime arguments, constexpr values)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    script = _SCRIPT.format(kernels=kernels, options=options or {})
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == len(kernels)
