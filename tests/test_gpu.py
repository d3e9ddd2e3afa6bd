"""CUDA-only checks of the pipeline: async == sync on the device (Triton and reference attention),
graph replays == eager steps, the default CUDA path == stock in fp32, one host wait per step, no
hidden syncs, no loop work on the default stream. Skipped (with the reason shown) where CUDA is absent."""

import copy
import json

import pytest
import torch
from models import left_pad, random_prompts, tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine import io_slots as slots_module

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_model(family, dtype=torch.bfloat16):
    return copy.deepcopy(tiny_model(family)).to("cuda", dtype)


CASES = {
    "plain": dict(page_size=16, max_batch_tokens=512),
    "chunked": dict(page_size=16, max_batch_tokens=24),
    "preempting": dict(page_size=4, num_pages=60, max_batch_tokens=64),
}


def run_engine(model, prompts, new, eos=(), **config):
    with Engine(model, BatchingConfig(**config)) as engine:
        outs = [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=new, eos_token_ids=eos)]
        assert engine.allocator.num_free == engine.allocator.num_pages
    return outs


@pytest.mark.parametrize("attention", ["triton", "reference"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_async_equals_sync_on_cuda(family, case, attention):
    """bf16 without EOS or preemption: sync and async run the very same steps, so every token must
    match. fp32 with EOS: async runs finished requests once more and frees pages a step later
    (other batches, so other GEMM shapes and bf16 roundings): fp32 keeps that from flipping a pick."""
    prompts = random_prompts(16, 1, 50, seed=3)
    runs = [(torch.float32, (2,))] + ([(torch.bfloat16, ())] if case != "preempting" else [])
    for dtype, eos in runs:
        model = cuda_model(family, dtype)
        sync, async_ = (run_engine(model, prompts, 24, eos, mode=mode, attention=attention, **CASES[case])
                        for mode in ("sync", "async"))
        assert async_ == sync, dtype


@pytest.mark.parametrize("attention", ["triton", "reference"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_graphs_give_the_eager_tokens(mode, attention):
    """fp32: a graph step pads the batch to its bucket, so its GEMMs have other shapes than the
    eager step's (bf16 would round them differently)."""
    model = cuda_model("llama", torch.float32)
    prompts = random_prompts(13, 1, 80, seed=8)
    results = []
    for graphs in (False, True):
        with Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, max_batch_tokens=64,
                                          attention=attention)) as engine:
            results.append([o.output_token_ids for o in engine.generate(prompts, max_new_tokens=40)])
            if graphs:
                assert engine.graphs.num_replays > 0 and not engine.graphs.failed
    assert results[0] == results[1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_cuda_fp32_matches_stock_generate(family):
    """The default CUDA path (Triton attention, fused projections, graphs) against stock in fp32."""
    model = cuda_model(family, torch.float32)
    prompts = random_prompts(8, 5, 40, seed=4)
    ids, mask = (t.cuda() for t in left_pad(prompts))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, batching="off")
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=16, batching=mode), expected)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_host_wait_per_step_and_no_hidden_sync(monkeypatch, family):
    """The loop's steps wait for the host once each and synchronize nowhere else. The check before a
    call's first step (Engine.check_caches: the weights' contents read back once, model/kv_fingerprint.py)
    is outside the loop, and is let through."""
    model = cuda_model(family)
    prompts = random_prompts(16, 8, 40, seed=5)
    engine = Engine(model, BatchingConfig(mode="async", max_batch_tokens=64))
    engine.generate(prompts, max_new_tokens=32)  # warm-up: allocations, kernels, graph captures
    _check_caches_outside_the_loop(monkeypatch, sync_debug=True)
    waits = []
    original = slots_module.Download.tolist
    monkeypatch.setattr(slots_module.Download, "tolist", lambda self: waits.append(1) or original(self))
    pipeline = engine.pipeline("async")
    steps_before = pipeline.num_steps
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the loop raises
    try:
        engine.generate(prompts, max_new_tokens=32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.close()
    assert len(waits) == pipeline.num_steps - steps_before


def _check_caches_outside_the_loop(monkeypatch, sync_debug: bool = False) -> None:
    """Engine.check_caches (once per call, before the first step) run on a side stream (its content
    pass's small kernels would be on the caller's stream) and, with `sync_debug`, with the sync
    debug mode off (it reads the weights' sums back once)."""
    check = Engine.check_caches
    side = torch.cuda.Stream()

    def outside(self):
        mode = torch.cuda.get_sync_debug_mode()
        if sync_debug:
            torch.cuda.set_sync_debug_mode(0)
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                check(self)
            torch.cuda.current_stream().wait_stream(side)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(Engine, "check_caches", outside)


def test_no_loop_kernel_on_the_default_stream(tmp_path, monkeypatch):
    model = cuda_model("llama")
    prompts = random_prompts(8, 8, 30, seed=6)
    from torch.profiler import ProfilerActivity, profile

    _check_caches_outside_the_loop(monkeypatch)

    with Engine(model, BatchingConfig(mode="async")) as engine:
        engine.generate(prompts, max_new_tokens=4)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, max_new_tokens=16)
            torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    streams = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            streams.setdefault(e["args"].get("stream"), set()).add(e["cat"])
    assert len(streams) >= 2, streams  # compute and copies on streams of their own
    assert 7 not in streams, f"work on the legacy default stream: {streams}"


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_triton_attention_gives_the_reference_tokens(family):
    """End to end in fp32 (different kernels round bf16 differently; the kernels' bf16 error is
    bounded in test_triton_attention.py)."""
    model = cuda_model(family, torch.float32)
    prompts = random_prompts(16, 1, 90, seed=9)
    triton, reference = (run_engine(model, prompts, 24, (2,), mode="async", attention=a, max_batch_tokens=48)
                         for a in ("triton", "reference"))
    assert triton == reference


def _ulps(a, b):
    """Largest difference in bf16 ulps (of b's magnitude) between two bf16 tensors."""
    ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return ((a.float() - b.float()).abs() / ulp).max().item()


def test_elementwise_kernels_round_like_torch_in_bf16():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_async_cb.model import elementwise_fusion as ew

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
    h = x.float()
    expected = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert _ulps(ew.rms_norm(x, w, 1e-5), expected) <= 1
    q = torch.randn(2, 11, 32, 128, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 11, 8, 128, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    cos = torch.randn(2, 11, 128, device="cuda", generator=g).to(torch.bfloat16)
    sin = torch.randn(2, 11, 128, device="cuda", generator=g).to(torch.bfloat16)
    for got, want in zip(ew.rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)
    y = torch.randn(37, 2 * 14336, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = y.chunk(2, dim=-1)
    assert _ulps(ew.silu_mul(y), torch.nn.functional.silu(gate) * up) <= 1
    gelu, expected = ew.silu_mul(y, gelu_tanh=True), torch.nn.functional.gelu(gate, approximate="tanh") * up
    body = expected.float().abs() > 1e-3  # (in the tail, 1 + tanh is a few ulps of 1: equal to 1e-5 there)
    assert _ulps(gelu[body], expected[body]) <= 2 and (gelu.float() - expected.float()).abs().max() < 1e-2
    r = torch.randn(37, 4096, device="cuda", generator=g).to(torch.bfloat16)
    total, normed = ew.add_rms_norm(x, r, w, 1e-5)  # bit for bit: torch's add, then the rms_norm kernel
    assert torch.equal(total, r + x) and torch.equal(normed, ew.rms_norm(r + x, w, 1e-5))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "phi3"])
def test_fused_model_logits_match_the_original_in_bf16(family):
    from hf_async_cb.model.elementwise_fusion import fuse_elementwise
    from hf_async_cb.model.fusion import fuse_projections

    model = cuda_model(family)
    ids = torch.randint(3, 256, (4, 33), device="cuda")
    with torch.no_grad():
        expected = model(ids).logits.float()
        with fuse_projections(model) as projections, fuse_elementwise(model) as elementwise:
            assert elementwise.rms_norms > 0
            assert (elementwise.add_norms > 0) == (family != "phi3")  # plain pre-norm layers only
            got = model(ids).logits.float()
            elementwise.restore()
            projections.restore()
        again = model(ids).logits.float()
    assert torch.equal(again, expected)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.parametrize("option", [
    dict(repetition_penalty=1.3),
    dict(min_new_tokens=6),
    dict(suppress_tokens=list(range(10, 60)), begin_suppress_tokens=list(range(60, 200))),
    dict(repetition_penalty=0.8, min_new_tokens=3, suppress_tokens=[7, 8, 9]),
    dict(no_repeat_ngram_size=3, bad_words_ids=[[5], [9, 10]], sequence_bias={(7,): -3.0, (11, 12): 2.0}),
])
def test_device_processors_match_stock_on_cuda(option):
    """The processors the engine runs on the device (history options, blocked tokens), on the
    default CUDA path (graphs with padded processor inputs, Triton, fusions) in fp32: stock's
    tokens in both modes."""
    model = cuda_model("llama", torch.float32)
    prompts = random_prompts(8, 5, 40, seed=12)
    ids, mask = (t.cuda() for t in left_pad(prompts))
    common = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=[2, 5], pad_token_id=0, **option)
    expected = model.generate(ids, batching="off", **common)
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(ids, batching=mode, **common), expected), mode


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_seeded_sampling_in_graphs_gives_the_eager_tokens_on_cuda(mode):
    """Sampled steps replay CUDA graphs (decode and prefill buckets): in fp32 (graph padding changes
    GEMM shapes, which bf16 rounds differently) the draws are the eager steps' draws."""
    from hf_async_cb import SamplingParams

    model = cuda_model("llama", torch.float32)
    prompts = random_prompts(12, 3, 60, seed=13)
    params = [SamplingParams(max_new_tokens=20, do_sample=True, top_k=k, top_p=p, temperature=t)
              for k, p, t in [(0, 1.0, 1.0), (8, 1.0, 0.7), (0, 0.85, 1.2)]] * 4
    runs = []
    for graphs in (False, True):
        with Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, seed=3, max_batch_tokens=96)) as engine:
            runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
            if graphs:
                assert engine.graphs.num_replays > 0 and not engine.graphs.failed
                assert any(key.sampled for key in engine.graphs._graphs)
    assert runs[0] == runs[1]


def test_generate_runtime_compiles_and_captures_nothing_after_warm_up():
    """generate(batching=...) over batch sizes 1..256 and contexts up to 500 tokens, twice (the prefix
    cache emptied before each call, so that both passes run the same steps): the
    second pass compiles no kernel variant, captures no graph and builds no engine, and every
    call of both passes gives the held engine's tokens (fp32: graph padding changes GEMM shapes)."""
    import hf_async_cb
    from hf_async_cb.generate import runtime
    from hf_async_cb.kernels import compiled_variants

    model = cuda_model("llama", torch.float32)
    sizes = [1, 2, 3, 5, 8, 13, 32, 64, 100, 256]
    lengths = [4, 60, 500]  # the tiny model's window is 512
    workloads = [(b, n, random_prompts(b, max(1, n // 2), n, seed=b * 1000 + n)) for b in sizes for n in lengths]
    workloads = workloads[::-1]  # the largest first: the pool then never grows (growing recaptures the graphs)
    engine = None
    for pass_ in range(2):
        if pass_ == 1:
            rt = runtime._RUNTIMES[model]
            before = (compiled_variants(), rt.engine.graphs.num_captured, rt.builds)
        for i, (b, n, prompts) in enumerate(workloads if pass_ == 0 else workloads[::-1]):
            ids, mask = left_pad(prompts)
            mode = ("sync", "async")[i % 2]
            hf_async_cb.clear_prefix_cache(model)  # the same shapes as the first pass (no cached prefill)
            out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=5, batching=mode,
                                 pad_token_id=0, eos_token_id=None)
            engine = runtime._RUNTIMES[model].engine
            if pass_ == 1 and b in (1, 13, 256):
                engine.clear_prefix_cache()
                held = engine.generate(prompts, max_new_tokens=5, eos_token_ids=())
                assert out[:, ids.shape[1]:].tolist() == [o.output_token_ids for o in held]
    rt = runtime._RUNTIMES[model]
    assert (compiled_variants(), rt.engine.graphs.num_captured, rt.builds) == before
    assert max(rt.engine.graphs.capture_seconds) < 5.0
    assert hf_async_cb.release(model) and runtime._RUNTIMES.get(model) is None


def test_a_pool_is_sized_from_memory_it_can_allocate_after_a_closed_engines_graphs():
    """Memory that torch's allocator caches in a dropped CUDA graph's private pool is not free for a
    new engine's KV pool until it is handed back: an engine sized from the default share of free
    memory builds, runs and gives the stock tokens after such a pool took a third of the card."""
    model = cuda_model("llama", torch.float32)
    prompts = random_prompts(3, 4, 12, seed=7)
    free, _ = torch.cuda.mem_get_info()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        held = torch.empty(int(free * 0.33) // 4, dtype=torch.float32, device="cuda")
    del held, graph  # its private pool stays cached, reserved but not usable for other tensors
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > free * 0.3
    with Engine(model, BatchingConfig()) as engine:
        pool_bytes = engine.num_pages * engine.config.page_size * engine.layout.bytes_per_token(engine.dtype)
        assert pool_bytes > free * 0.5
        outs = [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=6, eos_token_ids=())]
    stock = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    assert outs == stock
    torch.cuda.empty_cache()


def test_closing_an_engine_frees_its_pool_before_giving_the_weights_their_storage_back():
    """close() copies the fused weights back into storages of their own. It lets the KV pool go
    first and copies one fused group at a time, so closing never needs more memory than the engine
    held: an 8B engine beside a pool of 90% of the card ran out of memory in close() before."""
    model = cuda_model("llama")
    engine = Engine(model, BatchingConfig(num_pages=4096, page_size=16))
    engine.generate(random_prompts(4, 4, 12, seed=3), max_new_tokens=4, eos_token_ids=())
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.close()
    assert torch.cuda.max_memory_allocated() <= held
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
