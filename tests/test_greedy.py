"""The one-pass greedy kernel against torch's argmax and log_softmax (Triton's interpreter on the CPU)."""

import pytest
import torch

from hf_async_cb.greedy import greedy_packed
from hf_async_cb.sampling import pack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 5003), (64, 2048), (5, 128256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_packed_is_argmax_and_its_log_softmax(rows, vocab, dtype):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[0, vocab // 3] = float("-inf")
    if rows > 2:  # exact ties: the first index wins, as in torch
        logits[1, [vocab // 2, vocab - 1, 3]] = logits[1].max() + 1
    logits = logits.to(DEVICE)
    got = greedy_packed(logits)
    x = logits.float()
    tokens = x.argmax(-1)
    expected = pack(tokens, x.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1].view(torch.float64), expected[1].view(torch.float64), rtol=1e-5, atol=1e-5)


def test_greedy_packed_reads_strided_rows():
    logits = torch.randn(4, 3000, device=DEVICE)[:, :2999]
    got = greedy_packed(logits)
    assert torch.equal(got[0], logits.argmax(-1))


COMPILE_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_async_cb import greedy
from hf_async_cb.attention import store_kv

def build(fn, sig, const):
    sig = {**sig, **{k: "constexpr" for k in const}}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 64))
    print("compiled", fn.__name__)

build(greedy._greedy_parts_kernel, {"logits_ptr": "*bf16", "max_ptr": "*fp32", "idx_ptr": "*i32", "sum_ptr": "*fp32",
      "vocab": "i32", "stride_row": "i64", "chunk": "i32"}, dict(NUM_PARTS=8, BLOCK=greedy.BLOCK))
build(greedy._greedy_merge_kernel, {"max_ptr": "*fp32", "idx_ptr": "*i32", "sum_ptr": "*fp32", "tokens_ptr": "*i64",
      "logprobs_ptr": "*fp64", "vocab": "i32"}, dict(NUM_PARTS=8))
sig = {n: "*bf16" for n in ("k_ptr", "v_ptr", "k_pool_ptr", "v_pool_ptr")}
sig.update({"slots_ptr": "*i64"}, **{n: "i64" for n in "stride_kh stride_kt stride_vh stride_vt stride_pool_t stride_pool_h".split()})
build(store_kv._store_kv_kernel, sig, dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
"""


def test_kernels_compile_for_sm90():
    """The greedy and K/V store kernels compile for an H200 (no GPU needed), without the interpreter."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_CHECK], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("compiled") == 3
