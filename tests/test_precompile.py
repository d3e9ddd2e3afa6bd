"""Compiling ahead (kernels/precompile.py) on the CPU: the variants a model's facts imply cover every
kernel launch its runs make (keys named by Triton's own binder for an H200, from the launches the
interpreter runs), whatever the batch sizes and prompt lengths; the precompile is a no-op off CUDA;
and compile workers fill Triton's disk cache under the keys the serving process then finds there
(in a process without the interpreter, compiling for sm_90 with no GPU)."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from models import random_prompts, tiny_model

from hf_async_cb import BatchingConfig, Engine, SamplingParams

pytestmark = pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="records the interpreter's launches")


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch the interpreter runs: (kernel, args, kwargs)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append((self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def _keys(recorded) -> dict[str, str]:
    from hf_async_cb.kernels.variant import Variant, jit_key

    return {jit_key(kernel, args, kwargs): Variant(kernel, ()).name for kernel, args, kwargs in recorded}


# (Each family is half a minute of the interpreter. Qwen3 launches Llama's kernels and its q/k norms'
# besides, here in bf16 with prompts that share their pages; Mistral its sliding window, in fp32;
# GPT-2 a subset of Llama's, without norms and rotary. The listing does not depend on the pairing of
# family and dtype: one run per dtype.)
@pytest.mark.parametrize("family, dtype", [("qwen3", torch.bfloat16), ("mistral", torch.float32)])
def test_the_listed_variants_cover_every_launch(family, dtype, launches, monkeypatch):
    from hf_async_cb.engine import engine as engine_module
    from hf_async_cb.engine import shared_prefix_groups
    from hf_async_cb.kernels.model_variants import facts_of, model_variants
    from hf_async_cb.kernels.variant import variant_key

    listed = set()

    def listing(engine, model, ahead=None):  # what the build hands the precompile on CUDA, at that very point of it
        listed.update(variant_key(v) for v in model_variants(facts_of(engine, model)))

    monkeypatch.setattr(engine_module, "precompile", listing)
    model = copy.deepcopy(tiny_model(family)).to(dtype)
    config = BatchingConfig(attention="triton", fuse_projections=True, fuse_elementwise=True, cuda_graphs=True,
                            page_size=4, max_batch_tokens=96, mode="sync",
                            trust_untested_model=True)  # (the scaled tiny model drifts in bf16; launches are the point)
    with Engine(model, config) as engine:
        assert listed
        launches.clear()  # (the preparation's checks run kernels on inputs of their own)
        # One row; short prompts; a prompt chunked over two steps, with tall (>= 64-token) query tiles
        # (one row: three of them took half the test's minute in the interpreter, for the same variants).
        for rows, (lo, hi) in [(1, (1, 1)), (3, (2, 9)), (1, (100, 100))]:
            prompts = random_prompts(rows, lo, hi, seed=rows)
            engine.generate(prompts, max_new_tokens=3)
            sampled = [SamplingParams(max_new_tokens=3, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                                      seed=i, repetition_penalty=1.2 if i % 2 else 1.0) for i in range(rows)]
            engine.generate(prompts, sampled)
        if dtype == torch.bfloat16:  # a prompt repeated: decode steps read its cached prefix once per group
            monkeypatch.setattr(shared_prefix_groups, "MIN_SHARED_TOKENS", 8)  # (short prompts: the interpreter)
            engine.generate(random_prompts(1, 20, 20, seed=4) * 2, max_new_tokens=4)
    ran = _keys(launches)
    missing = {key: name for key, name in ran.items() if key not in listed}
    assert not missing, f"{len(missing)} launched variants not listed: {sorted(set(missing.values()))}"
    names = set(ran.values())
    assert {"paged_attention._paged_attention_kernel", "draw_greedy._greedy_parts_kernel",
            "draw_sampled._resolve_kernel"} <= names
    assert "elementwise._rms_norm_kernel" in names
    if dtype == torch.bfloat16:
        assert "shared_prefix_attention._shared_prefix_kernel" in names


@pytest.mark.parametrize("family, dtype", [("llama", torch.bfloat16), ("mistral", torch.float32), ("gpt2", torch.float32)])
def test_the_variants_listed_before_preparation_are_among_the_builds(family, dtype, monkeypatch):
    """What compiles while the model is prepared (facts_before_preparation: its attention and draws)
    is among what the build then lists for the prepared model, which leaves it out: a variant listed
    early but not launched would be a compile for nothing."""
    from hf_async_cb.engine import engine as engine_module
    from hf_async_cb.kernels.model_variants import facts_before_preparation, facts_of, model_variants

    listed = set()
    monkeypatch.setattr(engine_module, "precompile", lambda engine, model, ahead=None: listed.update(
        v.identity() for v in model_variants(facts_of(engine, model))))
    model = copy.deepcopy(tiny_model(family)).to(dtype)
    config = BatchingConfig(attention="triton", page_size=8, mode="sync", trust_untested_model=True)
    early = model_variants(facts_before_preparation(model, config.page_size, "triton"))
    names = {v.name for v in early}
    assert {"paged_attention._paged_attention_kernel", "draw_sampled._resolve_kernel",
            "draw_greedy._greedy_parts_kernel", "store_kv._store_kv_kernel"} <= names
    with Engine(model, config):
        assert listed
    missing = [v.name for v in early if v.identity() not in listed]
    assert not missing, f"listed before preparation, not by the build: {missing}"
    # The reference attention launches no attention kernels: none are listed for it.
    assert not facts_before_preparation(model, 8, "reference").attention


def test_precompiles_of_the_same_variants_take_turns_and_others_compile_at_once():
    """Engines built together (one per GPU) list the same variants: the later waits for the earlier's
    compile and finds them on disk. A preparation's checks and the engine's attention and draws list
    different ones: they compile at the same time. A precompile that gave up holds up none."""
    import threading

    from hf_async_cb.kernels.precompile import _Turns

    turns, order = _Turns(), []
    first = turns.enter(frozenset({"norm", "rotary"}))
    other = turns.enter(frozenset({"attention"}))  # nothing in common with the first
    given_up = turns.enter(frozenset({"rotary"}))
    same = turns.enter(frozenset({"rotary", "draw"}))  # shares "rotary" with the first and the given up
    assert first[0] == [] and other[0] == [] and given_up[0] == [first[1]] and same[0] == [first[1], given_up[1]]

    def run(place, name):
        with turns.turn(*place):
            order.append(name)

    waiting = threading.Thread(target=run, args=(same, "same"))
    waiting.start()
    run(other, "other")  # at once
    given_up[1].set()
    assert order == ["other"] and waiting.is_alive()
    run(first, "first")
    waiting.join(timeout=10)
    assert not waiting.is_alive() and order == ["other", "first", "same"]
    assert turns.enter(frozenset({"norm"}))[0] == []  # (the finished ones are forgotten)


def test_nothing_is_compiled_ahead_off_cuda():
    from hf_async_cb.kernels.precompile import precompile

    with Engine(tiny_model("llama"), BatchingConfig(attention="triton", mode="sync")) as engine:
        assert precompile(engine, engine.model) is None and engine._precompile is None


_COMPILE_AHEAD = r"""
import os, sys, torch
from hf_async_cb.kernels import draw_greedy, store_kv
from hf_async_cb.kernels.precompile import Precompile
from hf_async_cb.kernels.variant import compiling_for, sm90

pool = torch.empty(64, 2, 16, dtype=torch.bfloat16, device="meta")
variants = store_kv.variants(pool, pool, torch.bfloat16, torch.bfloat16) + draw_greedy.variants(torch.bfloat16, 1000, 1000)
files = lambda: sum(len(f) for _, _, f in os.walk(os.environ["TRITON_CACHE_DIR"]))
with compiling_for(sm90()):
    if sys.argv[1] == "compile":
        ahead = Precompile(variants, torch.device("cpu"), "a test model", workers=2).wait()
        assert len(ahead.compiled) == 3 and ahead.loaded == 3 and not ahead.failed, ahead.summary()
        assert not [c for c in ahead.compiled if c.error], ahead.compiled
        again = Precompile(variants, torch.device("cpu"), workers=2).wait()  # all in this process's JIT now
        assert again.compiled == [] and again.loaded == 0 and "loaded already" in again.summary(), again.summary()
    elif sys.argv[1] == "precompile again":  # another process: all on disk under the keys its JIT looks up, no workers
        before = files()
        ahead = Precompile(variants, torch.device("cpu"), workers=2).wait()
        assert ahead.on_disk and ahead.compiled == [] and ahead.loaded == 3 and not ahead.failed, ahead.summary()
        assert files() == before, (before, files())
    else:  # the entries gone, the marker left: loading compiles them here, still right
        import shutil
        root = os.environ["TRITON_CACHE_DIR"]
        for entry in os.listdir(root):
            if entry != "hf_async_cb-precompiled":
                shutil.rmtree(os.path.join(root, entry))
        ahead = Precompile(variants, torch.device("cpu"), workers=2).wait()
        assert ahead.on_disk and ahead.loaded == 3 and not ahead.failed, ahead.summary()
        assert all(v.warmup() is not None for v in variants)
print("files", files())
"""


def test_compile_workers_fill_the_disk_cache_another_process_then_reads(tmp_path):
    """...and a later process precompiling the same variants finds them all there without starting workers."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    for step in ("compile", "precompile again", "entries gone"):
        result = subprocess.run([sys.executable, "-c", _COMPILE_AHEAD, step], env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert int(result.stdout.split("files")[-1]) >= 3 * 5  # each compile left its IR, binary and metadata
    assert len(os.listdir(tmp_path / "hf_async_cb-precompiled")) == 1  # one list of variants, compiled once


def test_a_slow_first_use_is_said_once(caplog):
    from hf_async_cb.kernels import precompile as module

    with caplog.at_level("WARNING", logger=module.__name__):
        module.note_slow_preparation("TinyModel on cuda:7", 0.5)  # quick: nothing to say
        module.note_slow_preparation("TinyModel on cuda:7", 3.0, "compiling its kernels")
        module.note_slow_preparation("TinyModel on cuda:7", 4.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "TinyModel on cuda:7 took 3.0 s (compiling its kernels)" in lines[0]


def test_a_first_use_is_said_in_one_line_for_all_its_precompiles(caplog, monkeypatch):
    """A model's first engine waits for up to three precompiles (the checks' kernels, the attention and
    draws, the rest): a slow first use is one line, with their totals, once."""
    from types import SimpleNamespace

    from hf_async_cb.kernels import precompile as module

    monkeypatch.setattr(module, "_NOTED", set())
    compiled = [SimpleNamespace(seconds=0.5)] * 4
    checks = SimpleNamespace(compiled=compiled[:2], workers=2, seconds=1.2, on_disk=False, loaded=2, failed=[])
    ahead = SimpleNamespace(compiled=compiled[2:], workers=15, seconds=2.5, on_disk=False, loaded=2, failed=[])
    with caplog.at_level("WARNING", logger=module.__name__):
        module.note_first_use("TinyModel on cuda:7", 3.4, [checks, ahead, None])
        module.note_first_use("TinyModel on cuda:7", 5.0, [checks, ahead, None])
        on_disk = SimpleNamespace(compiled=[], workers=15, seconds=0.2, on_disk=True, loaded=28, failed=[])
        module.note_first_use("OtherModel on cuda:7", 1.4, [None, on_disk, None])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "TinyModel on cuda:7 took 3.4 s" in lines[0] and "4 kernel variants compiled on up to 15 workers in 2.5 s" \
        in lines[0] and "(2.0 s of compiling)" in lines[0]
    assert "OtherModel on cuda:7 took 1.4 s" in lines[1] and "28 kernel variants loaded from the disk cache" in lines[1]


def test_a_first_use_names_the_build_steps_that_took_long(caplog, monkeypatch):
    """A quantized model's first call spent 75 s of 93 in its parity check, and the line named only the
    kernels: the build's steps that took a fifth of the time or more are named with their seconds."""
    from types import SimpleNamespace

    from hf_async_cb.kernels import precompile as module

    monkeypatch.setattr(module, "_NOTED", set())
    ahead = SimpleNamespace(compiled=[SimpleNamespace(seconds=0.5)], workers=15, seconds=3.1, on_disk=False,
                            loaded=1, failed=[])
    with caplog.at_level("WARNING", logger=module.__name__):
        module.note_first_use("QuantoModel on cuda:0", 93.3, [None, ahead, None],
                              {"the parity check": 74.7, "measuring the decode GEMMs": 0.3})
        module.note_first_use("PlainModel on cuda:0", 4.0, [None, ahead, None], {"the parity check": 0.3})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "; the parity check 74.7 s)" in lines[0] and "measuring" not in lines[0]
    assert "parity" not in lines[1]


def test_an_engine_build_times_its_parity_check():
    """What note_first_use is handed: the engine's build records its parity check's seconds."""
    import hf_async_cb

    engine = hf_async_cb.Engine(tiny_model("llama"))
    try:
        assert set(engine._build_parts) >= {"the parity check"}
        assert engine._build_parts["the parity check"] > 0
    finally:
        engine.close()


@pytest.mark.parametrize("family, dtype", [("llama", torch.float32), ("qwen3", torch.bfloat16), ("phi3", torch.float32)])
def test_the_checks_variants_cover_the_element_wise_checks(family, dtype, launches):
    """What the preparation compiles ahead for fuse_elementwise's checks (model/elementwise_fusion.
    check_variants) covers every launch the checks make, so that they compile nothing themselves."""
    from hf_async_cb.kernels.variant import variant_key
    from hf_async_cb.model.elementwise_fusion import check_variants, fuse_elementwise
    from hf_async_cb.model.fusion import fuse_projections

    model = copy.deepcopy(tiny_model(family)).to(dtype)
    listed = {variant_key(v) for v in check_variants(model)}
    with fuse_projections(model), fuse_elementwise(model) as fused:
        assert fused.rms_norms and fused.silu_muls + fused.gelu_muls
    ran = _keys(launches)
    missing = {key: name for key, name in ran.items() if key not in listed}
    assert ran and not missing, f"{len(missing)} launched variants not listed: {sorted(set(missing.values()))}"


def test_a_failing_listing_leaves_the_checks_to_compile_as_they_run(monkeypatch):
    """Listing the checks' kernels is an optimisation: if it fails, the preparation goes on."""
    from hf_async_cb.model import elementwise_fusion, prepared

    def fails(model):
        raise AttributeError("a norm of an unexpected shape")

    monkeypatch.setattr(elementwise_fusion, "check_variants", fails)
    assert prepared._compile_check_kernels(tiny_model("llama"), torch.device("cuda")) is None


def test_loading_a_variant_onto_the_device_ahead_is_done_once_and_never_raises():
    """The precompile loads each variant onto the device (Triton's CompiledKernel._init_handles) so that
    its first launch, perhaps inside a graph capture, does not; a Triton without that step, or a variant
    that cannot load (too much shared memory), is left to its launch, which raises there by name."""
    from hf_async_cb.kernels.precompile import _load_onto_device

    class Kernel:
        def __init__(self, fails=False):
            self.loads, self.fails = 0, fails

        def _init_handles(self):
            self.loads += 1
            if self.fails:
                raise RuntimeError("out of resources: shared memory")

    loaded, failing = Kernel(), Kernel(fails=True)
    assert _load_onto_device(loaded) and loaded.loads == 1
    assert not _load_onto_device(failing) and failing.loads == 1
    assert not _load_onto_device(object())  # (no such step in this Triton)
