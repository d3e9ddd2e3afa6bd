"""CUDA-only reliability checks: a real out-of-memory inside a step, and a soak of the online API on
the device. Skipped (with the reason shown) where CUDA is absent.

Out of memory for real, from the CUDA caching allocator itself (tests/test_pipeline.py raises a
simulated one on the CPU), in two ways:
- a forward hook on the input embeddings asks for twice the device's memory during one chosen
  prefill step (decode steps, graphed or not, are narrower than it looks for): deterministic, and
  the step can be one that runs while another is in flight;
- after the engine sized its pool and ran once, a ballast tensor takes all of the free memory but
  LEAVE, less than one prefill step's activations (what another process or engine on the same GPU
  does): the model's own activations no longer fit.
Either way the caller gets a torch.OutOfMemoryError whose message keeps the allocator's and names the
settings to lower, no page stays held, the engine (and a new generate call) then serves the tokens
of a fresh run, and the online loop fails only the requests of that moment, each with the error,
and keeps serving.

The soak runs benchmarks/gpu_soak.py's harness (run_soak) for a few hundred requests.
"""

import contextlib
import copy
import functools
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from models import left_pad, random_prompts, tiny_model

from hf_async_cb import BatchingConfig, Engine, FinishReason, SamplingParams
from hf_async_cb.generate import runtime

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_soak  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LOOP_THREAD = "hf_async_cb-loop"
KNOBS = ("max_batch_tokens", "max_running_requests", "kv_memory_fraction", "num_pages")


def cuda_tiny():
    return copy.deepcopy(tiny_model("llama")).to("cuda")  # fp32


def assert_explained_oom(error, original=None):
    """The engine's OutOfMemoryError: says what happened and what to change; keeps the allocator's text."""
    assert isinstance(error, torch.OutOfMemoryError), repr(error)
    message = str(error)
    assert "out of memory inside a generation step" in message, message
    for knob in KNOBS:
        assert knob in message, (knob, message)
    if original is not None:
        assert isinstance(original, torch.OutOfMemoryError), repr(original)
        assert "out of memory" in str(original).lower()
        assert str(original) in message


def loop_threads():
    return [t for t in threading.enumerate() if t.name == LOOP_THREAD and t.is_alive()]


# -- out of memory asked for by a hook -----------------------------------------------------------
# Prefill steps run eagerly here: a prefill graph's capture that runs out of memory falls back to an
# eager step (the OOM is not seen), and its replay allocates nothing (the graph pool holds its memory).
HOOK_CONFIG = dict(page_size=16, num_pages=256, max_batch_tokens=64, max_running_requests=16, prefill_graphs=False)
MIN_PREFILL = 24  # tokens: more than any decode step (at most 16 rows, graph buckets included)


class OomOnStep:
    """A forward hook on the input embeddings: the `nth` forward of at least `min_tokens` tokens after
    arming asks the CUDA allocator for twice the device's memory (a real torch.OutOfMemoryError,
    inside the step). Fires once."""

    def __init__(self, model, min_tokens: int, nth: int = 1, armed: bool = True) -> None:
        self.min_tokens, self.nth, self.armed = min_tokens, nth, armed
        self.seen = 0
        self.fired = False
        self._handle = model.get_input_embeddings().register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        if not self.armed or self.fired or output.shape[-2] < self.min_tokens:
            return
        self.seen += 1
        if self.seen == self.nth:
            self.fired = True
            total = torch.cuda.get_device_properties(output.device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=output.device)

    def __enter__(self) -> "OomOnStep":
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def test_oom_in_a_step_of_engine_generate_is_explained_and_the_engine_recovers():
    """The second prefill step runs out of memory while the first is still in flight (async)."""
    model = cuda_tiny()
    prompts = random_prompts(12, 20, 60, seed=31)
    config = BatchingConfig(mode="async", **HOOK_CONFIG)
    with Engine(model, config) as fresh:
        expected = [o.output_token_ids for o in fresh.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))]
    # The hook is in place before the engine is built (one added after is a changed model, refused)
    # and armed once it is, so that only the steps' forwards count.
    with OomOnStep(model, MIN_PREFILL, nth=2, armed=False) as hook, Engine(model, config) as engine:
        hook.armed = True
        with pytest.raises(torch.OutOfMemoryError) as caught:
            engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
        assert hook.fired
        assert_explained_oom(caught.value, original=caught.value.__cause__)
        del caught  # its traceback holds the failed step's tensors
        assert not engine.scheduler.has_work
        assert engine.allocator.num_free == engine.allocator.num_pages
        again = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
        assert [o.output_token_ids for o in again] == expected
        assert engine.allocator.num_free == engine.allocator.num_pages


def test_oom_in_a_step_of_model_generate_leaves_the_model_usable():
    """The runtime kept between calls (and its prefix cache) survives an out-of-memory step: the
    prompts of the failed call, prefilled in part when it failed, then give stock's tokens (no K/V
    of the failed step is reused)."""
    model = cuda_tiny()
    first, failing = (left_pad(random_prompts(8, 20, 60, seed=seed)) for seed in (32, 132))
    config = BatchingConfig(max_batch_tokens=64, max_running_requests=16,  # the pool sized from memory
                            prefill_graphs=False)

    def generate(prompts, batching):
        ids, mask = (t.cuda() for t in prompts)
        return model.generate(ids, attention_mask=mask, batching=batching, batching_config=config,
                              max_new_tokens=12, eos_token_id=[2], pad_token_id=0)

    stock, stock_failing = generate(first, "off"), generate(failing, "off")
    attention = model.config._attn_implementation
    with OomOnStep(model, MIN_PREFILL, nth=2, armed=False) as hook:
        # The first calls build the runtime around the hook (its checks run forwards of their own, which
        # must not count), the second one with a pool that holds the failing call, so that it is not
        # rebuilt (a hooked model's parity is checked again at each build). The hook is armed for the
        # failing call, whose steps alone then run forwards; its prompts are new to the prefix cache, so
        # that its prefill steps are whole prompts.
        fresh = generate(first, "async")
        generate(left_pad(random_prompts(16, 60, 60, seed=33)), "async")
        built = runtime._RUNTIMES[model].builds
        hook.armed = True
        with pytest.raises(torch.OutOfMemoryError) as caught:
            generate(failing, "async")
        assert runtime._RUNTIMES[model].builds == built  # the OOM came from a step, not from a build
    assert hook.fired
    assert_explained_oom(caught.value, original=caught.value.__cause__)
    del caught
    assert model.config._attn_implementation == attention
    assert torch.equal(generate(first, "off"), stock)  # unfused, as it was
    assert torch.equal(generate(first, "async"), fresh)
    assert torch.equal(generate(failing, "async"), stock_failing)


def test_oom_in_a_step_of_the_online_loop_fails_that_step_and_the_loop_keeps_serving():
    """Requests decode; a new one's prefill step runs out of memory. The requests active then end
    (ABORTED, their handles re-raise the explained error, tokens a prefix of a fresh run's); those
    that finished before keep their tokens; nothing is lost; the loop thread lives on and serves
    the next requests with a fresh run's tokens."""
    model = cuda_tiny()
    config = BatchingConfig(mode="async", **HOOK_CONFIG)
    running = random_prompts(6, 5, 15, seed=33)
    late = random_prompts(1, 40, 40, seed=34)[0]  # its prefill alone is a step of >= MIN_PREFILL tokens
    after = random_prompts(8, 5, 40, seed=35)
    new = [64] * len(running) + [8] + [12] * len(after)
    with Engine(model, config) as fresh:
        expected = [o.output_token_ids for o in fresh.generate(
            running + [late] + after, [SamplingParams(max_new_tokens=n) for n in new])]
    threads_before = set(threading.enumerate())
    with OomOnStep(model, MIN_PREFILL, armed=False) as hook, Engine(model, config) as engine:
        engine.start()
        try:
            handles = [engine.add_request(p, max_new_tokens=64) for p in running]
            deadline = time.monotonic() + 30
            while not all(h.done or h.request.output_token_ids for h in handles) and time.monotonic() < deadline:
                time.sleep(0.001)
            hook.armed = True
            handles.append(engine.add_request(late, max_new_tokens=8))
            outcomes = []
            for h in handles:
                try:
                    outcomes.append(h.result(timeout=60))
                except RuntimeError as error:  # the handle names the request; the step's error is its cause
                    outcomes.append(error.__cause__)
            assert hook.fired
            assert all(h.done for h in handles)
            assert isinstance(outcomes[-1], BaseException), "the late request's step ran out of memory"
            for h, outcome, want in zip(handles, outcomes, expected):
                if isinstance(outcome, BaseException):
                    assert_explained_oom(outcome)
                    assert h.request.finish_reason is FinishReason.ABORTED
                    assert h.request.output_token_ids == want[: len(h.request.output_token_ids)]
                else:
                    assert outcome.output_token_ids == want
            assert engine._background.thread.is_alive(), "the loop thread died with the step"
            assert loop_threads() == [engine._background.thread]
            later = [engine.add_request(p, max_new_tokens=12) for p in after]
            assert [h.result(timeout=60).output_token_ids for h in later] == expected[len(running) + 1:]
        finally:
            engine.shutdown(cancel=True, timeout=60)
        assert not loop_threads()
        assert not engine.scheduler.has_work
        assert engine.allocator.num_free == engine.allocator.num_pages
    assert [t for t in threading.enumerate() if t not in threads_before] == []


# -- out of memory from the model's own activations ----------------------------------------------
LEAVE = 128 * 2**20  # free bytes left beside the ballast
PROMPT = 2048  # one prompt's prefill: its fused gate/up output alone is 2048 x 2 x 16384 fp32 = 256 MiB


def wide_llama():
    """Two wide layers: small weights (~0.5 GB), large prefill activations."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=16384,
                                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(config).eval()


@contextlib.contextmanager
def device_nearly_full(leave: int):
    """All of the device's free memory but `leave` bytes held by a ballast tensor, for the duration."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    assert free > leave + 2**30, f"only {free / 2**30:.1f} GiB free"
    ballast = torch.empty(free - leave, dtype=torch.uint8, device="cuda")
    try:
        yield
    finally:
        del ballast
        torch.cuda.empty_cache()


def _tokens_or_errors(engine, prompts, online):
    """Each request's tokens, or the error it ended with (the engine's OutOfMemoryError)."""
    if not online:
        try:
            return [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=3)]
        except torch.OutOfMemoryError as error:
            return [error] * len(prompts)
    handles = [engine.add_request(p, max_new_tokens=3) for p in prompts]
    results = []
    for h in handles:
        try:
            results.append(h.result(timeout=120).output_token_ids)
        except RuntimeError as error:
            results.append(error.__cause__)
    return results


@pytest.mark.parametrize("online", [False, True], ids=["generate", "online"])
def test_activations_that_no_longer_fit_raise_an_explained_oom_and_the_engine_recovers(online):
    """The pool and the first run fit; then the device fills up (another tenant) and a prefill step's
    activations do not: every request of that run ends with the explained OutOfMemoryError; once the
    memory is back, the same engine (the same loop thread, online) gives a fresh engine's tokens for
    the failed run's prompts (none of its K/V reused from the prefix cache) and the first run's again.
    The failed run's prompts are new to the prefix cache: the first run's would be served from it,
    prefilling a few tokens each, whose activations fit."""
    model = wide_llama()
    prompts, failing = (random_prompts(8, PROMPT, PROMPT, seed=seed, vocab=4096) for seed in (36, 136))
    config = BatchingConfig(mode="async", page_size=16, num_pages=2 * len(prompts) * (PROMPT // 16 + 1) + 16,
                            max_batch_tokens=len(prompts) * PROMPT, max_running_requests=len(prompts),
                            prefill_graphs=False)
    with Engine(model, config) as fresh:
        want = [o.output_token_ids for o in fresh.generate(failing, max_new_tokens=3)]
    with Engine(model, config) as engine:
        if online:
            engine.start()
        try:
            # The fresh run; it also loads, in the thread that runs the steps, every kernel and cuBLAS
            # handle the failing run needs, so that nothing but activations is left to allocate.
            expected = _tokens_or_errors(engine, prompts, online)
            assert all(isinstance(t, list) and len(t) == 3 for t in expected), expected
            with device_nearly_full(LEAVE):
                failed = _tokens_or_errors(engine, failing, online)
            for error in failed:
                assert_explained_oom(error)
            del failed
            assert engine.allocator.num_free == engine.allocator.num_pages
            if online:
                assert engine._background.thread.is_alive(), "the loop thread died with the step"
            assert _tokens_or_errors(engine, failing, online) == want
            assert _tokens_or_errors(engine, prompts, online) == expected
        finally:
            if online:
                engine.shutdown(cancel=True, timeout=60)
        assert not loop_threads()
        assert not engine.scheduler.has_work
        assert engine.allocator.num_free == engine.allocator.num_pages


# -- a soak of the online API ---------------------------------------------------------------------
def test_online_soak_on_cuda():
    """400 random requests (greedy and sampled, seeded or not, penalties, min_new_tokens, suppressed
    tokens, EOS) from two producer threads with a bounded backlog, 15% aborted from a third thread,
    a pool that preempts; checked by gpu_soak.run_soak: nothing lost or duplicated, streams equal
    outputs, stops agree with the parameters, greedy and seeded requests give a sync re-run's tokens
    (a prefix when aborted; a greedy divergence only at a near-tie that a plain forward confirms),
    no page held, no thread left. Under 60 s after the warm-up."""
    model = cuda_tiny()
    config = BatchingConfig(mode="async", page_size=8, num_pages=160, max_batch_tokens=128,
                            max_running_requests=32)
    make = functools.partial(gpu_soak.make_work, seed=0, vocab=model.config.vocab_size, max_prompt=60,
                             max_new=48, abort_share=0.15)
    with Engine(model, config) as engine:
        gpu_soak.warm_up(engine, make)
        start = time.monotonic()
        report = gpu_soak.run_soak(engine, make, requests=400, submit_until=start + 25, results_until=start + 35,
                                   check_until=start + 50, tie_tolerance=1e-4, backlog=64, rerun_chunk=128)
        elapsed = time.monotonic() - start
    print(report.summary())
    assert report.ok, "\n".join(report.problems[:30])
    assert report.submitted == 400 and report.cancelled == 0 and report.unchecked == 0
    assert report.finished > 0 and report.aborted > 0
    assert report.greedy_checked > 100 and report.seeded_checked > 50
    assert elapsed < 60, f"{elapsed:.1f} s"
