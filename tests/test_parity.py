"""The parity check: any decoder family runs if its logits on the engine match its own forward,
and is refused up front, with the family and the measured difference, if they do not."""

import copy

import pytest
import torch
import transformers
from models import tiny_model

import hf_async_cb
from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine import parity
from hf_async_cb.generate import runtime as runtime_module
from hf_async_cb.model.kv_cache import PagedKVCache

IDS = torch.tensor([[5, 6, 7, 8, 9]])


def scaled(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model


def small(cls, **kw):
    return scaled(cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, **kw))


@pytest.mark.parametrize("cls", [transformers.OlmoConfig, transformers.GemmaConfig, transformers.MixtralConfig,
                                 transformers.GraniteConfig])
def test_families_off_the_old_list_run_by_default(cls):
    model = small(cls)
    expected = model.generate(IDS, max_new_tokens=6, batching="off", do_sample=False)
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(IDS, max_new_tokens=6, batching=mode, do_sample=False), expected)


def broken_cache(monkeypatch):
    """The engine's cache scales every new key: logits that differ from the model's own."""
    original = PagedKVCache.update
    monkeypatch.setattr(PagedKVCache, "update", lambda self, k, v, *a, **kw: original(self, k * 1.5, v, *a, **kw))


def test_a_family_the_engine_gets_wrong_is_refused_with_the_difference(monkeypatch):
    broken_cache(monkeypatch)
    model = small(transformers.Qwen2Config, use_sliding_window=False)
    modules = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"model_type 'qwen2'.*differ from its own forward by [0-9.]+ of the largest"
                                         r" logit \(tolerance 0.001 in float32\)"):
        model.generate(IDS, max_new_tokens=4, batching="async")
    assert runtime_module._RUNTIMES.get(model) is None
    assert {n: type(m) for n, m in model.named_modules()} == modules
    assert model.config._attn_implementation != "hf_async_cb_paged"
    with pytest.raises(ValueError, match="differ from its own forward"):  # the verdict is kept
        Engine(copy.deepcopy(model))
    # The override runs it anyway (here: other tokens than stock's).
    out = model.generate(IDS, max_new_tokens=4, batching="sync", batching_config=BatchingConfig(trust_untested_model=True))
    assert out.shape == (1, 9)


def test_a_refused_engine_frees_its_pool_before_giving_the_weights_back(monkeypatch):
    """The probe runs on the built pool; the refusal frees it before the fused weights are copied
    back into storages of their own (on a GPU that copy beside a full pool ran out of memory, and
    the user saw an out-of-memory error instead of the refusal)."""
    from hf_async_cb.model import fusion
    from hf_async_cb.model.kv_cache import pools_alive

    broken_cache(monkeypatch)
    model = small(transformers.Qwen2Config, use_sliding_window=False, rope_theta=5000.0)
    pools, seen = pools_alive(), []
    restore = fusion.FusedProjections.restore

    def restore_seeing_pools(self):
        seen.append(pools_alive())
        restore(self)

    monkeypatch.setattr(fusion.FusedProjections, "restore", restore_seeing_pools)
    with pytest.raises(ValueError, match="differ from its own forward"):
        Engine(model, BatchingConfig(fuse_projections=True))
    assert seen and seen[0] == pools


def test_a_crash_inside_the_model_is_a_refusal_not_an_internal_error(monkeypatch):
    def crash(self, *args, **kwargs):
        raise IndexError("too many indices for tensor of dimension 3")

    monkeypatch.setattr(PagedKVCache, "update", crash)
    model = small(transformers.Qwen3Config, head_dim=16)
    with pytest.raises(ValueError, match=r"parity check failed inside the model \(IndexError: too many indices"):
        model.generate(IDS, max_new_tokens=4, batching="sync")
    monkeypatch.undo()
    parity._VERDICTS.clear()
    assert torch.equal(model.generate(IDS, max_new_tokens=4, batching="sync"),
                       model.generate(IDS, max_new_tokens=4, batching="off"))


def test_the_probe_runs_once_per_family_config_and_dtype(monkeypatch):
    probes = []
    original = parity._probe
    monkeypatch.setattr(parity, "_probe", lambda engine, model, **kw: probes.append(1) or original(engine, model, **kw))
    model = copy.deepcopy(tiny_model("llama"))
    parity._VERDICTS.clear()
    for _ in range(2):
        Engine(copy.deepcopy(model)).close()
    hf_async_cb.release(model)
    model.generate(IDS, max_new_tokens=2, batching="sync")
    assert len(probes) == 1
    model.to(torch.float64)
    model.generate(IDS, max_new_tokens=2, batching="sync")
    assert len(probes) == 2


def test_a_pool_too_small_for_the_probe_checks_on_shorter_prompts(monkeypatch):
    """A small pool (num_pages set small) never lets an engine run unchecked: the probe shortens its
    prompts to fit; its pass holds for that engine only (the next one runs the whole probe), its
    failure refuses the family. A pool without room for one prompt token is refused as such."""
    parity._VERDICTS.clear()
    model = copy.deepcopy(tiny_model("qwen2"))
    with Engine(model, BatchingConfig(num_pages=2, page_size=4)) as engine:
        assert engine.generate([[5, 6]], max_new_tokens=2)[0].finish_reason is not None
    assert not parity._VERDICTS
    Engine(model).close()
    assert list(parity._VERDICTS.values()) == [None]
    with pytest.raises(ValueError, match=r"KV pool \(4 tokens\) is too small for the parity check"):
        Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(num_pages=1, page_size=4))
    broken_cache(monkeypatch)
    parity._VERDICTS.clear()
    wrong = small(transformers.Qwen2Config, use_sliding_window=False)
    with pytest.raises(ValueError, match="differ from its own forward"):
        wrong.generate(IDS, max_new_tokens=4, batching="sync", batching_config=dict(num_pages=3, page_size=4))


def test_a_model_in_train_mode_is_judged_without_dropout():
    """The probe judges the family: dropout (a model left in train mode) must not refuse it, for
    this model or any other of its config, and the model's modes are left as they were."""
    parity._VERDICTS.clear()
    model = small(transformers.LlamaConfig, attention_dropout=0.5).train()
    model.generate(IDS, max_new_tokens=2, batching="sync")  # (run as in eval mode: model/eval_mode.py)
    assert model.training and all(m.training for m in model.modules())
    assert list(parity._VERDICTS.values()) == [None]
    model.eval()
    assert torch.equal(model.generate(IDS, max_new_tokens=6, batching="async"),
                       model.generate(IDS, max_new_tokens=6, batching="off"))


def test_a_hooked_model_is_judged_with_its_hooks_for_itself_alone():
    """A forward hook that depends on the batch layout (here: on the sequence position) makes the
    engine's logits differ: refused, naming the hooks; the verdict is not the family's, so the same
    model without the hook, or another of its config, runs."""
    parity._VERDICTS.clear()
    model = small(transformers.LlamaConfig)
    ramp = model.model.norm.register_forward_hook(
        lambda module, args, out: out + torch.arange(out.shape[1], dtype=out.dtype)[None, :, None])
    with pytest.raises(ValueError, match=r"differ from its own forward .* \(with the forward hooks of 1 module:"):
        model.generate(IDS, max_new_tokens=4, batching="sync")
    assert not parity._VERDICTS
    ramp.remove()
    assert torch.equal(model.generate(IDS, max_new_tokens=6, batching="sync"),
                       model.generate(IDS, max_new_tokens=6, batching="off"))
    kept = model.model.norm.register_forward_hook(lambda module, args, out: out * 2)  # position-free: runs
    assert torch.equal(model.generate(IDS, max_new_tokens=6, batching="async"),
                       model.generate(IDS, max_new_tokens=6, batching="off"))
    kept.remove()


def test_weights_trained_in_place_during_the_check_leave_no_verdict(monkeypatch):
    """A training step in another thread beside the first call changes the weights between the
    engine's logits and the reference's: the check compared two models, so whatever it says is not
    kept for the family (a later call, or another model of its config, is checked afresh)."""
    parity._VERDICTS.clear()
    model = small(transformers.LlamaConfig)
    original = parity._probe

    def trained_meanwhile(engine, model, **kw):
        engine_run = engine.run

        def run(requests, mode=None):
            engine_run(requests, mode)
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)  # the optimizer step that lands mid-check
        engine.run = run
        try:
            return original(engine, model, **kw)
        finally:
            del engine.run

    monkeypatch.setattr(parity, "_probe", trained_meanwhile)
    with pytest.raises(ValueError, match="weights changed in place while the check ran"):
        Engine(model)
    assert not parity._VERDICTS
    monkeypatch.undo()
    assert torch.equal(model.generate(IDS, max_new_tokens=5, batching="sync"),
                       model.generate(IDS, max_new_tokens=5, batching="off"))


@pytest.mark.parametrize("hook", ["first row", "a vector per row"])
def test_a_hook_that_treats_batch_rows_apart_is_refused(hook):
    """Per-example steering (a hook changing row 0 only, or adding a vector per row) sees one
    packed row on the engine: the check probes a hooked model against its forward on a padded
    batch, as stock generate runs it, and refuses it by name rather than give other tokens."""
    parity._VERDICTS.clear()
    model = small(transformers.LlamaConfig)
    vectors = torch.randn(8, 1, 32) * 3

    def first_row(module, args, out):
        out = out.clone()
        out[0] += vectors[0]
        return out

    def per_row(module, args, out):
        return out + vectors[: out.shape[0]]

    handle = model.model.layers[0].mlp.register_forward_hook(first_row if hook == "first row" else per_row)
    with pytest.raises(ValueError, match=r"with the forward hooks of 1 module.*by batch row"):
        model.generate(torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]), attention_mask=torch.tensor([[1] * 4, [0, 1, 1, 1]]),
                       max_new_tokens=4, batching="sync")
    handle.remove()


def test_a_first_call_under_autocast_judges_the_family_outside_it():
    """The check compares logits at the model's own dtype: a first call made inside an autocast
    region must not refuse the family (for the process) over autocast's rounding."""
    parity._VERDICTS.clear()
    model = small(transformers.LlamaConfig)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(IDS, max_new_tokens=4, batching="sync")
    assert list(parity._VERDICTS.values()) == [None]
    assert torch.equal(model.generate(IDS, max_new_tokens=6, batching="async"),
                       model.generate(IDS, max_new_tokens=6, batching="off"))
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 8, 7, 6, 5, 4]])  # mixed steps under autocast: bf16 attention
    mask = (ids != 0).long()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="sync", pad_token_id=0,
                                          batching_config=BatchingConfig(max_batch_tokens=4, page_size=2)),
                           model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0))
