"""The async loop's own mechanics on the CPU stand-ins: it really overlaps (carry-over is used),
speculative tokens after EOS are dropped, and requests joining, skipping steps or being
preempted between steps keep stock's tokens."""

import pytest
import torch
from models import generated_rows, random_prompts, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.runner import ModelRunner


def expected_rows(model, prompts, new, eos=(2,), **kwargs):
    out = stock_generate(model, prompts, max_new_tokens=new, eos_token_id=list(eos), pad_token_id=0, **kwargs)
    return generated_rows(out, max(map(len, prompts)), pad=0, eos=eos)


@pytest.fixture
def carry_log(monkeypatch):
    """Records, per step, whether the step gathered carried-over tokens on the device."""
    log = []
    original = ModelRunner.step

    def step(self, inputs, previous_tokens=None):
        log.append(inputs.carry_src is not None)
        return original(self, inputs, previous_tokens)

    monkeypatch.setattr(ModelRunner, "step", step)
    return log


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_async_overlaps_and_sync_does_not(mode, carry_log):
    model = tiny_model("llama")
    prompts = random_prompts(6, 4, 12, seed=1)
    engine = Engine(model, BatchingConfig(mode=mode))
    outs = engine.generate(prompts, max_new_tokens=10, eos_token_ids=())
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 10, eos=())
    decode_steps = carry_log[1:]
    if mode == "async":
        assert all(decode_steps), "every async decode step should take its inputs from the step in flight"
    else:
        assert not any(carry_log)


def test_speculative_token_after_eos_is_dropped():
    """A request that hits EOS in step N already runs in N+1; that token must never appear."""
    model = tiny_model("qwen2")
    prompts = random_prompts(8, 3, 20, seed=2)
    first = expected_rows(model, prompts, 12, eos=())
    eos = (first[0][2], first[3][5])  # ends row 0 after 3 tokens, row 3 after at most 6
    expected = expected_rows(model, prompts, 12, eos=eos)
    for mode in ("sync", "async"):
        engine = Engine(model, BatchingConfig(mode=mode))
        outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=eos)
        assert [o.output_token_ids for o in outs] == expected
        discarded = engine.pipeline(mode).num_discarded
        assert (discarded > 0) == (mode == "async")
        assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("max_running, budget, pages", [
    (2, 512, None),   # requests join late, as others finish
    (16, 3, None),    # the budget is smaller than the running set: requests skip steps
    (16, 64, 14),     # a pool of 14 pages of 4: preemption between steps
])
def test_join_skip_and_preempt_keep_stock_tokens(max_running, budget, pages):
    model = tiny_model("llama")
    prompts = random_prompts(10, 2, 24, seed=3)
    expected = expected_rows(model, prompts, 14)
    config = BatchingConfig(mode="async", page_size=4, max_running_requests=max_running,
                            max_batch_tokens=budget, num_pages=pages)
    engine = Engine(model, config)
    outs = engine.generate(prompts, max_new_tokens=14, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected
    if pages:
        assert sum(o.num_preemptions for o in outs) > 0


def test_error_inside_a_step_leaves_the_engine_usable():
    model = tiny_model("llama")
    prompts = random_prompts(4, 3, 10, seed=4)
    calls = {"n": None}  # armed once the engine is built (a hook added after would be refused)

    def fail_on_third(*args):
        if calls["n"] is not None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault")

    handle = model.model.norm.register_forward_hook(fail_on_third)
    engine = Engine(model, BatchingConfig(mode="async"))
    calls["n"] = 0
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            engine.generate(prompts, max_new_tokens=8)
    finally:
        calls["n"] = None
    assert not engine.scheduler.has_work
    assert engine.allocator.num_free == engine.allocator.num_pages
    outs = engine.generate(prompts, max_new_tokens=8, eos_token_ids=(2,))
    handle.remove()
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 8)


def test_allocator_rejects_foreign_pages():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    with pytest.raises(ValueError):
        allocator.free([-1])
    with pytest.raises(ValueError):
        allocator.free([4])
    with pytest.raises(ValueError):
        allocator.allocate(-1)


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 2.00 GiB",  # the caching allocator's OutOfMemoryError
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",  # a library's RuntimeError
])
@pytest.mark.parametrize("online", [False, True])
def test_out_of_memory_in_a_step_says_what_to_change_and_the_engine_recovers(online, message):
    """A (simulated) CUDA OOM inside a step: the caller gets an OutOfMemoryError naming the knobs,
    the step's requests end, no page is held, and the engine then serves stock's tokens."""
    model = tiny_model("llama")
    prompts = random_prompts(4, 3, 10, seed=4)
    calls = {"n": None}  # armed once the engine is built (a hook added after would be refused)

    def oom_on_third(*args):
        if calls["n"] is not None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise (torch.OutOfMemoryError if "Tried" in message else RuntimeError)(message)

    handle = model.model.norm.register_forward_hook(oom_on_third)
    engine = Engine(model, BatchingConfig(mode="async", max_batch_tokens=32))
    calls["n"] = 0
    try:
        # The online handle raises a RuntimeError naming the request, caused by the step's error.
        with pytest.raises(RuntimeError) as caught:
            if online:
                engine.start()
                try:
                    handles = [engine.add_request(p, max_new_tokens=8) for p in prompts]
                    for h in handles:
                        h.result(timeout=30)
                finally:
                    engine.shutdown(timeout=30)
            else:
                engine.generate(prompts, max_new_tokens=8)
    finally:
        calls["n"] = None
    error = caught.value.__cause__ if online else caught.value
    assert isinstance(error, torch.OutOfMemoryError)
    assert message in str(error) and "max_batch_tokens" in str(error)
    assert not engine.scheduler.has_work
    assert engine.allocator.num_free == engine.allocator.num_pages
    outs = engine.generate(prompts, max_new_tokens=8, eos_token_ids=(2,))
    handle.remove()
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 8)
