"""The transformers hook: how `batching` is chosen, the output format, the model left as found."""

import copy

import pytest
import torch
import transformers
from models import left_pad, random_prompts, stock_generate, tiny_model
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_async_cb
from hf_async_cb import BatchingConfig


@pytest.fixture
def model():
    m = copy.deepcopy(tiny_model("llama"))
    yield m


@pytest.fixture
def batch():
    prompts = random_prompts(4, 2, 20, seed=21)
    return prompts, *left_pad(prompts)


def test_batching_keyword_and_modes(model, batch):
    prompts, ids, mask = batch
    expected = stock_generate(model, prompts, max_new_tokens=6)
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, batching=mode), expected)
    # None and "off" are stock generate itself.
    for off in (None, "off"):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, batching=off), expected)


def test_invalid_batching_value_lists_the_valid_ones(model, batch):
    _, ids, mask = batch
    with pytest.raises(ValueError, match="'sync'.*'async'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, batching="fast")


def test_generation_config_batching(model, batch, monkeypatch):
    prompts, ids, mask = batch
    expected = stock_generate(model, prompts, max_new_tokens=5)
    hf_async_cb.Engine(copy.deepcopy(model)).close()  # the family's parity check (an Engine.run of its own) done
    calls = []
    original = hf_async_cb.Engine.run
    monkeypatch.setattr(hf_async_cb.Engine, "run",
                        lambda self, *a, **k: calls.append(self.config.mode) or original(self, *a, **k))
    gc = GenerationConfig(max_new_tokens=5, batching="async")
    assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=gc), expected)
    assert calls == ["async"]
    # The attribute survives a save/load round trip of the config.
    assert GenerationConfig.from_dict(gc.to_dict()).batching == "async"
    # Set on the model's own generation config, it applies to later calls.
    model.generation_config.batching = "sync"
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5), expected)
    assert calls == ["async", "sync"]
    # The call's keyword wins over the config.
    model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="off")
    assert calls == ["async", "sync"]


def test_batching_config_is_used(model, batch, monkeypatch):
    prompts, ids, mask = batch
    seen = []
    original = hf_async_cb.Engine.run

    def spy(self, *args, **kwargs):
        seen.append(self.config)
        assert self.allocator.num_pages == 40 and self.scheduler.max_batch_tokens == 9
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf_async_cb.Engine, "run", spy)
    config = BatchingConfig(page_size=4, num_pages=40, max_batch_tokens=9)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="sync", batching_config=config)
    assert torch.equal(out, stock_generate(model, prompts, max_new_tokens=5))
    assert seen[0].page_size == 4 and seen[0].num_pages == 40 and seen[0].mode == "sync"
    # batching_config alone selects its own mode.
    model.generate(ids, attention_mask=mask, max_new_tokens=5, batching_config=config.with_mode("async"))
    assert seen[1].mode == "async"


def test_a_batching_config_on_a_generation_config_survives_save_and_load(model, batch, monkeypatch, tmp_path):
    """transformers writes a dataclass on a GenerationConfig through its to_dict() (null without
    one): saved and loaded, the config still runs on the engine, with its fields."""
    prompts, ids, mask = batch
    seen = []
    original = hf_async_cb.Engine.run
    monkeypatch.setattr(hf_async_cb.Engine, "run", lambda self, *a, **k: seen.append(self.config) or original(self, *a, **k))
    GenerationConfig(max_new_tokens=4, batching_config=BatchingConfig(mode="sync", page_size=4)).save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=loaded),
                       stock_generate(model, prompts, max_new_tokens=4))
    assert seen and seen[-1].mode == "sync" and seen[-1].page_size == 4


def test_batching_config_as_a_dict(model, batch, monkeypatch):
    """A dict is read as BatchingConfig(**dict), from the call or a GenerationConfig: never dropped."""
    prompts, ids, mask = batch
    seen = []
    original = hf_async_cb.Engine.run

    def spy(self, *args, **kwargs):
        seen.append(self.config)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf_async_cb.Engine, "run", spy)
    expected = stock_generate(model, prompts, max_new_tokens=4)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, batching_config={"mode": "sync", "page_size": 4})
    assert torch.equal(out, expected)
    assert seen[-1].mode == "sync" and seen[-1].page_size == 4
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="async", batching_config={"page_size": 8})
    assert torch.equal(out, expected) and seen[-1].mode == "async" and seen[-1].page_size == 8
    gc = GenerationConfig(max_new_tokens=4, batching_config={"mode": "sync", "page_size": 2})
    assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=gc), expected)
    assert seen[-1].mode == "sync" and seen[-1].page_size == 2
    # Set on the model's own generation config, it selects its mode too (as `batching` there does).
    model.generation_config.batching_config = BatchingConfig(mode="sync", page_size=16)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4), expected)
    assert seen[-1].page_size == 16 and len(seen) == 4
    # batching="off" still runs stock.
    model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="off", batching_config={"page_size": 8})
    assert len(seen) == 4


@pytest.mark.parametrize("value, match", [
    ({"page_sise": 4}, "unknown keys.*page_sise"), ({"seed": -1}, "BatchingConfig.seed"),
    ("sync", "must be a hf_async_cb.BatchingConfig"), (4, "must be a hf_async_cb.BatchingConfig"),
])
def test_bad_batching_config_is_refused(model, batch, value, match):
    _, ids, mask = batch
    for batching in ("sync", "off"):  # even when the call runs stock: the config was meant for something
        with pytest.raises(ValueError, match=match):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, batching=batching, batching_config=value)
    with pytest.raises(ValueError, match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, batching_config=value)
    with pytest.raises(ValueError, match=f"generation_config.batching_config.*|{match}"):
        model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=3,
                                                                                   batching_config=value))


def test_return_dict_in_generate(model, batch):
    prompts, ids, mask = batch
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="sync", return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, stock_generate(model, prompts, max_new_tokens=4))


def test_default_length_is_twenty_new_tokens_as_stock(model, batch):
    prompts, ids, mask = batch
    expected = model.generate(ids, attention_mask=mask, batching="off")
    assert expected.shape[1] == ids.shape[1] + 20
    assert torch.equal(model.generate(ids, attention_mask=mask, batching="sync"), expected)


def test_input_ids_keyword_and_no_mask(model):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    expected = model.generate(input_ids=ids, max_new_tokens=5, batching="off")
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=5, batching="sync"), expected)


def test_model_left_as_found(model, batch):
    prompts, ids, mask = batch
    before_impl = model.config._attn_implementation
    before_config = model.config.to_dict()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="async")
    assert model.config._attn_implementation == before_impl
    assert model.config.to_dict() == before_config
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    # Training still works: a loss, gradients, an optimiser step.
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_model_restored_after_an_error(model, batch):
    _, ids, mask = batch
    impl = model.config._attn_implementation

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    handle = model.model.layers[1].mlp.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="injected"):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="sync")
    handle.remove()
    assert model.config._attn_implementation == impl


def test_uninstall_warns_once_when_batching_is_still_asked_for(model, batch, caplog, monkeypatch):
    """After uninstall(), stock generate runs, but a `batching` left on a GenerationConfig (which
    stock ignores) is said to be ignored, once."""
    prompts, ids, mask = batch
    expected = stock_generate(model, prompts, max_new_tokens=4)
    model.generation_config.batching = "async"
    hf_async_cb.uninstall()
    try:
        with caplog.at_level("WARNING", logger="hf_async_cb.generate.hook"):
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4), expected)
            assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                              generation_config=GenerationConfig(batching="sync")), expected)
        warnings = [r.getMessage() for r in caplog.records if "uninstalled" in r.getMessage()]
        assert len(warnings) == 1 and "model.generation_config.batching" in warnings[0]
        model.generation_config.batching = None
        caplog.clear()
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4), expected)
        assert not caplog.records
    finally:
        hf_async_cb.install()
    # Installed again: the hook wraps stock generate itself (not the guard), and the engine runs.
    from transformers import GenerationMixin

    assert GenerationMixin.generate.__hf_async_cb__
    assert not hasattr(GenerationMixin.generate.__wrapped__, "__hf_async_cb_stock__")
    calls = []
    original = hf_async_cb.Engine.run
    def counted(self, requests, *a, **k):  # the call's runs (not the parity probe's, which keeps scores)
        calls.extend([1] if not any(r.keep_scores for r in requests) else [])
        return original(self, requests, *a, **k)

    monkeypatch.setattr(hf_async_cb.Engine, "run", counted)
    model.generation_config.batching = "sync"
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4), expected)
    assert calls == [1]


def test_uninstall_and_install():
    from transformers import GenerationMixin

    assert hf_async_cb.is_installed()
    patched = GenerationMixin.generate
    hf_async_cb.install()  # idempotent
    assert GenerationMixin.generate is patched
    hf_async_cb.uninstall()
    try:
        assert not hf_async_cb.is_installed()
        assert not getattr(GenerationMixin.generate, "__hf_async_cb__", False)
        model = tiny_model("gpt2")
        ids = torch.tensor([[3, 4]])
        expected = model.generate(ids, max_new_tokens=2)
        for batching in ("sync", "off"):  # ignored, as the guard's warning says: stock runs
            assert torch.equal(model.generate(ids, max_new_tokens=2, batching=batching,
                                              batching_config=BatchingConfig(seed=1)), expected)
    finally:
        hf_async_cb.install()
    assert GenerationMixin.generate.__hf_async_cb__


def test_sampling_runs_and_is_seeded(model, batch):
    _, ids, mask = batch
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    a = model.generate(ids, batching="sync", batching_config=BatchingConfig(seed=1), **kwargs)
    b = model.generate(ids, batching="async", batching_config=BatchingConfig(seed=1), **kwargs)
    assert torch.equal(a, b)
    assert a.shape[0] == ids.shape[0] and a.shape[1] <= ids.shape[1] + 8
    assert ((a >= 0) & (a < model.config.vocab_size)).all()
    # top_k=1 sampling is greedy.
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, batching="off")
    top1 = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=1, batching="sync")
    assert torch.equal(top1, greedy)


def test_pool_sized_to_the_call(model, batch, monkeypatch):
    """A pool sized from memory is capped at what the call can use (rounded up to a power of two,
    so that a loop of growing calls regrows it only a few times)."""
    prompts, ids, mask = batch
    sizes = []
    original = hf_async_cb.Engine.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        sizes.append(self.allocator.num_pages)

    monkeypatch.setattr(hf_async_cb.Engine, "__init__", spy)
    model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="sync",
                   batching_config=BatchingConfig(page_size=4))
    needed = sum(-(-(len(p) + 5) // 4) for p in prompts)
    assert sizes[0] == 1 << (needed - 1).bit_length()


def test_progress_bar(model, batch, capsys):
    prompts, ids, mask = batch
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="async",
                         batching_config=BatchingConfig(progress=True))
    assert torch.equal(out, stock_generate(model, prompts, max_new_tokens=4))
    err = capsys.readouterr().err
    assert "hf_async_cb" in err and f"{len(prompts)}/{len(prompts)}" in err and "tok/s" in err


def test_keyboard_interrupt_leaves_the_model_usable(model, batch):
    prompts, ids, mask = batch
    impl = model.config._attn_implementation
    calls = {"n": 0}

    def interrupt(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    handle = model.model.norm.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids, attention_mask=mask, max_new_tokens=8, batching="async")
    handle.remove()
    assert model.config._attn_implementation == impl
    expected = stock_generate(model, prompts, max_new_tokens=8)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8, batching="async"), expected)


def test_min_p_runs_on_the_device_sampler(model, batch, monkeypatch):
    """min_p is one of the built-in sampling options: no per-request slow path, and seeded runs agree
    between the loops; min_p=1.0 keeps only the most likely token, i.e. greedy."""
    from hf_async_cb.generate import stock_options

    _, ids, mask = batch
    slow = []
    monkeypatch.setattr(stock_options, "_warn_once", lambda message: slow.append(message))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.9, min_p=0.1)
    a = model.generate(ids, batching="sync", batching_config=BatchingConfig(seed=1), **kwargs)
    b = model.generate(ids, batching="async", batching_config=BatchingConfig(seed=1), **kwargs)
    assert torch.equal(a, b) and not slow
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, batching="off")
    top = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, min_p=1.0, batching="async")
    assert torch.equal(top, greedy) and not slow


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_neutral_arguments_run_and_a_typo_gets_stocks_message(mode):
    """What stock takes silently (`trust_remote_code=False` without a custom generate, `past_key_values=None`)
    runs; an argument no model takes (`max_new_token=`, a typo) gets stock's own ValueError, which says
    it may be a typo; a real cache is still refused by name."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 4, 9, seed=23)
    ids, mask = left_pad(prompts)
    expected = stock_generate(model, prompts, max_new_tokens=4, do_sample=False)
    for neutral in (dict(trust_remote_code=False), dict(past_key_values=None)):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, batching=mode, **neutral)
        assert torch.equal(got, expected), neutral
    with pytest.raises(ValueError) as stock_error:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="off", max_new_token=4)
    with pytest.raises(ValueError) as ours:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, batching=mode, max_new_token=4)
    assert str(ours.value) == str(stock_error.value) and "typo" in str(ours.value)
    with pytest.raises(ValueError, match="does not take `past_key_values`: the engine keeps its own paged cache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, batching=mode,
                       past_key_values=transformers.DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="does not take `cache`"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, batching=mode,
                       cache=transformers.DynamicCache(config=model.config))
