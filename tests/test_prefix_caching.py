"""Prefix caching through the engine: tokens equal to stock generate's with shared prefixes within a
call, across calls, online, under preemption, after the weights changed (no stale K/V), and with
it switched off; the counters say what was reused."""

from __future__ import annotations

import pytest
import torch
import transformers
from models import CONFIGS, generated_rows, left_pad, random_prompts, scaled, stock_generate, tiny_model

import hf_async_cb
from hf_async_cb import BatchingConfig, Engine, SamplingParams

modes = pytest.mark.parametrize("mode", ["sync", "async"])


def fresh_model(family: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A model of its own (tiny_model's are shared between tests: these ones get written)."""
    torch.manual_seed(seed)
    return scaled(transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval())


def shared_prompts(groups: int, rows: int, prefix: int, own: int, seed: int) -> list[list[int]]:
    """`groups` prefixes of `prefix` tokens, each followed by `rows` different tails of 1..own tokens."""
    prefixes = random_prompts(groups, prefix, prefix, seed=seed)
    tails = random_prompts(groups * rows, 1, own, seed=seed + 1)
    return [prefixes[g] + tails[g * rows + r] for g in range(groups) for r in range(rows)]


def expected(model, prompts, new):
    return generated_rows(stock_generate(model, prompts, max_new_tokens=new, do_sample=False),
                          max(map(len, prompts)), pad=0, eos=(2,))


def generate_rows(model, prompts, new, mode, config=None):
    """Through model.generate(batching=mode): the runtime kept on the model between calls."""
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, batching=mode,
                         batching_config=config)
    return generated_rows(out, ids.shape[1], pad=0, eos=(2,))


def engine_rows(engine, prompts, new, mode):
    return [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=new, eos_token_ids=(2,), mode=mode)]


@modes
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_rows_sharing_a_prefix_match_stock_and_reuse_it(family, mode):
    """Mistral's 24-token window is shorter than the 40-token shared prefix: the cached pages past
    the window are still exact (every page is kept; the window is the mask's)."""
    model = tiny_model(family)
    prompts = shared_prompts(groups=3, rows=4, prefix=40, own=9, seed=1)
    engine = Engine(model, BatchingConfig(mode=mode, page_size=8, max_batch_tokens=128))
    assert engine_rows(engine, prompts, 10, mode) == expected(model, prompts, 10)
    stats = engine.prefix_cache_stats()
    assert stats["hit_tokens"] >= 3 * 3 * 40 // 8 * 8  # the 3 later rows of each group take the prefix's pages
    assert stats["deferrals"] > 0  # they arrived with their group's first row and waited a step for it
    assert engine.allocator.num_free == engine.allocator.num_pages


@modes
def test_identical_rows_and_full_page_prompts(mode):
    """Rows repeating one prompt whose length is a whole number of pages: each later row takes every
    page, its last one as a copy of its own (it writes its last token's K/V there), and feeds only
    its last token."""
    model = tiny_model("qwen2")
    prompt = random_prompts(1, 32, 32, seed=3)[0]
    prompts = [prompt] * 5 + [prompt[:16]] * 2
    engine = Engine(model, BatchingConfig(mode=mode, page_size=8, max_batch_tokens=64))
    assert engine_rows(engine, prompts, 6, mode) == expected(model, prompts, 6)
    stats = engine.prefix_cache_stats()
    assert stats["hit_tokens"] == 4 * 31 + 2 * 15 and stats["copied_pages"] == 6
    assert engine.allocator.num_free == engine.allocator.num_pages


@modes
def test_copied_last_pages_carry_their_tokens_for_history_processors(mode):
    """A repetition penalty reads each row's history through its pages: a row whose last page is a
    copy reads the copied tokens (strong enough a penalty that a missed prompt token changes the
    next one), as stock generate reads its prompt."""
    model = tiny_model("llama")
    prompt = random_prompts(1, 24, 24, seed=11)[0]
    prompts = [prompt] * 4
    ids, mask = left_pad(prompts)
    options = dict(max_new_tokens=8, do_sample=False, repetition_penalty=1e4)
    want = generated_rows(model.generate(ids, attention_mask=mask, **options), ids.shape[1], pad=0, eos=(2,))
    config = BatchingConfig(page_size=8, max_batch_tokens=64)
    got = generated_rows(model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, **options),
                         ids.shape[1], pad=0, eos=(2,))
    assert got == want
    assert hf_async_cb.prefix_cache_stats(model)["copied_pages"] >= 3


@modes
def test_later_calls_reuse_and_multi_turn_reuses_the_answer(mode):
    model = tiny_model("llama")
    engine = Engine(model, BatchingConfig(mode=mode, page_size=8))
    first = shared_prompts(groups=1, rows=2, prefix=48, own=5, seed=5)
    out = engine_rows(engine, first, 20, mode)
    assert out == expected(model, first, 20)
    hits = engine.prefix_cache_stats()["hit_tokens"]
    # A new call on the same prefix; then a second turn: the first answer and a new question.
    second = [first[0][:48] + [7, 8, 9]]
    assert engine_rows(engine, second, 8, mode) == expected(model, second, 8)
    assert engine.prefix_cache_stats()["hit_tokens"] - hits == 48
    turn = first[1] + out[1] + [11, 12, 13]
    hits = engine.prefix_cache_stats()["hit_tokens"]
    assert engine_rows(engine, [turn], 8, mode) == expected(model, [turn], 8)
    assert engine.prefix_cache_stats()["hit_tokens"] - hits >= (len(first[1]) + len(out[1]) - 1) // 8 * 8


@modes
@pytest.mark.parametrize("update", ["optimizer", "load_state_dict", "copy_", "dtype_roundtrip"])
def test_weights_written_in_place_are_never_served_stale(mode, update):
    """A weight update between calls (an RL step): the next call's tokens are the updated model's,
    not those of K/V cached before it."""
    model = fresh_model("llama", seed=11)
    prompts = shared_prompts(groups=1, rows=3, prefix=32, own=4, seed=7)
    for call in range(2):
        if call:
            if update == "optimizer":
                optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
                model.train()
                model(torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss.backward()
                optimizer.step()
                model.eval()
            elif update == "load_state_dict":
                other = fresh_model("llama", seed=12)
                model.load_state_dict(other.state_dict())
            elif update == "copy_":
                with torch.no_grad():
                    model.model.layers[0].self_attn.k_proj.weight.copy_(
                        torch.randn_like(model.model.layers[0].self_attn.k_proj.weight) * 2)
            else:  # the same values written back: a change the counters see, harmless to clear on
                with torch.no_grad():
                    model.model.embed_tokens.weight.mul_(1.0)
        want = expected(model, prompts, 8)
        got = generate_rows(model, prompts, 8, mode)
        assert got == want, f"call {call}"
    stats = hf_async_cb.prefix_cache_stats(model)
    assert stats["clears"] >= 1 and stats["hit_tokens"] > 0
    hf_async_cb.release(model)


@pytest.mark.parametrize("change", ["weight replaced", "module replaced", "hook added", "global hook added"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_model_changed_while_a_loop_serves_is_refused(prefix_caching, change):
    """A new nn.Parameter (or load_state_dict(assign=True)), a submodule replaced, a forward hook
    added (a steering vector, on a module or for every module) while the loop serves: the engine no
    longer runs the model it was built on; the next requests fail with what to do, never with
    pages of the old model's K/V under the new model's other positions (mixed tokens, silently)."""
    model = fresh_model(seed=4)
    prompt = shared_prompts(groups=1, rows=1, prefix=40, own=3, seed=16)[0]
    engine = Engine(model, BatchingConfig(mode="sync", page_size=4, prefix_caching=prefix_caching))
    engine.start()
    handles = []
    try:
        engine.add_request(prompt, max_new_tokens=4, eos_token_ids=(2,)).result(timeout=60)
        proj = model.model.layers[0].self_attn.k_proj
        steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        if change == "weight replaced":
            proj.weight = torch.nn.Parameter(-proj.weight.detach().clone())
        elif change == "module replaced":
            mlp = model.model.layers[0].mlp
            down = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
            mlp.down_proj = down
        elif change == "hook added":
            handles.append(model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out + steer))
        else:
            handles.append(torch.nn.modules.module.register_module_forward_hook(
                lambda m, a, out: out + 0.01 if m is model.model.layers[0].mlp else None))
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.add_request(prompt, max_new_tokens=4, eos_token_ids=(2,)).result(timeout=60)
    finally:
        for handle in handles:
            handle.remove()
        engine.shutdown()


@pytest.mark.parametrize("change", ["lora scaling", "steering hook"])
def test_what_changes_outputs_while_a_loop_serves_is_never_served_stale(change):
    """While the loop serves: a LoRA layer's scaling set (PEFT's set_scale), a tensor a forward hook
    adds changed in place. The next request's tokens are stock's for the model as it is now."""
    peft = pytest.importorskip("peft")
    model, oracle = fresh_model(seed=5), fresh_model(seed=5)
    steer = {id(model): torch.zeros(model.config.hidden_size), id(oracle): torch.zeros(model.config.hidden_size)}
    if change == "lora scaling":
        config = dict(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"], init_lora_weights=False)
        torch.manual_seed(7)
        model = peft.get_peft_model(model, peft.LoraConfig(**config)).eval()
        torch.manual_seed(7)
        oracle = peft.get_peft_model(oracle, peft.LoraConfig(**config)).eval()
    else:
        for m in (model, oracle):
            vector = steer[id(m)]
            m.model.layers[0].register_forward_hook(
                lambda module, args, out, vector=vector: (out[0] + vector,) + tuple(out[1:])
                if isinstance(out, tuple) else out + vector)
    prompt = shared_prompts(groups=1, rows=1, prefix=40, own=3, seed=17)[0]
    served = model.get_base_model() if hasattr(model, "get_base_model") else model  # (an Engine takes the model)
    engine = Engine(served, BatchingConfig(mode="sync", page_size=4))
    engine.start()
    try:
        for _ in range(2):
            got = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=(2,)).result(timeout=60)
            assert got.output_token_ids == expected(oracle, [prompt], 6)[0]
            for m in (model, oracle):
                if change == "lora scaling":
                    for module in m.modules():
                        if isinstance(getattr(module, "scaling", None), dict):
                            module.scaling["default"] *= 3
                else:
                    delta = 3 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(8))
                    for vector in steer.values():
                        vector.add_(delta)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_model_made_under_inference_mode_caches_across_calls_and_sees_its_writes(mode):
    """Inference tensors keep no version counter (HQQ quantizes into such tensors): the parity check
    does without, the next call reuses the prompts' pages (their values are read once a call), and a
    write in place under inference_mode, which no counter sees, empties the cache: stock's new tokens."""
    with torch.inference_mode():
        model = fresh_model(seed=6)
    prompts = shared_prompts(groups=1, rows=3, prefix=32, own=4, seed=10)
    assert generate_rows(model, prompts, 6, mode) == expected(model, prompts, 6)
    first = hf_async_cb.prefix_cache_stats(model)["hit_tokens"]  # (rows 2 and 3 take row 1's prefix)
    assert generate_rows(model, prompts, 6, mode) == expected(model, prompts, 6)
    second = hf_async_cb.prefix_cache_stats(model)["hit_tokens"] - first
    assert second >= first + 32  # (and row 1 takes the first call's)
    before = expected(model, prompts, 6)
    with torch.inference_mode():
        model.model.layers[0].self_attn.k_proj.weight.mul_(-2)
    now = expected(model, prompts, 6)
    assert now != before and generate_rows(model, prompts, 6, mode) == now
    hf_async_cb.release(model)


class _Scaled(torch.nn.Module):
    """A parametrization whose factor is a plain attribute."""

    factor = 1.0

    def forward(self, weight):
        return weight * self.factor


@pytest.mark.parametrize("change", ["lora scaling", "steering hook", "parametrization"])
def test_what_changes_outputs_beside_the_weights_is_never_served_stale(change):
    """Between calls, a change no weight's version counter sees: a LoRA layer's scaling (PEFT's
    rescale_adapter_scale), a tensor a forward hook adds (activation steering), a parametrization's
    attribute. The next call's tokens are stock's for the model as it is now."""
    import torch.nn.utils.parametrize as parametrize

    model = fresh_model("llama", seed=16)
    layer = model.model.layers[0]
    steer = torch.zeros(model.config.hidden_size)
    if change == "lora scaling":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                                          init_lora_weights=False)).eval()
    elif change == "steering hook":
        layer.register_forward_hook(lambda module, args, out: (out[0] + steer,) + tuple(out[1:])
                                    if isinstance(out, tuple) else out + steer)
    else:
        parametrize.register_parametrization(layer.self_attn.k_proj, "weight", _Scaled())
    prompts = shared_prompts(groups=1, rows=2, prefix=32, own=4, seed=9)
    for call in range(2):
        if call:
            if change == "lora scaling":
                for module in model.modules():
                    if isinstance(getattr(module, "scaling", None), dict):
                        module.scaling["default"] *= 3
            elif change == "steering hook":
                steer.add_(3.0)  # (in place: the hook's own tensor)
            else:
                layer.self_attn.k_proj.parametrizations.weight[0].factor = -2.0
        want = expected(model, prompts, 6)
        assert generate_rows(model, prompts, 6, "sync") == want, f"call {call}"
    hf_async_cb.release(model)


WRITES_WITHOUT_COUNTERS = {
    # None of these bumps a version counter (checked below): the content of the weights tells.
    ".data.copy_ (a trainer's weight sync)": lambda w: w.data.copy_(w.data * 1.5 + 0.01),
    ".data.mul_(-1) (a sign flip: no norm sees it)": lambda w: w.data.mul_(-1.0),
    "a NumPy view": lambda w: w.detach().numpy().__imul__(1.7),
    "one value, one step": lambda w: w.data.view(-1)[7].add_(w.data.view(-1)[7].abs() * 0.01 + 1e-3),
    "rows reordered (every sum the same)": lambda w: w.data.copy_(w.data.flip(0)),
    "input features swapped in every row (each row's sum the same)":
        lambda w: w.data.copy_(w.data[:, torch.arange(w.shape[1]).roll(4)]),
    "two values of one row swapped": lambda w: w.data[3].index_copy_(0, torch.tensor([0, 5]), w.data[3, [5, 0]].clone()),
}


@pytest.mark.parametrize("write", list(WRITES_WITHOUT_COUNTERS))
@pytest.mark.parametrize("path", ["generate", "engine"])
def test_weights_written_without_a_version_counter_are_seen_by_the_next_call(write, path):
    """`.data` writes, collectives into a parameter (RL weight syncs) and NumPy views bump no version
    counter; each call also reads the weights' contents (model/weight_kinds.content_sums), so the
    next call recomputes what it cached (it reused the old weights' K/V: other tokens than stock's)."""
    model = fresh_model("llama", seed=13)
    prompts = shared_prompts(groups=1, rows=2, prefix=32, own=4, seed=8)
    weight = model.model.layers[1].mlp.down_proj.weight
    engine = Engine(model, BatchingConfig(mode="sync", page_size=8)) if path == "engine" else None

    def rows():
        if engine is not None:
            return engine_rows(engine, prompts, 6, "sync")
        return generate_rows(model, prompts, 6, "sync")

    assert rows() == expected(model, prompts, 6)
    version = weight._version
    WRITES_WITHOUT_COUNTERS[write](weight)
    assert weight._version == version
    assert rows() == expected(model, prompts, 6)
    stats = engine.prefix_cache_stats() if engine is not None else hf_async_cb.prefix_cache_stats(model)
    assert stats["clears"] >= 1
    if engine is not None:
        engine.clear_prefix_cache()  # (still there, for a write while a serving loop runs)
        assert engine.prefix_cache_stats()["cached_pages"] == 0
        engine.close()
    else:
        hf_async_cb.release(model)


def test_the_fingerprint_walks_the_model_once_and_sees_each_kind_of_change(monkeypatch):
    """kv_fingerprint reads everything from one walk of the modules (each walk through nn.Module's
    nested generators costs about a millisecond per call for an 8B model), and still changes with a
    weight's counter, a buffer, a tied weight, a module's setting and an adapter-like state."""
    from hf_async_cb.model.kv_fingerprint import kv_fingerprint

    model = fresh_model("llama", seed=15)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    walks = []
    for name in ("named_modules", "modules", "named_parameters", "parameters", "named_buffers", "buffers"):
        original = getattr(torch.nn.Module, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if self is model:
                walks.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.nn.Module, name, counted)
    seen = [kv_fingerprint(model)]
    assert walks == ["named_modules"]
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.0)  # (a counter's bump)
        seen.append(kv_fingerprint(model))
        model.lm_head.weight.add_(0.0)  # the tied embedding's
        seen.append(kv_fingerprint(model))
        model.model.rotary_emb.inv_freq.mul_(1.0)  # a buffer
        seen.append(kv_fingerprint(model))
    model.model.layers[1].self_attn.scaling *= 1.01  # a module's own setting
    seen.append(kv_fingerprint(model))
    model.model.layers[1].mlp.__dict__["_active_adapter"] = "a"  # (what PEFT's tuner layers hold)
    seen.append(kv_fingerprint(model))
    assert len(set(seen)) == len(seen)
    assert kv_fingerprint(model) == seen[-1]


@modes
def test_fused_projections_keep_the_cache_across_calls(mode):
    """The engine's own preparation (fused q/k/v and gate/up views) is no weight change."""
    model = fresh_model("llama", seed=14)
    prompts = shared_prompts(groups=1, rows=2, prefix=40, own=3, seed=9)
    config = BatchingConfig(page_size=8, fuse_projections=True)
    for call in range(2):
        rows = generate_rows(model, prompts, 6, mode, config)
        assert rows == expected(model, prompts, 6)
    stats = hf_async_cb.prefix_cache_stats(model)
    assert stats["clears"] == 0 and stats["hit_tokens"] >= 40 + 40  # the second row, then both rows again
    hf_async_cb.release(model)


@modes
@pytest.mark.parametrize("whole_pages", [False, True], ids=["own-tails", "repeated-whole-pages"])
def test_small_pool_preempts_and_evicts_and_stays_exact(mode, whole_pages):
    """A pool of 20 pages for 9 rows: preemption and eviction all along; with repeated prompts of
    whole pages, last pages are copied under that pressure too (held until their step is queued)."""
    model = tiny_model("llama")
    if whole_pages:
        prompts = [p for p in random_prompts(3, 24, 24, seed=17) for _ in range(3)]
    else:
        prompts = shared_prompts(groups=3, rows=3, prefix=24, own=12, seed=10)
    engine = Engine(model, BatchingConfig(mode=mode, page_size=4, num_pages=20, max_batch_tokens=48))
    assert engine_rows(engine, prompts, 16, mode) == expected(model, prompts, 16)
    stats = engine.prefix_cache_stats()
    assert stats["evictions"] > 0 and (stats["copied_pages"] > 0) == whole_pages
    assert engine.allocator.num_free == engine.allocator.num_pages


@modes
@pytest.mark.parametrize("whole_pages", [False, True], ids=["own-tails", "repeated-whole-pages"])
def test_seeded_sampling_is_the_same_with_and_without_the_cache(mode, whole_pages):
    """Seeded draws, rows sharing prefixes; with prompts of whole pages repeated (an RL group's rows),
    the later rows' last pages are copies and their draws still those without the cache."""
    model = tiny_model("qwen2")
    if whole_pages:
        prompts = [random_prompts(1, 24, 24, seed=14)[0]] * 3 + [random_prompts(1, 16, 16, seed=15)[0]] * 3
    else:
        prompts = shared_prompts(groups=2, rows=3, prefix=30, own=6, seed=12)
    params = [SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.3, top_k=40, seed=100 + i)
              for i in range(len(prompts))]
    engines = [Engine(model, BatchingConfig(mode=mode, page_size=8, prefix_caching=on)) for on in (False, True)]
    runs = [[o.output_token_ids for o in engine.generate(prompts, params)] for engine in engines]
    assert runs[0] == runs[1]
    assert (engines[1].prefix_cache_stats()["copied_pages"] == 4) == whole_pages


@modes
def test_return_sequences_of_a_whole_page_prompt_copy_its_last_page(mode):
    """num_return_sequences copies of prompts of whole pages, sampled: each later copy takes the
    prompt's last page as a copy; the draws are those without the cache."""
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(2, 16, 16, seed=16))
    options = dict(max_new_tokens=8, num_return_sequences=4)
    runs = []
    for on in (False, True):
        hf_async_cb.release(model)
        config = BatchingConfig(page_size=8, seed=3, prefix_caching=on)
        runs.append(model.generate(ids, attention_mask=mask, do_sample=True, top_k=50, batching=mode,
                                   batching_config=config, **options))
        if on:
            assert hf_async_cb.prefix_cache_stats(model)["copied_pages"] == 2 * 3
    assert torch.equal(runs[0], runs[1])
    hf_async_cb.release(model)


def test_switched_off_reuses_nothing():
    model = tiny_model("llama")
    prompts = shared_prompts(groups=1, rows=4, prefix=32, own=4, seed=13)
    engine = Engine(model, BatchingConfig(mode="async", page_size=8, prefix_caching=False))
    assert engine_rows(engine, prompts, 6, "async") == expected(model, prompts, 6)
    assert engine.prefix_cache_stats() is None and engine.scheduler.num_shared_tokens == 0


@modes
def test_online_requests_arriving_later_reuse_the_prefix(mode):
    model = tiny_model("llama")
    prompts = shared_prompts(groups=1, rows=3, prefix=40, own=5, seed=14)
    engine = Engine(model, BatchingConfig(mode=mode, page_size=8))
    engine.start()
    try:
        first = engine.add_request(prompts[0], max_new_tokens=6, eos_token_ids=(2,)).result(timeout=60)
        later = [engine.add_request(p, max_new_tokens=6, eos_token_ids=(2,)) for p in prompts[1:]]
        outs = [first] + [h.result(timeout=60) for h in later]
    finally:
        engine.shutdown()
    assert [o.output_token_ids for o in outs] == expected(model, prompts, 6)
    assert engine.prefix_cache_stats()["hit_tokens"] >= 2 * 40


@modes
def test_weights_written_in_place_while_a_loop_serves_are_never_served_stale(mode):
    """An optimizer step between rollouts while the background loop serves (idle or not): the next
    requests take no page of the old weights' K/V."""
    model, oracle = fresh_model(seed=3), fresh_model(seed=3)  # (stock cannot run the served model meanwhile)
    prompt = shared_prompts(groups=1, rows=1, prefix=40, own=3, seed=15)[0]
    engine = Engine(model, BatchingConfig(mode=mode, page_size=4))
    engine.start()
    try:
        for _ in range(2):
            got = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=(2,)).result(timeout=60)
            assert got.output_token_ids == expected(oracle, [prompt], 6)[0]
            with torch.no_grad():
                for m in (model, oracle):  # (the served one under the loop: it serves on)
                    m.model.layers[0].self_attn.k_proj.weight.mul_(-1.0)
    finally:
        engine.shutdown()
    assert engine.prefix_cache_stats()["clears"] >= 1


def test_peft_adapter_switch_empties_the_cache():
    peft = pytest.importorskip("peft")
    model = fresh_model("llama", seed=15)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, config, adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    base = model.base_model.model
    prompts = shared_prompts(groups=1, rows=2, prefix=32, own=3, seed=16)
    engine = Engine(base, BatchingConfig(mode="sync", page_size=8))
    for adapter in ("a", "b", "a"):
        model.set_adapter(adapter)
        assert engine_rows(engine, prompts, 6, "sync") == expected(base, prompts, 6), adapter
    assert engine.prefix_cache_stats()["clears"] >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_cuda_default_path_with_cached_prefixes_matches_stock(family):
    """The default CUDA path (Triton attention, fused projections and element-wise kernels, decode
    and prefill graphs) in fp32 against stock: shared prefixes within a call, then across calls,
    the cache kept (the engine's own preparation is no weight change)."""
    import copy

    model = copy.deepcopy(tiny_model(family)).to("cuda", torch.float32)
    prompts = shared_prompts(groups=3, rows=4, prefix=40, own=9, seed=21)
    ids, mask = (t.cuda() for t in left_pad(prompts))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=16, batching="off", do_sample=False)
    for call in range(3):
        mode = ("sync", "async", "async")[call]
        got = model.generate(ids, attention_mask=mask, max_new_tokens=16, batching=mode, do_sample=False)
        assert torch.equal(got, want), (call, mode)
    stats = hf_async_cb.prefix_cache_stats(model)
    assert stats["clears"] == 0 and stats["hit_tokens"] >= 3 * 3 * 32 + 2 * 12 * 32  # pages of 16
    hf_async_cb.release(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_copied_last_pages_match_stock(mode):
    """Rows repeating prompts of whole pages on the default CUDA path: the later rows' last pages are
    copied on the device before their step (graphs replaying it), K/V and tokens alike."""
    import copy

    model = copy.deepcopy(tiny_model("llama")).to("cuda", torch.float32)
    prompts = [random_prompts(1, 32, 32, seed=31)[0]] * 4 + [random_prompts(1, 48, 48, seed=32)[0]] * 4
    ids, mask = (t.cuda() for t in left_pad(prompts))
    for options in (dict(do_sample=False), dict(do_sample=False, repetition_penalty=1e4)):
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, batching="off", **options)
        hf_async_cb.clear_prefix_cache(model)
        before = (hf_async_cb.prefix_cache_stats(model) or {}).get("copied_pages", 0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, batching=mode, **options)
        assert torch.equal(got, want), options
        assert hf_async_cb.prefix_cache_stats(model)["copied_pages"] - before == 6
    hf_async_cb.release(model)


def test_the_profile_reports_what_the_run_took_from_the_cache():
    model = tiny_model("llama")
    prompts = shared_prompts(groups=1, rows=3, prefix=32, own=4, seed=22)
    engine = Engine(model, BatchingConfig(mode="async", page_size=8, profile=True))
    engine.generate(prompts, max_new_tokens=3)
    first = engine.last_profile.summary()["prefix_cache"]
    engine.generate(prompts, max_new_tokens=3)
    second = engine.last_profile.summary()["prefix_cache"]
    assert first["hit_tokens"] == 2 * 32 and second["hit_tokens"] >= 3 * 32
    assert second["prefilled_tokens"] < first["prefilled_tokens"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_content_sums_move_with_any_values_moved(dtype):
    """The contents read per call tell a tensor whose values were only moved: rows reordered, input
    features swapped in every row or in one, a vector's values swapped, signs flipped, one bit."""
    from hf_async_cb.model.weight_kinds import content_sums
    g = torch.Generator().manual_seed(0)
    matrix, vector = torch.randn(12, 16, generator=g).to(dtype), torch.randn(16, generator=g).to(dtype)
    one_row = matrix.clone()
    one_row[3, [0, 5]] = matrix[3, [5, 0]]
    bit = matrix.clone()
    bit.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[2, 7] ^= 1
    moved = {"rows reordered": matrix.flip(0), "features swapped": matrix[:, torch.arange(16).roll(4)],
             "two values of one row swapped": one_row, "signs flipped": -matrix, "one bit": bit}
    base = content_sums([matrix])
    for name, changed in moved.items():
        assert content_sums([changed]) != base, name
    assert content_sums([vector.flip(0)]) != content_sums([vector])
    assert content_sums([matrix.clone()]) == base and content_sums([vector.clone()]) == content_sums([vector])


def test_content_sums_of_integer_codes_move_with_words_moved_within_rows():
    """int8 weights (LLM.int8, torchao's qdata, quanto's data) have no float sums: their words' column
    sums, by place, tell 4-byte groups moved within a row."""
    from hf_async_cb.model.weight_kinds import content_sums
    codes = torch.randint(-128, 128, (8, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    swapped = codes.clone()
    swapped[:, 0:4], swapped[:, 4:8] = codes[:, 4:8], codes[:, 0:4]
    assert content_sums([swapped]) != content_sums([codes]) and content_sums([codes.clone()]) == content_sums([codes])


def test_weights_in_torch_ao_packed_parameters_are_never_served_stale():
    """torch.ao's dynamically quantized Linears keep their weights in TorchScript objects, which no
    tensor read reaches: `set_weight_bias()` between calls must not leave the next call the old K/V."""
    model = torch.ao.quantization.quantize_dynamic(fresh_model("llama", seed=13), {torch.nn.Linear}, dtype=torch.float16)
    prompts = shared_prompts(groups=1, rows=2, prefix=32, own=4, seed=8)
    assert generate_rows(model, prompts, 6, "sync") == expected(model, prompts, 6)
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj.set_weight_bias(k_proj.weight() * -1, k_proj.bias())
    assert generate_rows(model, prompts, 6, "sync") == expected(model, prompts, 6)
    hf_async_cb.release(model)
