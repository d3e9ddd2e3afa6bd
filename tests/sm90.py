"""Compile Triton kernels for an H200 (sm_90) without a GPU: in a process without Triton's interpreter
(the test process runs with it), so CI catches a kernel that would not build.

One such process serves every test of the session, started at the first request: importing torch,
Triton and the kernels took 6 of a test's 7.5 s on the CI's machine, once per test."""

import atexit
import os
import subprocess
import sys
import tempfile

import pytest

# Reads one request a line (the repr of (kernels, options, needles)), answers "compiled NAME SHARED COUNTS"
# per kernel (COUNTS: how often each needle occurs in its PTX, comma-separated) and "error TRACEBACK" if
# one fails, then "end".
_SERVER = r"""
import importlib, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for request in sys.stdin:
    try:
        kernels, options, needles = eval(request)
        for module, name, signature, constexprs, *own in kernels:
            fn = getattr(importlib.import_module(module), name)
            signature = {**signature, **{k: "constexpr" for k in constexprs}}
            own = dict(own[0]) if own else {}
            attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in own.pop("divisible_by_16", ())}
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 64), options={**options, **own})
            counts = ",".join(str(kernel.asm["ptx"].count(needle)) for needle in needles) or "-"
            print("compiled", name, kernel.metadata.shared, counts, flush=True)
    except Exception:
        print("error", repr(traceback.format_exc()[-3000:]), flush=True)
    print("end", flush=True)
"""
_server: subprocess.Popen | None = None


def _compiler() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        log = tempfile.TemporaryFile(mode="w+")  # (its warnings: a pipe nobody reads would fill and block it)
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, text=True)
        _server.log = log
        atexit.register(_server.kill)
    return _server


def assert_compiles_for_sm90(kernels: list[tuple], options: dict | None = None) -> list[int]:
    """kernels: (module, kernel name, signature of the runtime arguments, constexpr values[, this
    kernel's own options over `options`, e.g. num_warps, and "divisible_by_16": the arguments a launch
    would see 16-divisible (aligned pointers, sizes), without which Triton does not pipeline loads
    through shared memory]). Returns each kernel's shared memory in bytes."""
    return [shared for shared, _ in _compile(kernels, options, ())]


def ptx_counts(kernels: list[tuple], needles: tuple[str, ...], options: dict | None = None) -> list[list[int]]:
    """Per kernel (as assert_compiles_for_sm90 takes them), how often each of `needles` occurs in its
    sm_90 PTX (e.g. "fma.rn.f32": which products the compiler fused into an add)."""
    return [counts for _, counts in _compile(kernels, options, tuple(needles))]


def _compile(kernels: list[tuple], options: dict | None, needles: tuple[str, ...]) -> list[tuple[int, list[int]]]:
    pytest.importorskip("triton.backends.nvidia")
    server = _compiler()
    server.stdin.write(repr((list(kernels), options or {}, needles)).replace("\n", " ") + "\n")
    server.stdin.flush()
    lines = []
    for line in server.stdout:
        if line.startswith("end"):
            break
        lines.append(line.rstrip("\n"))
    else:
        server.log.seek(0)
        raise AssertionError(f"the sm_90 compiler process exited: {server.log.read()[-3000:]}")
    errors = [line for line in lines if line.startswith("error ")]
    assert not errors, eval(errors[0][len("error "):])
    compiled = [line.split() for line in lines if line.startswith("compiled ")]
    assert len(compiled) == len(kernels), lines
    return [(int(line[2]), [int(c) for c in line[3].split(",")] if line[3] != "-" else []) for line in compiled]
