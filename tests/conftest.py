import os
import sys

import torch

# Without CUDA, Triton kernels run only in Triton's interpreter, which must be chosen before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

import hf_async_cb  # noqa: E402,F401  (installs the hook)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_matmul_precision_kept():
    """Each test leaves torch's float32 matmul precision as it found it. torchao's quantize_ sets it to
    "high" (TF32 on CUDA) for the whole process by default; every later fp32 comparison on a GPU then
    compared against TF32 products (on the H200, the skinny GEMM's and the decode GEMMs' fp32 tests
    failed after a torchao test ran first)."""
    precision = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)
