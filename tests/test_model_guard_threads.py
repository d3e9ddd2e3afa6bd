"""generate() and Engines across threads and models that share parts: the model guard
(model/model_guard.py) makes calls take turns, refuses a wait that would deadlock, and a build waits
for a running call; the package's own weight moves (fusion) do not invalidate a held Engine.

Stock generate (batching="off") is the oracle for tokens. Every wait is bounded: a thread still
alive after its join's timeout is reported as a hang (its daemon thread is left behind, holding
only this test's own models)."""

import copy
import gc
import threading
import weakref

import pytest
import torch
from models import Gate, left_pad, random_prompts, started_thread, stock_generate, tiny_model
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_async_cb
from hf_async_cb import BatchingConfig

PROMPTS = random_prompts(3, 3, 16, seed=11)
WIDTH = max(map(len, PROMPTS))
FUSED = BatchingConfig(fuse_projections=True)


def fresh(family="llama"):
    return copy.deepcopy(tiny_model(family))


def engine_generate(model, prompts=PROMPTS, mode="sync", **kwargs):
    ids, mask = left_pad(prompts)
    kwargs.setdefault("max_new_tokens", 5)
    return model.generate(ids, attention_mask=mask, batching=mode, **kwargs)


def test_an_engine_built_while_another_thread_generates_is_not_refused(monkeypatch):
    """Engine(model) prepares (fuses) the model and runs its parity check's reference forward under
    the model's guard. (Outside it, a build overlapping another thread's generate(batching=...) call
    saw that call's fused modules and failed its own parity check: a ValueError saying the family
    "cannot run on hf_async_cb", though it ran fine a moment later.)

    The build's fusion gives the call a few seconds to take the model: without the guard over the
    whole build it takes it at once; with it, it waits for the build (a build that let the call in
    mid-preparation could not be correct), and both must then succeed."""
    import hf_async_cb.model.prepared as prepared

    model = fresh()
    expected = stock_generate(model, PROMPTS, max_new_tokens=5)
    engine_generate(model, batching_config=FUSED)  # the runtime built: the family's verdict is kept
    gate = Gate(WIDTH)
    building = threading.Event()
    real_fuse = prepared.fuse_projections

    def fuse_once_the_call_had_its_chance(m):
        building.set()
        gate.inside.wait(3)  # (the call holds the model by then, unless the build holds it)
        return real_fuse(m)

    monkeypatch.setattr(prepared, "fuse_projections", fuse_once_the_call_had_its_chance)

    def call():
        assert building.wait(30)
        return engine_generate(model, batching_config=FUSED, logits_processor=LogitsProcessorList([gate]))

    caller, call_box = started_thread(call)
    builder, build_box = started_thread(lambda: hf_async_cb.Engine(model, FUSED))
    builder.join(2)
    gate.release.set()
    caller.join(30)
    builder.join(30)
    monkeypatch.undo()
    assert not caller.is_alive() and not builder.is_alive(), "hang"
    assert torch.equal(call_box["value"], expected)
    assert "error" not in build_box, f"the build was refused: {build_box.get('error')!r}"
    engine = build_box["value"]
    try:
        outs = engine.generate(PROMPTS, max_new_tokens=5, eos_token_ids=())
        assert [o.output_token_ids for o in outs] == expected[:, WIDTH:].tolist()
    finally:
        engine.close()


def _calls_on_one_backbone_take_turns(a, b) -> None:
    """b takes a's backbone (its own head made different); a's call starts and holds the model, then
    b's: b's waits for a's, both give stock's tokens, and both configs are back on their attention."""
    b.model = a.model
    with torch.no_grad():
        b.lm_head.weight.mul_(4)
    expected = {name: stock_generate(m, PROMPTS, max_new_tokens=5) for name, m in (("a", a), ("b", b))}
    gate_a, gate_b = Gate(WIDTH), Gate(WIDTH)
    first, box_a = started_thread(lambda: engine_generate(a, logits_processor=LogitsProcessorList([gate_a])))
    assert gate_a.inside.wait(30)
    second, box_b = started_thread(lambda: engine_generate(b, logits_processor=LogitsProcessorList([gate_b])))
    assert not gate_b.inside.wait(1)  # waits for a's call
    gate_a.release.set()
    first.join(30)
    gate_b.release.set()
    second.join(30)
    assert not first.is_alive() and not second.is_alive(), "hang"
    assert "error" not in box_b, repr(box_b.get("error"))
    assert torch.equal(box_a["value"], expected["a"]) and torch.equal(box_b["value"], expected["b"])
    assert a.config._attn_implementation == "sdpa" and b.config._attn_implementation == "sdpa"
    for name, m in (("a", a), ("b", b)):
        assert torch.equal(stock_generate(m, PROMPTS, max_new_tokens=5), expected[name])


def test_models_sharing_a_backbone_but_not_a_config_take_turns():
    """Two heads on one backbone (`b.model = a.model`: a policy and a value/reward model) hold
    different config objects, but b's call switches a's config too (the backbone's modules hold it:
    attention.own_configs): they share one guard, and b's call waits for a's. (With a guard per
    config object, overlapping calls restored each other's setting: b's call failed, "bypasses the
    attention interface", and a's config was left on the paged attention for good.)"""
    a = fresh()
    _calls_on_one_backbone_take_turns(a, LlamaForCausalLM(copy.deepcopy(a.config)).eval())


class _CallsTheOther(LogitsProcessor):
    """Generates with another model once, after both threads are inside their calls."""

    def __init__(self, other, mode, barrier):
        self.other, self.mode, self.barrier = other, mode, barrier
        self.done = threading.Event()

    def __call__(self, input_ids, scores):
        if not self.done.is_set():
            self.done.set()
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                pass
            engine_generate(self.other, mode=self.mode, max_new_tokens=2)
        return scores


@pytest.mark.parametrize("outer, inner", [("sync", "off"), ("off", "sync"), ("sync", "sync")])
def test_two_models_generating_each_other_from_processors_do_not_deadlock(outer, inner):
    """Thread 1 generates with model A, its logits processor generating with model B; thread 2 the
    other way round (a guidance or reward model, each used by the other's calls). Stock transformers
    (batching="off" for both) runs it; with an engine call on either side the two guards are taken
    in opposite orders (both threads once waited forever).

    Both cannot succeed: an engine call holds its model switched (its configs on the paged attention,
    fused modules swapped in) for its whole run, and the other thread's processor needs that model at
    the same time, stock or on the engine; only a model running for two threads' calls at once could
    serve both. The wait that closes the cycle is refused at once with a RuntimeError naming the
    deadlock (the other thread's call holds the model this one waits for, and waits for the one this
    one holds), and the other call then finishes with stock's tokens. (Where the refused generate ran
    inside an engine call's first probe of its processors, generate/row_checks.py, the refusal stays
    there and both calls return stock's tokens.)"""
    a, b = fresh(), fresh("qwen2")
    expected = {name: stock_generate(m, PROMPTS, max_new_tokens=3) for name, m in (("a", a), ("b", b))}
    barrier = threading.Barrier(2, timeout=5)

    def call(model, other):
        return engine_generate(model, mode=outer, max_new_tokens=3,
                               logits_processor=LogitsProcessorList([_CallsTheOther(other, inner, barrier)]))

    ta, box_a = started_thread(lambda: call(a, b))
    tb, box_b = started_thread(lambda: call(b, a))
    ta.join(8)
    tb.join(1)
    assert not ta.is_alive() and not tb.is_alive(), "deadlock: both calls still wait for each other's model"
    boxes = {"a": box_a, "b": box_b}
    for name, box in boxes.items():
        if "error" in box:
            error = box["error"]
            assert isinstance(error, RuntimeError) and "deadlock" in str(error), repr(error)
        else:
            assert torch.equal(box["value"], expected[name])
    assert any("value" in box for box in boxes.values()), boxes


def test_a_fused_generate_call_does_not_invalidate_a_held_unfused_engine():
    """A service keeps a held Engine (projections unfused) and also calls model.generate(batching=...)
    with fused projections (the default on CUDA). The call's runtime fuses the weights in place,
    giving them new storage: the package's own move, which the held Engine does not take for a
    change (it once refused every later call: "the model changed since this Engine was built").
    (The other order, a fused held Engine first, is kept working by fusion._joined.)"""
    model = fresh()
    expected = stock_generate(model, PROMPTS, max_new_tokens=5)
    engine = hf_async_cb.Engine(model, BatchingConfig(fuse_projections=False))
    try:
        assert torch.equal(engine_generate(model, mode="async", batching_config=FUSED), expected)
        outs = engine.generate(PROMPTS, max_new_tokens=5, eos_token_ids=())
        assert [o.output_token_ids for o in outs] == expected[:, WIDTH:].tolist()
    finally:
        engine.close()


def test_models_found_to_share_a_backbone_after_their_first_calls_take_turns():
    """A guard is made on a model's first call: `b.model = a.model` assigned after each model had its
    own guard makes them one model to a call all the same. The next calls find the shared modules
    and merge the two guards (overlapping calls used to restore each other's attention setting), and
    the models are still garbage-collected."""
    a = fresh()
    b = LlamaForCausalLM(copy.deepcopy(a.config)).eval()
    engine_generate(a)
    engine_generate(b)  # (each with a guard of its own now)
    _calls_on_one_backbone_take_turns(a, b)
    refs = weakref.ref(a), weakref.ref(b)
    del a, b
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_held_engine_follows_another_engines_fusion_and_its_undoing_but_not_a_users_write():
    """A held unfused Engine beside a fused one that is built, then closed (its weights given their
    own storage back): neither counts as a change of the model (each is the package's own move), the
    held Engine runs on; a `p.data = ...` of the user's afterwards is still refused."""
    model = fresh()
    expected = stock_generate(model, PROMPTS, max_new_tokens=5)[:, WIDTH:].tolist()
    engine = hf_async_cb.Engine(model, BatchingConfig(fuse_projections=False))
    try:
        fused = hf_async_cb.Engine(model, FUSED)
        assert [o.output_token_ids for o in engine.generate(PROMPTS, max_new_tokens=5, eos_token_ids=())] == expected
        assert [o.output_token_ids for o in fused.generate(PROMPTS, max_new_tokens=5, eos_token_ids=())] == expected
        fused.close()
        assert [o.output_token_ids for o in engine.generate(PROMPTS, max_new_tokens=5, eos_token_ids=())] == expected
        q_proj = model.model.layers[0].self_attn.q_proj
        q_proj.weight.data = q_proj.weight.data.clone()
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.generate(PROMPTS, max_new_tokens=5, eos_token_ids=())
    finally:
        engine.close()


def test_a_storage_at_the_address_of_the_one_it_replaced_is_still_a_change():
    """A weight's storage is told by identity, not by its address alone: a `p.data = ...` whose new
    storage sits where the old one was (an allocator reusing a freed block; here two storages over one
    buffer) is refused by a held Engine and a serving loop's admission alike, as any other."""
    model = fresh()
    q_proj = model.model.layers[0].self_attn.q_proj
    buffer = bytearray(q_proj.weight.detach().numpy().tobytes())

    def over_buffer():
        return torch.frombuffer(buffer, dtype=q_proj.weight.dtype).view(q_proj.weight.shape)

    q_proj.weight.data = over_buffer()
    engine = hf_async_cb.Engine(model, BatchingConfig(fuse_projections=False))
    try:
        engine.generate(PROMPTS, max_new_tokens=2, eos_token_ids=())
        before = q_proj.weight.data_ptr()
        q_proj.weight.data = over_buffer()  # another storage, the same address
        assert q_proj.weight.data_ptr() == before
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.generate(PROMPTS, max_new_tokens=2, eos_token_ids=())
    finally:
        engine.close()
    from hf_async_cb.model.kv_fingerprint import WeightVersions

    weights = WeightVersions(model)  # (what a serving loop reads at each admission)
    assert not weights.restructured()
    q_proj.weight.data = over_buffer()
    assert weights.restructured()
