"""Reading quantized weights' contents (model/weight_kinds.content_sums, every call's check that the
weights did not change) without running the quantization library's own code on them."""

import copy

import pytest
import torch
from models import tiny_model

from hf_async_cb.model.weight_kinds import content_sums, held_tensors


def test_a_self_dispatching_weight_is_read_through_its_inner_tensors_only(monkeypatch):
    """quanto's weights pass `isinstance(w, nn.Parameter)`, yet answer an op they do not know (a detach
    seen through, `as_subclass`) by dequantizing: on a fresh GPU machine that first built quanto's CUDA
    extension, 90 s of an 8B model's first call. Their contents are read through the inner tensors
    alone, and a write to one of those still shows."""
    quanto = pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    model = copy.deepcopy(tiny_model("llama"))
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, torch.nn.Parameter)
    inner = held_tensors(weight)
    before = content_sums([weight, *inner])

    def refuse(*args, **kwargs):
        raise AssertionError("an op ran on the quantized weight itself")

    monkeypatch.setattr(type(weight), "__torch_dispatch__", classmethod(refuse))
    sums = content_sums([weight, *inner])
    monkeypatch.undo()
    assert sums == before and sums[0] is None
    assert sum(s is not None for s in sums) >= 2  # the packed data and the scales were read
    plain = next(t for t in inner if type(t) is torch.Tensor and t.dtype == torch.uint8)
    plain.view(-1)[0] ^= 1
    assert content_sums([weight, *inner]) != before
