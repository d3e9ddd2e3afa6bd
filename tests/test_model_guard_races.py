"""The model guard (model/model_guard.py) under races: a merge of two guards while a call waits, the
collector finalizing a serving Engine inside the guard's lock, close() while start() waits.

Stock generate (batching="off", on a copy that shares nothing where the guard itself is probed) is
the oracle for tokens. Every wait is bounded; a thread still alive after its join's timeout is
reported as a hang (daemon threads, holding only this test's own models). The test whose hang would
leave the guard's global lock taken for good runs in a subprocess."""

import copy
import os
import subprocess
import sys
import textwrap
import threading
import time

import torch
from models import Gate, left_pad, random_prompts, started_thread, tiny_model
from transformers import LlamaForCausalLM, LogitsProcessorList

import hf_async_cb
from hf_async_cb.model.model_guard import model_guard

PROMPTS = random_prompts(3, 3, 16, seed=11)
WIDTH = max(map(len, PROMPTS))


def fresh(family="llama", seed=0):
    return copy.deepcopy(tiny_model(family, seed))


def generate(model, mode="sync", **kwargs):
    ids, mask = left_pad(PROMPTS)
    kwargs.setdefault("max_new_tokens", 4)
    return model.generate(ids, attention_mask=mask, batching=mode, **kwargs)


def _outcome(box):
    return repr(box["error"])[:300] if "error" in box else "ok"


def test_a_merge_while_a_call_waits_does_not_drop_the_waiting_threads_own_hold():
    """A user runs two models a and b, each generated once (each with its own guard), and a third
    model c built from b's config object and given a's backbone (`c.model = a.model`). Thread A runs
    generate(batching="sync") on a, whose logits processor generates on b while thread B's call holds
    b (so A waits for b). Meanwhile the main thread calls stock generate on c, which merges a's and
    b's guards (c shares parts of both).

    Expected: c's stock call waits until A's engine call on a (whose backbone c runs, its config
    switched to the paged attention) has ended, and every call gives stock's tokens (or, at worst, a
    clean refusal of A's nested call on b).

    (What happened: when B's call ended, A's wait in ModelGuard._enter took the merged root (a's own
    guard, which A already owned) as a fresh owner: `root._owner, root._holds = me, serving, [kind]`
    overwrites A's outer hold (the re-entry check `mine = self._owned_by(me)` runs only once, before
    the wait loop, not again after a merge). The nested call's exit then set the owner to None, so
    A's outer call ran unguarded: c's stock call ran during it and failed ("LlamaAttention called the
    'hf_async_cb_paged' attention outside an engine step"), and A's own call failed with
    IndexError('pop from empty list') from held()'s `guard._holds.pop()`.) Now A's nested call on b,
    one model with a since the merge, is refused as a call inside its own ("busy on this thread")."""
    a, b = fresh(), fresh(seed=1)
    generate(a, "off")
    generate(b, "off")  # (each with its own guard now)
    c = LlamaForCausalLM(b.config).eval()
    c.model = a.model  # c: a's backbone, b's config object
    expected_a = generate(copy.deepcopy(a), "off")
    expected_c = generate(copy.deepcopy(c), "off")
    assert model_guard(a, create=False) is not model_guard(b, create=False)

    gate_b = Gate(WIDTH)
    nested_started, nested_done, c_finished = threading.Event(), threading.Event(), threading.Event()

    def on_a(input_ids, scores):  # (state in the closure: the engine probes processors for state)
        if input_ids.shape[1] > WIDTH and not nested_started.is_set():
            nested_started.set()
            try:
                generate(b, "sync", max_new_tokens=2)  # waits for thread B's call on b
            finally:
                nested_done.set()
            c_finished.wait(5)  # a's call goes on meanwhile, holding a
        return scores

    thread_b, box_b = started_thread(lambda: generate(b, "sync", logits_processor=LogitsProcessorList([gate_b])))
    assert gate_b.inside.wait(30)
    thread_a, box_a = started_thread(lambda: generate(a, "sync", logits_processor=LogitsProcessorList([on_a])))
    assert nested_started.wait(30)
    time.sleep(0.5)  # A waits for b
    thread_c, box_c = started_thread(lambda: generate(c, "off"))  # merges a's and b's guards
    time.sleep(0.5)
    gate_b.release.set()
    nested_done.wait(30)
    thread_c.join(5)
    c_finished.set()
    for thread in (thread_a, thread_b, thread_c):
        thread.join(30)
    assert not any(t.is_alive() for t in (thread_a, thread_b, thread_c)), "hang"
    assert "error" not in box_c, f"c's stock call ran during a's engine call: {_outcome(box_c)}"
    assert torch.equal(box_c["value"], expected_c)
    if "error" in box_a:  # its processor's call on b, one model with a since the merge: refused, and raised
        assert isinstance(box_a["error"], RuntimeError) and "busy on this thread" in str(box_a["error"]), _outcome(box_a)
    else:
        assert torch.equal(box_a["value"], expected_a)


_GC_SCRIPT = textwrap.dedent("""
    import gc, os, sys, threading, weakref
    sys.path[:0] = [{tests!r}, {root!r}]
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["HF_ASYNC_CB_KEEP_PARITY"] = "0"
    import copy
    import torch
    torch.set_num_threads(1)
    import hf_async_cb
    import hf_async_cb.model.model_guard as mg
    from models import random_prompts, started_thread, tiny_model

    model, other = copy.deepcopy(tiny_model("llama")), copy.deepcopy(tiny_model("llama"))

    class Service:  # an app object and its engine referring to each other: a reference cycle
        def __init__(self, model):
            self.engine = hf_async_cb.Engine(model)
            self.engine.owner = self
            self.engine.start()

    gc.collect()
    gc.disable()  # (the dropped service stays young until the lookup below)
    service = Service(model)
    service.engine.add_request(random_prompts(1, 3, 8, seed=1)[0], max_new_tokens=2).result(timeout=30)
    engine = weakref.ref(service.engine)
    del service  # dropped without shutdown(): its loop is stopped by its finalizer when collected

    real_parts = mg._parts

    def parts_then_a_collection_soon(m):  # (only steers when the collection runs: a few allocations on)
        out = real_parts(m)
        gc.set_threshold(gc.get_count()[0] + 12)
        gc.enable()
        return out

    mg._parts = parts_then_a_collection_soon
    thread, box = started_thread(lambda: mg.model_guard(other))
    thread.join(20)
    print("collected:", engine() is None, "hung:", thread.is_alive(), box, flush=True)
    os._exit(1 if thread.is_alive() or "error" in box else 0)
""")


def test_a_dropped_serving_engine_collected_by_the_cyclic_gc_does_not_deadlock_the_guard(tmp_path):
    """A service keeps an Engine in a reference cycle (the engine refers back to its owner), starts
    its loop and drops it without shutdown(): docs promise "a dropped started Engine stops its loop
    and gives the model back" (weakref.finalize -> _Worker.request_stop). Python's cyclic collector
    runs at an arbitrary allocation of an arbitrary thread; here it runs (steered to a few
    allocations later) while a thread is inside `with _COND:` in model_guard(), indexing a model on
    its first call.

    Expected: the lookup returns, the loop stops. (The finalizer ran inside the lock on that thread,
    and request_stop() took the non-reentrant lock again through model_guard(...): the thread hung for
    good, and with it every later generate / Engine call of the process. The lock is reentrant now and
    the loop keeps its guard from its start.) Run in a subprocess: a hang would leave this process's
    guard lock taken."""
    script = tmp_path / "gc_in_guard_lock.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(_GC_SCRIPT.format(tests=tests, root=os.path.dirname(tests)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("the subprocess hung") from None
    last = [line for line in run.stdout.splitlines() if line.startswith("collected:")]
    assert run.returncode == 0, f"model_guard() deadlocked on its own lock: {last} {run.stderr[-1500:]}"


def test_closing_an_engine_while_its_start_waits_for_the_model_leaves_no_loop_holding_the_model():
    """A server thread calls engine.start() while another thread's generate call holds the model
    (start() waits for it: its prompt-embeddings check takes the model's guard), and a shutdown thread
    calls engine.close() meanwhile (close() sees no loop yet and waits for the guard too).

    Expected: either close() wins and start() then refuses ("this Engine was closed"), or start()
    wins and close() stops the loop; in both cases the model is free afterwards for generate. (close()
    used to return first, then start() went on and left a loop holding the model for good on the
    closed engine: close() now takes the engine's _lifecycle lock, as start() and shutdown() do.)"""
    model = fresh()
    expected = generate(copy.deepcopy(model), "off")
    engine = hf_async_cb.Engine(model)
    gate = Gate(WIDTH)
    holder, holder_box = started_thread(lambda: generate(model, "sync", logits_processor=LogitsProcessorList([gate])))
    try:
        assert gate.inside.wait(30)
        starter, start_box = started_thread(engine.start)
        time.sleep(0.5)
        closer, close_box = started_thread(engine.close)
        time.sleep(0.5)
    finally:
        gate.release.set()
    for thread in (holder, starter, closer):
        thread.join(30)
    assert not any(t.is_alive() for t in (holder, starter, closer)), "hang"
    assert "error" not in holder_box, _outcome(holder_box)
    try:
        if "error" not in close_box:  # closed: nothing may serve the model now
            loop = engine._background
            assert loop is None or not loop.thread.is_alive(), (
                f"a background loop runs on the closed engine (start: {_outcome(start_box)})")
            assert torch.equal(generate(model, "off"), expected)
    finally:
        try:
            engine.shutdown(cancel=True, timeout=10)
        except Exception:  # noqa: BLE001 - best effort clean-up
            pass
