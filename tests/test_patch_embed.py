"""convolutions_as_gemms: a vision tower's patch-wise convolutions run as GEMMs inside the block (the
convolution's output within rounding), anything else runs the convolution itself, and the modules
are given back as they were (the engine's VLM tests check the tokens against stock)."""

import pytest
import torch
from torch import nn

from hf_async_cb.model.patch_embed import convolutions_as_gemms


def model():
    torch.manual_seed(0)
    return nn.ModuleDict(dict(
        patch3d=nn.Conv3d(3, 32, (2, 14, 14), stride=(2, 14, 14), bias=False),  # Qwen2-VL's patch embedding
        patch2d=nn.Conv2d(3, 16, 14, stride=14),  # with a bias
        overlapping=nn.Conv2d(3, 8, 3, stride=1, padding=1),
        grouped=nn.Conv2d(4, 4, 2, stride=2, groups=2),
    ))


def test_patchwise_convolutions_run_as_gemms_with_the_convolutions_output():
    m = model()
    x3, x2 = torch.randn(50, 3, 2, 14, 14), torch.randn(7, 3, 14, 14)
    with torch.no_grad():
        expected = m["patch3d"](x3), m["patch2d"](x2)
        with convolutions_as_gemms(m) as swapped, torch.autograd.profiler.profile() as prof:
            got = m["patch3d"](x3), m["patch2d"](x2)
        calls = {e.key for e in prof.function_events}
    assert swapped == 2
    assert "aten::convolution" not in calls and ("aten::linear" in calls or "aten::mm" in calls)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_other_inputs_and_convolutions_run_the_convolution_itself():
    m = model()
    images = torch.randn(2, 3, 28, 28)  # four patches per image: a real convolution
    with torch.no_grad():
        expected = m["patch2d"](images), m["overlapping"](images), m["grouped"](torch.randn(1, 4, 4, 4))
        with convolutions_as_gemms(m) as swapped:
            assert swapped == 2
            got = m["patch2d"](images), m["overlapping"](images)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_the_modules_are_given_back_even_on_an_error_and_taken_forwards_are_left_alone():
    m = model()
    own = m["patch2d"].forward = lambda x: x  # e.g. an offload hook's
    with pytest.raises(RuntimeError):
        with convolutions_as_gemms(m) as swapped:
            assert swapped == 1
            raise RuntimeError
    assert all("forward" not in vars(c) for name, c in m.items() if name != "patch2d")
    assert m["patch2d"].forward is own
