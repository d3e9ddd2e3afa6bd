"""The serving loop's lifecycle under threads: starts that race, a shutdown between an add_request's
check and its submission, waits on the loop's own thread, and per-request options the online API
must treat as generate() does."""

import copy
import threading
import time

import pytest
from models import generated_rows, left_pad, random_prompts, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine


def stock_rows(prompts, new, **options):
    return generated_rows(stock_generate(tiny_model("llama"), prompts, max_new_tokens=new, eos_token_id=[2],
                                         pad_token_id=0, **options), max(map(len, prompts)), pad=0, eos=(2,))


def _all_at_once(calls) -> list:
    """Run `calls` on threads released together; each one's result or exception."""
    gate = threading.Barrier(len(calls))
    out: list = [None] * len(calls)

    def run(i):
        gate.wait()
        try:
            out[i] = calls[i]()
        except Exception as error:  # noqa: BLE001 - what the test looks at
            out[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_starts_that_race_give_one_loop_and_clear_refusals(mode):
    """Several threads start() one engine at once, and two engines on one model start at once: one
    loop serves (stock's tokens), every other start() is refused in its caller's thread with the
    reason, and after shutdown() the model is free again (stock generate, a new start())."""
    model = copy.deepcopy(tiny_model("llama"))
    prompts = random_prompts(3, 4, 12, seed=31)
    expected = stock_rows(prompts, 6)
    for _ in range(3):
        engine = Engine(model, BatchingConfig(mode=mode))
        results = _all_at_once([engine.start] * 4)
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(refused) == 3 and all(isinstance(r, RuntimeError) and "already running" in str(r)
                                         for r in refused), results
        handles = [engine.add_request(p, max_new_tokens=6, eos_token_ids=(2,)) for p in prompts]
        assert [h.result(timeout=60).output_token_ids for h in handles] == expected
        engine.shutdown(timeout=30)
        engine.close()
    for _ in range(3):
        first, second = Engine(model, BatchingConfig(mode=mode)), Engine(model, BatchingConfig(mode=mode))
        results = _all_at_once([first.start, second.start])
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(refused) == 1 and "serving another Engine" in str(refused[0]), results
        serving, idle = (first, second) if results[0] is None else (second, first)
        handle = serving.add_request(prompts[0], max_new_tokens=6, eos_token_ids=(2,))
        assert handle.result(timeout=60).output_token_ids == expected[0]
        serving.shutdown(timeout=30)
        idle.start()  # (the refused one starts once the other stopped)
        assert idle.add_request(prompts[1], max_new_tokens=6, eos_token_ids=(2,)).result(timeout=60) \
            .output_token_ids == expected[1]
        idle.shutdown(timeout=30)
        serving.close()
        idle.close()
    ids, mask = left_pad(prompts)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, batching="off", eos_token_id=[2], pad_token_id=0)
    assert generated_rows(got, max(map(len, prompts)), pad=0, eos=(2,)) == expected


def test_a_shutdown_between_add_requests_check_and_its_submission_is_a_clear_refusal(monkeypatch):
    """add_request reads the loop once: a shutdown() from another thread while it checks the request
    ends in the loop's "shutting down" refusal, not in an AttributeError on the dropped loop."""
    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode="async"))
    engine.start()
    make_request = engine.make_request

    def shut_down_meanwhile(*args, **kwargs):
        request = make_request(*args, **kwargs)
        threading.Thread(target=engine.shutdown, kwargs=dict(timeout=30)).start()
        deadline = time.monotonic() + 30
        while engine._background is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        return request

    monkeypatch.setattr(engine, "make_request", shut_down_meanwhile)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.add_request([5, 6, 7], max_new_tokens=2)
    engine.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_waiting_on_a_request_from_the_loops_own_thread_is_refused_at_once(mode):
    """A done-callback or on_token runs on the loop's thread: a result() or a read there of a request
    still running would stop the loop, the only thread that can end it (a hang without a timeout).
    It raises at once, and the loop serves on; a finished request's result() there is fine."""
    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode=mode))
    engine.start()
    try:
        prompts = random_prompts(2, 4, 9, seed=33)
        expected = stock_rows(prompts, 1)
        seen = {}
        long = engine.add_request(prompts[1], max_new_tokens=400, eos_token_ids=())  # (runs while short ends)
        next(iter(long))

        def on_done(handle):
            started = time.perf_counter()
            for name, wait in (("result", lambda: long.result(timeout=20)), ("iterate", lambda: list(long)),
                               ("own result", lambda: handle.result())):
                try:
                    wait()
                    seen[name] = "returned"
                except RuntimeError as error:
                    seen[name] = str(error)
            seen["seconds"] = time.perf_counter() - started

        short = engine.add_request(prompts[0], max_new_tokens=1, eos_token_ids=(2,))
        short.add_done_callback(on_done)
        assert short.result(timeout=60).output_token_ids == expected[0]
        assert not long.done  # (it was running when the callback waited on it)
        engine.abort(long)
        long.result(timeout=60)
        assert "loop thread" in seen["result"] and "loop thread" in seen["iterate"], seen
        assert seen["own result"] == "returned" and seen["seconds"] < 5, seen
    finally:
        engine.shutdown(timeout=30)


def test_suppressed_ids_outside_the_vocabulary_are_ignored_online_as_in_generate():
    """docs/api.md: (begin_)suppress_tokens ids outside the vocabulary are ignored, as stock does;
    generate() did, add_request refused them."""
    model = copy.deepcopy(tiny_model("llama"))
    vocab = model.config.vocab_size
    prompts = random_prompts(2, 4, 9, seed=35)
    first = stock_rows(prompts, 6)[0][0]
    expected = stock_rows(prompts, 6, suppress_tokens=[first], begin_suppress_tokens=[3])
    engine = Engine(model, BatchingConfig(mode="async"))
    engine.start()
    try:
        handles = [engine.add_request(p, max_new_tokens=6, eos_token_ids=(2,), suppress_tokens=[first, vocab + 7],
                                      begin_suppress_tokens=[vocab, 3]) for p in prompts]
        got = [h.result(timeout=60).output_token_ids for h in handles]
    finally:
        engine.shutdown(timeout=30)
    assert got == expected


def test_a_forward_of_the_served_model_says_it_is_served():
    """Calling the model itself while its engine serves raises, and says why and what to do (it used
    to guess at a model sharing the config); after shutdown() the model runs as stock."""
    import torch

    model = copy.deepcopy(tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7]])
    expected = model(ids).logits
    engine = Engine(model, BatchingConfig(mode="async"))
    engine.start()
    try:
        with pytest.raises(RuntimeError, match=r"held by an engine right now \(a serving loop: call the model after "
                                               r"shutdown\(\)"):
            model(ids)
    finally:
        engine.shutdown(timeout=60)
        engine.close()
    assert torch.equal(model(ids).logits, expected)
