"""The runtime kept on a model across generate(batching=...) calls: reused, rebuilt exactly when
what it depends on changes, invisible between calls, freed by release(), and dying with the model."""

import copy
import gc
import tempfile
import threading
import weakref

import pytest
import torch
from models import generated_rows, left_pad, random_prompts, stock_generate, tiny_model

import hf_async_cb
from hf_async_cb import BatchingConfig
from hf_async_cb.generate import runtime as runtime_module

FUSED = BatchingConfig(fuse_projections=True, max_batch_tokens=32)


def fresh(family="llama"):
    return copy.deepcopy(tiny_model(family))


def engine_generate(model, prompts, config=FUSED, mode="async", **kwargs):
    ids, mask = left_pad(prompts)
    kwargs.setdefault("max_new_tokens", 6)
    return model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, **kwargs)


def builds(model) -> int:
    return runtime_module._RUNTIMES[model].builds


def snapshot(model):
    return ({n: type(m) for n, m in model.named_modules()}, list(model.state_dict()),
            model.config._attn_implementation, {n: m.__dict__.get("forward") for n, m in model.named_modules()})


PROMPTS = random_prompts(4, 3, 20, seed=3)


def test_calls_reuse_one_runtime_and_match_stock():
    model = fresh()
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    for mode in ("async", "sync", "async"):
        assert torch.equal(engine_generate(model, PROMPTS, mode=mode), expected)
    assert builds(model) == 1 and runtime_module._RUNTIMES[model].calls == 3
    assert "3 calls, 1 builds" in hf_async_cb.runtime_info(model)


def test_per_call_fields_do_not_rebuild_but_structural_ones_do():
    model = fresh()
    engine_generate(model, PROMPTS)
    for config in (FUSED.with_mode("sync"), BatchingConfig(**{**vars(FUSED), "seed": 5, "progress": False})):
        engine_generate(model, PROMPTS, config=config)
    assert builds(model) == 1
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    out = engine_generate(model, PROMPTS, config=BatchingConfig(fuse_projections=True, max_batch_tokens=8))
    assert torch.equal(out, expected) and builds(model) == 1  # a new runtime: its first build


def test_between_calls_the_model_is_stock():
    model = fresh()
    reference = fresh()
    before = snapshot(model)
    engine_generate(model, PROMPTS)
    assert snapshot(model) == before
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    with tempfile.TemporaryDirectory() as folder:  # views of the fused weights save as stock's
        model.save_pretrained(folder)
        loaded = type(model).from_pretrained(folder)
    assert {k: v.tolist() for k, v in loaded.state_dict().items()} == \
        {k: v.tolist() for k, v in reference.state_dict().items()}


def test_training_between_calls_is_seen_by_the_next_call():
    model = fresh()
    engine_generate(model, PROMPTS)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([PROMPTS[0]])
    loss = model(ids, labels=ids).loss
    loss.backward()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.grad is not None and q.grad.abs().sum() > 0  # gradients reach the model's own parameters
    optimizer.step()
    model.eval()
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    assert not torch.equal(expected, stock_generate(tiny_model("llama"), PROMPTS, max_new_tokens=6))
    assert torch.equal(engine_generate(model, PROMPTS), expected)
    assert builds(model) == 1  # trained in place: the fused layout still holds the weights


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_first_call_under_inference_mode_leaves_nothing_that_breaks_later_calls(mode):
    """What a call made under torch.inference_mode() builds and keeps (fused weights, pool, I/O
    slots, the held Engine and its background loop) is made of normal tensors: later calls outside
    it give stock's tokens, and the model still trains."""
    model = fresh()
    ids, mask = left_pad(PROMPTS)
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    with torch.inference_mode():
        assert torch.equal(engine_generate(model, PROMPTS, mode=mode), expected)
    assert torch.equal(engine_generate(model, PROMPTS, mode=mode), expected)
    assert builds(model) == 1
    loss = model(torch.tensor([PROMPTS[0]]), labels=torch.tensor([PROMPTS[0]])).loss
    loss.backward()  # would fail on weights that are views of inference tensors
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None

    other = fresh("qwen2")
    ids, mask = left_pad(PROMPTS)
    stock = other.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[2], pad_token_id=0,
                           batching="off")
    expected = generated_rows(stock, ids.shape[1], pad=0, eos=(2,))
    rows = lambda outs: [o.output_token_ids for o in outs]  # noqa: E731
    with torch.inference_mode():
        engine = hf_async_cb.Engine(other, BatchingConfig(mode=mode, fuse_projections=True))
        first = rows(engine.generate(PROMPTS, max_new_tokens=4, eos_token_ids=(2,)))
        engine.start()
    handle = engine.add_request(PROMPTS[0], max_new_tokens=4, eos_token_ids=(2,))
    online = handle.result(timeout=60).output_token_ids
    engine.shutdown(timeout=30)
    later = rows(engine.generate(PROMPTS, max_new_tokens=4, eos_token_ids=(2,)))
    engine.close()
    assert first == later == expected and online == expected[0]


def test_dtype_change_rebuilds():
    model = fresh()
    engine_generate(model, PROMPTS)
    first = runtime_module._RUNTIMES[model]
    model.to(torch.float64)
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))
    assert runtime_module._RUNTIMES[model] is not first


def test_reassigned_weight_and_config_change_rebuild():
    model = fresh()
    engine_generate(model, PROMPTS)
    first = runtime_module._RUNTIMES[model]
    layer = model.model.layers[1].mlp.up_proj
    with torch.no_grad():
        layer.weight.data = layer.weight.data.clone() * 0.5
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))
    second = runtime_module._RUNTIMES[model]
    assert second is not first
    model.config.rms_norm_eps = 1e-2
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))
    assert runtime_module._RUNTIMES[model] is not second


class _Scaled(torch.nn.Module):
    """A user's wrapper around a projection (as adapters and quantisers put in place)."""

    def __init__(self, inner: torch.nn.Module, factor: float) -> None:
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, x):
        return self.inner(x) * self.factor


def test_hooks_and_modules_changed_between_calls_run_as_in_stock():
    """Fused projections bypass their members' calls and CUDA graphs replay no Python: a forward hook
    added or removed, or a module wrapped, since the last call must take effect (a new preparation),
    and the user's wrapper must stay where it was put."""
    model = fresh()
    engine_generate(model, PROMPTS)
    attn = model.model.layers[0].self_attn
    handle = attn.q_proj.register_forward_hook(lambda module, args, out: out * 5)
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    assert not torch.equal(expected, stock_generate(fresh(), PROMPTS, max_new_tokens=6))  # the hook matters
    assert torch.equal(engine_generate(model, PROMPTS), expected)
    handle.remove()
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))
    pre = model.model.layers[1].mlp.up_proj.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))
    pre.remove()
    wrapper = attn.v_proj = _Scaled(attn.v_proj, 3.0)
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    assert torch.equal(engine_generate(model, PROMPTS, mode="sync"), expected)
    assert attn.v_proj is wrapper  # not put back to the Linear the first preparation fused
    assert torch.equal(stock_generate(model, PROMPTS, max_new_tokens=6), expected)
    attn.v_proj = wrapper.inner
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(fresh(), PROMPTS, max_new_tokens=6))


def test_a_hooked_projection_is_not_fused():
    from hf_async_cb.model.fusion import fuse_projections

    model = fresh()
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda module, args, out: out)
    with fuse_projections(model) as fused:
        assert fused.counts == {"qkv": 2, "gate_up": 1}  # every group but the hooked one
        assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear


def test_a_held_engine_refuses_hooks_added_under_it():
    model = fresh()
    engine = hf_async_cb.Engine(model, FUSED)
    engine.generate(PROMPTS, max_new_tokens=2)
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError, match="a forward hook added or removed"):
        engine.generate(PROMPTS, max_new_tokens=2)
    handle.remove()
    assert len(engine.generate(PROMPTS, max_new_tokens=2)) == len(PROMPTS)
    engine.close()


def test_release_frees_and_the_next_call_rebuilds():
    model = fresh()
    assert hf_async_cb.release(model) is False
    engine_generate(model, PROMPTS)
    assert hf_async_cb.release(model) is True and hf_async_cb.runtime_info(model) is None
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))


def test_the_runtime_dies_with_the_model():
    model = fresh()
    engine_generate(model, PROMPTS)
    runtime = weakref.ref(runtime_module._RUNTIMES[model])
    engine = weakref.ref(runtime().engine)
    del model
    gc.collect()
    assert runtime() is None and engine() is None


def test_the_pool_grows_on_demand_a_few_times():
    model = fresh()
    sizes = []
    for n in (1, 2, 3, 5, 8, 13, 21, 34):
        prompts = random_prompts(n, 3, 20, seed=n)
        assert torch.equal(engine_generate(model, prompts, mode="sync", max_new_tokens=3),
                           stock_generate(model, prompts, max_new_tokens=3))
        sizes.append(runtime_module._RUNTIMES[model].engine.num_pages)
    assert sizes == sorted(sizes) and builds(model) <= 6  # doubling: fewer builds than calls
    needed = sum(-(-(len(p) + 3) // FUSED.page_size) for p in random_prompts(34, 3, 20, seed=34))
    assert needed <= sizes[-1] < 2 * needed


def test_every_order_of_modes_and_configs_matches_stock():
    model = fresh("qwen2")
    configs = [FUSED, BatchingConfig(page_size=4, max_batch_tokens=16), FUSED, BatchingConfig(cuda_graphs=True)]
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    for config in configs:
        for mode in ("sync", "async"):
            assert torch.equal(engine_generate(model, PROMPTS, config=config, mode=mode), expected)


def test_engine_failing_after_fusing_gives_the_model_back():
    model = fresh()
    before = snapshot(model)
    for bad in (BatchingConfig(fuse_projections=True, cpu_kv_cache_bytes=1),
                BatchingConfig(fuse_projections=True, num_pages=2**40)):
        with pytest.raises((ValueError, RuntimeError, MemoryError)):
            hf_async_cb.Engine(model, bad)
        with pytest.raises((ValueError, RuntimeError, MemoryError)):
            engine_generate(model, PROMPTS, config=bad)
        assert snapshot(model) == before
    model.to(torch.float64)
    assert stock_generate(model, PROMPTS, max_new_tokens=4).dtype == torch.long


@pytest.mark.parametrize("stage", ["measured_layout", "allocate_pool", "PageAllocator", "Scheduler", "BatchBuilder", "Streams",
                                   "ModelRunner", "DecodeGraphs"])
def test_engine_failing_at_any_stage_after_fusing_gives_the_model_back(stage, monkeypatch):
    from hf_async_cb.engine import engine as engine_module

    model = fresh()
    before = snapshot(model)

    def broken(*args, **kwargs):
        raise RuntimeError(f"{stage} failed")

    monkeypatch.setattr(engine_module, stage, broken)
    config = BatchingConfig(fuse_projections=True, cuda_graphs=True)
    with pytest.raises(RuntimeError, match=f"{stage} failed"):
        hf_async_cb.Engine(model, config)
    assert snapshot(model) == before
    attn = model.model.layers[0].self_attn  # Engine gave each weight its own storage again
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match=f"{stage} failed"):
        engine_generate(model, PROMPTS, config=config)
    assert snapshot(model) == before and runtime_module._RUNTIMES.get(model) is None
    monkeypatch.undo()
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))


def test_an_engine_generate_inside_a_processor_of_the_same_model_is_refused():
    """(A stock generate there runs, as in stock: tests/test_callback_forwards.py.)"""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = fresh()

    class Reentrant(LogitsProcessor):
        def __call__(self, input_ids, scores):
            model.generate(input_ids[:, -2:], max_new_tokens=1, batching="sync")
            return scores

    before = snapshot(model)
    with pytest.raises(RuntimeError, match="inside a generate call"):
        engine_generate(model, PROMPTS, logits_processor=LogitsProcessorList([Reentrant()]))
    assert snapshot(model) == before
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))


def _race(model, jobs):
    results, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            results[i] = job()
        except BaseException as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a concurrent call hung"
    assert not errors, errors
    return results


@pytest.mark.parametrize("trial", range(100))
def test_concurrent_generate_calls_on_one_model(trial):
    """Random mixes of async / sync / stock calls with random batches from several threads: every
    result is stock's, and the model is left as it was found."""
    model = tiny_model("llama")  # shared with other tests: its runtime carries over, as in a notebook
    g = torch.Generator().manual_seed(trial)
    before = snapshot(model)
    jobs, expected = [], []
    for j in range(int(torch.randint(2, 5, (1,), generator=g))):
        prompts = random_prompts(int(torch.randint(1, 5, (1,), generator=g)), 2, 12, seed=100 * trial + j)
        mode = ["async", "sync", "off"][int(torch.randint(0, 3, (1,), generator=g))]
        config = [FUSED, BatchingConfig(max_batch_tokens=16)][int(torch.randint(0, 2, (1,), generator=g))]
        expected.append(stock_generate(model, prompts, max_new_tokens=4))
        jobs.append(lambda p=prompts, m=mode, c=config: engine_generate(model, p, config=c, mode=m, max_new_tokens=4))
    for got, want in zip(_race(model, jobs), expected):
        assert torch.equal(got, want)
    assert snapshot(model) == before


def test_one_engine_from_two_threads():
    model = fresh()
    prompts = [random_prompts(5, 3, 20, seed=s) for s in (1, 2, 3, 4)]
    expected = [stock_generate(model, p, max_new_tokens=6) for p in prompts]
    with hf_async_cb.Engine(model, FUSED) as engine:
        results = _race(model, [lambda p=p: engine.generate(p, max_new_tokens=6) for p in prompts])
    for outs, want, p in zip(results, expected, prompts):
        width = max(map(len, p))
        assert [o.output_token_ids for o in outs] == want[:, width:].tolist()


def test_a_model_serving_a_background_loop_refuses_generate_at_once():
    model = fresh()
    engine = hf_async_cb.Engine(model, BatchingConfig())
    engine.start()
    try:
        handle = engine.add_request(PROMPTS[0], max_new_tokens=4)
        with pytest.raises(RuntimeError, match="background loop"):
            engine_generate(model, PROMPTS)
        with pytest.raises(RuntimeError, match="background loop"):
            stock_generate(model, PROMPTS, max_new_tokens=2)
        handle.result(timeout=60)
    finally:
        engine.shutdown()
        engine.close()
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))


def test_stock_generate_nests_in_stock_generate_as_in_transformers():
    from transformers import LogitsProcessor, LogitsProcessorList

    model = fresh()
    engine_generate(model, PROMPTS)  # the model has a guard now
    inner = []

    class Nested(LogitsProcessor):
        def __call__(self, input_ids, scores):
            inner.append(model.generate(input_ids[:1, -2:], max_new_tokens=1, batching="off", do_sample=False))
            return scores

    out = stock_generate(model, PROMPTS, max_new_tokens=3, logits_processor=LogitsProcessorList([Nested()]))
    assert torch.equal(out, stock_generate(model, PROMPTS, max_new_tokens=3)) and len(inner) == 3


class _Gate:
    """A logits processor that holds its first call on rows longer than `width` (a row's second new
    token) until released. (It keeps no count of its calls: generate() refuses processors that keep
    state from call to call, which it would call once per row.)"""

    def __init__(self, width):
        self.inside, self.release, self.width = threading.Event(), threading.Event(), width

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.width and not self.inside.is_set():
            self.inside.set()
            self.release.wait(60)
        return scores


def test_models_sharing_one_config_object_take_turns():
    """Two models built from one config object (a policy and its reference model) share the config
    that a call switches to the paged attention: their calls take turns, and the config ends as it
    began. (Overlapping calls used to restore each other's setting: the config stayed on the paged
    attention and every later forward of both models failed.)"""
    from transformers import LogitsProcessorList

    config = copy.deepcopy(tiny_model("llama").config)
    policy, reference = (type(tiny_model("llama"))(config).eval() for _ in range(2))
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(1.5)
    expected = [stock_generate(m, PROMPTS, max_new_tokens=6) for m in (policy, reference)]
    before = config._attn_implementation
    gate, order, results = _Gate(max(map(len, PROMPTS))), [], {}

    def first():
        results["policy"] = engine_generate(policy, PROMPTS, logits_processor=LogitsProcessorList([gate]))
        order.append("policy")

    def second():
        results["reference"] = engine_generate(reference, PROMPTS, mode="sync")
        order.append("reference")

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert gate.inside.wait(60)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    threads[1].join(0.5)
    assert threads[1].is_alive() and not order  # waits for the policy's call
    gate.release.set()
    for t in threads:
        t.join(120)
    assert order == ["policy", "reference"]
    assert torch.equal(results["policy"], expected[0]) and torch.equal(results["reference"], expected[1])
    assert config._attn_implementation == before
    with torch.no_grad():
        assert policy(torch.tensor([PROMPTS[0]])).logits.shape[1] == len(PROMPTS[0])


def test_a_call_gives_every_sub_config_its_own_attention_setting_back():
    """transformers' setter spreads one value over a composite config's sub-configs; a call must
    give each its own setting back, not the top-level one."""
    from transformers import Gemma3Config

    from hf_async_cb.model import attention

    config = Gemma3Config()
    config._attn_implementation = "eager"
    config.text_config._attn_implementation_internal = "sdpa"
    with attention.implementation(config, attention.ATTENTION_NAME):
        assert config.text_config._attn_implementation == attention.ATTENTION_NAME
        assert config.vision_config._attn_implementation == attention.ATTENTION_NAME
    assert (config._attn_implementation, config.text_config._attn_implementation,
            config.vision_config._attn_implementation) == ("eager", "sdpa", "eager")


def test_two_models_measuring_their_layouts_at_once():
    """The K/V layout probe switches the config for a forward: it runs under the model's guard, and
    two models probing at once do not take each other's attention function away."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    a = LlamaForCausalLM(LlamaConfig(vocab_size=253, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    b = Qwen2ForCausalLM(Qwen2Config(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1)).eval()
    expected = stock_generate(a, PROMPTS, max_new_tokens=6)
    inside, go = threading.Event(), threading.Event()

    def slow_layer(module, args):  # holds a's layout probe in its forward
        if str(a.config._attn_implementation).startswith("hf_async_cb_layout_probe") and not inside.is_set():
            inside.set()
            go.wait(60)

    handle = a.model.layers[1].register_forward_pre_hook(slow_layer)
    results = {}
    thread = threading.Thread(target=lambda: results.update(a=engine_generate(a, PROMPTS, config=BatchingConfig())))
    thread.start()
    assert inside.wait(60)
    engine_generate(b, PROMPTS, config=BatchingConfig())  # b's first call: its own probe, meanwhile
    go.set()
    thread.join(120)
    handle.remove()
    assert torch.equal(results["a"], expected)


def test_a_second_preparation_of_a_fused_model_keeps_the_first_ones_weights():
    """A held Engine with fused projections, then another Engine or a generate(batching=...) call on
    the same model: the second preparation fuses the same weights again, in place (they already are
    one tensor), so the first engine keeps running on them; a new storage would make it refuse."""
    model = fresh()
    expected = [o for o in stock_generate(model, PROMPTS, max_new_tokens=4)]
    first = hf_async_cb.Engine(model, FUSED)
    pointers = [p.data_ptr() for p in model.parameters()]
    second = hf_async_cb.Engine(model, FUSED)
    engine_generate(model, PROMPTS, max_new_tokens=4)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    rows = generated_rows(torch.stack(expected), max(map(len, PROMPTS)), 0, ())
    for engine in (first, second, first):
        assert [o.output_token_ids for o in engine.generate(PROMPTS, max_new_tokens=4)] == rows
    second.close()  # the first still runs on the fused weights: they stay its views
    assert [o.output_token_ids for o in first.generate(PROMPTS, max_new_tokens=4)] == rows
    first.close()
    assert torch.equal(stock_generate(model, PROMPTS, max_new_tokens=4), torch.stack(expected))


def test_max_time_starts_when_the_call_has_the_model():
    """max_time counts the call's own generation, as stock's clock does: not the time it waited
    for another thread's call on the model."""
    import time

    from transformers import LogitsProcessorList

    model = fresh()
    expected = stock_generate(model, PROMPTS, max_new_tokens=12, max_time=30.0)
    gate, results = _Gate(max(map(len, PROMPTS))), {}
    holder = threading.Thread(target=lambda: engine_generate(model, PROMPTS, logits_processor=LogitsProcessorList([gate])))
    holder.start()
    assert gate.inside.wait(60)
    waiter = threading.Thread(target=lambda: results.update(
        out=engine_generate(model, PROMPTS, max_new_tokens=12, max_time=2.0, eos_token_id=2, pad_token_id=0)))
    waiter.start()
    time.sleep(2.5)  # longer than its max_time, spent waiting for the model
    gate.release.set()
    for t in (holder, waiter):
        t.join(120)
    assert torch.equal(results["out"], expected)


def test_transformers_own_hooks_are_not_the_users():
    """Asking the model for hidden states (or enabling gradient checkpointing) makes transformers
    install hooks of its own for good, no-ops outside those features: a held Engine keeps running,
    the runtime is not rebuilt, and the family's parity verdict is still kept."""
    from hf_async_cb.engine import parity

    model = fresh()
    engine = hf_async_cb.Engine(model, FUSED)
    engine_generate(model, PROMPTS)
    first = runtime_module._RUNTIMES[model]
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]), output_hidden_states=True, output_attentions=True)
    assert any(m._forward_hooks for m in model.modules())  # transformers' capturing hooks
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)
    assert torch.equal(engine_generate(model, PROMPTS), expected)
    assert runtime_module._RUNTIMES[model] is first
    rows = generated_rows(expected, max(map(len, PROMPTS)), 0, ())
    assert [o.output_token_ids for o in engine.generate(PROMPTS, max_new_tokens=6)] == rows
    engine.close()
    parity._VERDICTS.clear()
    hf_async_cb.Engine(model).close()
    assert parity._VERDICTS  # kept: the model counts as unhooked


@pytest.fixture
def interruptible():
    """SIGINT raises KeyboardInterrupt for the test, as in an interactive Python: a process started
    in the background by a non-interactive shell (`pytest ... &`) inherits SIGINT ignored, where a
    Ctrl-C interrupts nothing and deferring it has nothing to deliver."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_cleanup_is_delivered_after_it(interruptible):
    import signal

    from hf_async_cb.interrupts import deferred_interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
            done.append("the block ran to its end")
    assert done and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_while_the_model_is_given_back_leaves_it_stock(monkeypatch, interruptible):
    """SIGINT landing in the middle of giving the model back its modules and attention setting
    (here: as the first of them is put back) still leaves it stock, then interrupts the caller;
    the guard is free for the next call."""
    import signal

    from hf_async_cb.model.fusion import FusedProjections

    model = fresh()
    before = snapshot(model)
    detach = FusedProjections.detach
    fired = []

    def interrupted_detach(self):
        if not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        detach(self)

    engine_generate(model, PROMPTS)  # the runtime built (its preparation detaches once)
    monkeypatch.setattr(FusedProjections, "detach", interrupted_detach)
    with pytest.raises(KeyboardInterrupt):
        engine_generate(model, PROMPTS)
    monkeypatch.undo()
    assert fired and snapshot(model) == before
    assert torch.equal(engine_generate(model, PROMPTS), stock_generate(model, PROMPTS, max_new_tokens=6))


def test_stock_calls_share_the_model_and_wait_only_for_engine_calls():
    """With the hook installed, stock generate calls from several threads run side by side as in
    stock transformers (a stopping criterion may even run the same model from a worker thread),
    while an engine call still waits for them and they for it."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = fresh()
    ids, mask = left_pad(PROMPTS)
    expected = stock_generate(model, PROMPTS, max_new_tokens=6)

    class RunsTheModelElsewhere(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            worker = threading.Thread(target=lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1))
            worker.start()
            worker.join(30)
            assert not worker.is_alive(), "a stock call waited for another stock call"
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                         stopping_criteria=StoppingCriteriaList([RunsTheModelElsewhere()]))
    assert torch.equal(out, expected)
    gate = _Gate(ids.shape[1])
    from transformers import LogitsProcessorList

    holder = threading.Thread(target=lambda: model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                                                            logits_processor=LogitsProcessorList([gate])))
    holder.start()
    assert gate.inside.wait(60)  # a stock call in progress
    engine_results = {}
    engine_call = threading.Thread(target=lambda: engine_results.update(out=engine_generate(model, PROMPTS)))
    engine_call.start()
    engine_call.join(0.5)
    assert engine_call.is_alive()  # waits for the stock call
    gate.release.set()
    for t in (holder, engine_call):
        t.join(120)
    assert torch.equal(engine_results["out"], expected)
