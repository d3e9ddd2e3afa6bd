"""The vision towers' packed attention: one SDPA call per window length equals one per window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_async_cb.model import vision_attention
from hf_async_cb.model.vision_attention import varlen_attention


@pytest.mark.parametrize("lengths", [
    [16, 7, 16, 0, 3, 16, 7],  # windows of one length apart: gathered
    [0, 16, 16, 0, 16],  # equal windows tiling the sequence (Qwen2.5-VL on grids its windows divide): views
    [16, 16, 7, 3, 7, 5, 5],  # runs end to end (16, 3, 5) read as views, the 7s gathered
])
def test_windows_stacked_by_length_equal_one_call_per_window(lengths):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v = (torch.randn(1, 4, sum(lengths), 8, generator=g) for _ in range(3))
    out, _ = varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    parts = [F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), scale=0.3)
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    expected = torch.cat(parts, dim=2).transpose(1, 2)
    assert out.shape == (1, sum(lengths), 4, 8)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_without_windows_it_is_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    out, _ = varlen_attention(None, q, k, v, scaling=0.5)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=0.5).transpose(1, 2))


@pytest.mark.parametrize("lengths, gathers", [([0, 16, 16, 0, 16], 0), ([16, 16, 7, 3, 7, 5, 5], 3),
                                              ([16, 7, 16], 3)])
def test_windows_lying_end_to_end_are_read_without_a_gather(lengths, gathers):
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v = (torch.randn(1, 2, sum(lengths), 8) for _ in range(3))
    with torch.autograd.profiler.profile() as prof:
        varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert sum(e.name == "aten::index" for e in prof.function_events) == gathers  # q, k, v per gathered length


@pytest.mark.parametrize("lengths", [[64] * 6, [16, 16, 7, 3, 7, 5, 5]])
def test_a_towers_layers_read_their_windows_from_the_device_once(lengths, monkeypatch):
    # Every layer of a kind gets the same cu_seqlens tensor: reading it (a device sync, a pass over every
    # window) happens at the first layer only; a tensor changed in place is read again.
    cu = torch.tensor([0] + lengths).cumsum(0)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(3))
    reads, read = [], vision_attention._read_layout
    monkeypatch.setattr(vision_attention, "_read_layout", lambda cu: reads.append(1) or read(cu))
    first, _ = varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    again, _ = varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert len(reads) == 1 and torch.equal(again, first)
    cu[1:] = cu[-1].clone()  # one window over everything now, written in place: read afresh
    whole, _ = varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert len(reads) == 2
    assert torch.allclose(whole, F.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(1, 2), atol=1e-6)


def test_windows_of_tensors_made_under_inference_mode():
    # Inference tensors keep no version counter: their layouts are read (and kept within a tower call) all
    # the same. A generate under torch.inference_mode() reaches here with such a cu_seqlens.
    lengths = [16, 16, 7, 3, 7]
    with torch.inference_mode():
        cu = torch.tensor([0] + lengths).cumsum(0)
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(3))
        out, _ = varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        again, _ = varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    want = torch.cat([F.scaled_dot_product_attention(*(t[:, :, s:s + n] for t in (q, k, v)), scale=0.3)
                      for s, n in zip(starts, lengths)], dim=2).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-6) and torch.equal(again, out)
