"""fused_tower_norms: a vision-language model's RMSNorms outside its language model (the towers',
the projector's) run on the rms_norm kernel inside the block, with the norms' own outputs; the
language model's are left to the engine; the modules are given back; a call gives stock's tokens."""

import pytest
import torch

from hf_async_cb.kernels.paged_attention import runs_on
from hf_async_cb.model import elementwise_fusion as ew
from hf_async_cb.model.tower_norms import fused_tower_norms, tower_norm_variants
from hf_async_cb.model.vision import language_model

pytest.importorskip("PIL")
import vlm_families as V  # noqa: E402

pytestmark = pytest.mark.skipif(not runs_on(torch.device("cpu")) and not torch.cuda.is_available(),
                                reason="the kernel runs on CUDA or in Triton's interpreter")


def _model():
    model = V.build_model("qwen2_5_vl")
    return model.to("cuda") if torch.cuda.is_available() else model


def test_the_towers_norms_run_on_the_kernel_with_their_own_outputs_and_are_given_back():
    model = _model()
    inner = language_model(model)
    tower_norms = [m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and "visual" in n]
    assert len(tower_norms) == 2 * model.config.vision_config.depth + 1  # norm1, norm2 per block; the merger's ln_q
    x = torch.randn(5, tower_norms[0].weight.shape[0], device=tower_norms[0].weight.device)
    expected = [norm(x) for norm in tower_norms]
    with fused_tower_norms(model, inner) as n:
        assert n == len(tower_norms)
        assert all("forward" in vars(m) for m in tower_norms)
        assert not any("forward" in vars(m) for m in inner.modules())
        got = [norm(x) for norm in tower_norms]
    assert not any("forward" in vars(m) for m in model.modules())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    if torch.cuda.is_available():
        assert tower_norm_variants(model, inner)  # compiled ahead with the model's variants


def test_a_qwen2_5_vl_call_norms_its_tower_on_the_kernel_and_gives_stock_tokens(monkeypatch):
    import hf_async_cb

    model = _model()
    model.generation_config.eos_token_id = None
    inputs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v
              for k, v in V.build_inputs("qwen2_5_vl", "one_each").items()}
    widths = []
    kernel = ew.rms_norm

    def counted(x, w, eps, unit_offset=False):
        widths.append(x.shape[-1])
        return kernel(x, w, eps, unit_offset)

    monkeypatch.setattr(ew, "rms_norm", counted)
    expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert not widths
    got = model.generate(**inputs, max_new_tokens=6, do_sample=False, batching="sync")
    hf_async_cb.release(model)
    assert torch.equal(got, expected)
    tower_width = model.config.vision_config.hidden_size
    assert widths.count(tower_width) >= 2 * model.config.vision_config.depth + 1
