"""The one-pass greedy kernel against torch's argmax and log_softmax (Triton's interpreter on the CPU)."""

import pytest
import torch
from sm90 import assert_compiles_for_sm90

from hf_async_cb.kernels.draw_greedy import BLOCK, greedy_packed
from hf_async_cb.sampling.sampler import pack

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


def test_greedy_packed_picks_nan_and_infinities_as_torch_argmax():
    """A NaN row takes its first NaN (torch's argmax), an all -inf row token 0, +inf its first +inf."""
    logits = torch.randn(4, 3000)
    logits[0, [2500, 17]] = float("nan")
    logits[1] = float("-inf")
    logits[2, [900, 2999]] = float("inf")
    got = greedy_packed(logits.to(DEVICE))
    assert got[0].tolist()[:3] == logits.argmax(-1).tolist()[:3] == [17, 0, 900]
    assert torch.isnan(got[1, :3].view(torch.float64)).all()


def test_greedy_packed_reads_strided_rows():
    logits = torch.randn(4, 3000, device=DEVICE)[:, :2999]
    got = greedy_packed(logits)
    assert torch.equal(got[0], logits.argmax(-1))


def test_kernels_compile_for_sm90():
    """The greedy and K/V store kernels compile for an H200 (no GPU needed), without the interpreter."""
    parts = {"logits_ptr": "*bf16", "max_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "sum_ptr": "*fp32",
             "vocab": "i32", "stride_row": "i64", "chunk": "i32", "num_parts": "i32"}
    merge = {"max_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "sum_ptr": "*fp32", "tokens_ptr": "*i64",
             "logprobs_ptr": "*fp64", "vocab": "i32", "num_parts": "i32"}
    store = {n: "*bf16" for n in ("k_ptr", "v_ptr", "k_pool_ptr", "v_pool_ptr")}
    store.update({"slots_ptr": "*i64"}, **{n: "i64" for n in "stride_kh stride_kt stride_vh stride_vt stride_kpool_t "
                                                              "stride_kpool_h stride_vpool_t stride_vpool_h".split()})
    assert_compiles_for_sm90([
        ("hf_async_cb.kernels.draw_greedy", "_greedy_parts_kernel", parts, dict(BLOCK=BLOCK)),
        ("hf_async_cb.kernels.draw_greedy", "_greedy_merge_kernel", merge, dict()),
        ("hf_async_cb.kernels.store_kv", "_store_kv_kernel", store,
         dict(K_HEADS=8, K_DIM=128, V_HEADS=8, V_DIM=128, BLOCK_KH=8, BLOCK_KD=128, BLOCK_VH=8, BLOCK_VD=128,
              ALIGNED=True)),
    ])
