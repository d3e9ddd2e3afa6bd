"""The profiler: spans per lane ordered and disjoint, adding up to the wall time; the timeline PNG."""

import pytest
from models import random_prompts, tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine.profiling import CPU_LANES, plot_timelines


def profiled(mode):
    engine = Engine(tiny_model("llama"), BatchingConfig(mode=mode, profile=True))
    engine.generate(random_prompts(8, 3, 30, seed=91), max_new_tokens=12)
    return engine.last_profile


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_spans_are_ordered_disjoint_and_cover_the_run(mode):
    profile = profiled(mode)
    lanes = profile.lanes()
    assert set(lanes) == set(CPU_LANES)
    for spans in lanes.values():
        for a, b in zip(spans, spans[1:]):
            assert a.start <= a.end <= b.start
    # The CPU lanes never overlap each other either (one thread), and they fill most of the run.
    everything = sorted((s for spans in lanes.values() for s in spans), key=lambda s: s.start)
    for a, b in zip(everything, everything[1:]):
        assert a.end <= b.start + 1e-6
    summary = profile.summary()
    covered = sum(summary[f"{lane}_share"] for lane in CPU_LANES)
    assert 0.8 < covered <= 1.0 + 1e-6
    assert summary["steps"] == len(lanes["launch"]) == 12  # one prefill step samples the first token


def test_timeline_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timelines({"sync": profiled("sync"), "async": profiled("async")}, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_profiling_is_off_by_default():
    engine = Engine(tiny_model("llama"), BatchingConfig(mode="async"))
    engine.generate([[5, 6, 7]], max_new_tokens=3)
    assert engine.last_profile is None and engine.pipeline("async").profile is None


def test_first_call_phases_name_the_parity_check_and_every_phase_exists():
    """tools/phases.py: every phase it wraps still exists under its name (a rename would silently drop
    it from the first-call reports), and a runtime's first call reports its preparation and the parity
    check (whose stock forward runs only where no verdict for the model's kind is kept yet)."""
    import importlib

    from hf_async_cb.tools import phases

    for module_name, path in phases.PHASES:
        owner = importlib.import_module(module_name)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(owner), (module_name, path)
    phases.time_phases()
    phases.taken()
    model = tiny_model("llama")
    import hf_async_cb

    hf_async_cb.release(model)
    ids = random_prompts(2, 4, 4, seed=3)
    import torch

    model.generate(torch.tensor(ids), attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=3,
                   batching="sync", pad_token_id=0)
    report = phases.taken()
    assert report["PreparedModel.__init__"] > 0 and report["Engine._build"] > 0
    assert 0 < report.get("_reference_logits", 0.0) <= report["check_parity"] or "_reference_logits" not in report
    assert phases.taken() == {}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_background_loop_is_profiled_too(mode):
    """With profile=True the serving loop's steps land in last_profile, as a run's do."""
    engine = Engine(tiny_model("llama"), BatchingConfig(mode=mode, profile=True))
    engine.start()
    try:
        handles = [engine.add_request(p, max_new_tokens=6) for p in random_prompts(4, 3, 20, seed=92)]
        for h in handles:
            h.result(timeout=60)
    finally:
        engine.shutdown()
    lanes = engine.last_profile.lanes()
    assert set(lanes) == set(CPU_LANES) and all(lanes.values())
    assert engine.last_profile.summary()["wall_s"] > 0


def test_a_serving_loops_profile_has_its_share_of_the_prefix_cache():
    """As a run's profile does (docs/api.md): a serving loop's, from start() to shutdown()."""
    import copy

    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode="async", profile=True, page_size=4))
    shared = list(range(3, 27))
    engine.start()
    try:
        for tail in ([30, 31], [40, 41, 42]):  # the second reads the first's pages
            engine.add_request(shared + tail, max_new_tokens=3).result(timeout=60)
    finally:
        engine.shutdown(timeout=30)
    share = engine.last_profile.summary()["prefix_cache"]
    assert share["hit_tokens"] >= 20 and share["prefilled_tokens"] > 0, share
