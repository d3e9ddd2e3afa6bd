import os
import sys

import torch

# Without CUDA, Triton kernels run only in Triton's interpreter, which must be chosen before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread without CUDA (unless OMP_NUM_THREADS says otherwise), here and in the processes
# the tests start: the models are tiny, and on a machine of few cores two OpenMP threads per process,
# contending with the engine's own step thread (async mode, replicas) or another process, made steps
# up to ~100x slower, most of the suite's time (test_cli and test_serving did this for their runs).
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Parity passes are not kept on disk between test processes (engine/parity_store.py; its own tests
# turn it on in a folder of their own): tests patch the engine or the model's code and expect the check to run.
os.environ["HF_ASYNC_CB_KEEP_PARITY"] = "0"

sys.path.insert(0, os.path.dirname(__file__))

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_patch import cache_np_dtypes, skip_nested_patches  # noqa: E402

    skip_nested_patches()  # (a nested jit helper's call re-patched triton.language each time)
    cache_np_dtypes()  # (the dtype map was built afresh at each of its calls)

import hf_async_cb  # noqa: E402,F401  (installs the hook)

import pytest  # noqa: E402

from hf_async_cb.engine.stack_chunk import above_a_large_stack_chunk  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The whole session's tests run above one frame that opens a 256 KiB chunk of Python's frame stack
    (engine/stack_chunk.py: on Python 3.11 a loop whose calls cross a chunk's end maps and unmaps a chunk each
    time; the Triton interpreter's kernels did, for a third of some files' time)."""
    import _pytest.main

    others = [impl for impl in session.config.hook.pytest_runtestloop.get_hookimpls()
              if not (impl.hookwrapper or impl.wrapper) and impl.plugin not in (_pytest.main, sys.modules[__name__])]
    if others:  # another plugin runs the tests its own way (pytest-xdist's -n, its workers): left to it
        return None
    return above_a_large_stack_chunk(_pytest.main.pytest_runtestloop, session)


@pytest.fixture(autouse=True)
def _float32_matmul_precision_kept():
    """Each test leaves torch's float32 matmul precision as it found it. torchao's quantize_ sets it to
    "high" (TF32 on CUDA) for the whole process by default; every later fp32 comparison on a GPU then
    compared against TF32 products (on the H200, the skinny GEMM's and the decode GEMMs' fp32 tests
    failed after a torchao test ran first)."""
    precision = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)
