"""CUDA-only checks of the pipeline: async == sync on the device (Triton and reference attention),
graph replays == eager steps, the default CUDA path == stock in fp32, one host wait per step, no
hidden syncs, no loop work on the default stream. Skipped (with the reason shown) where CUDA is absent."""

import copy
import json

import pytest
import torch

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb import slots as slots_module
from models import random_prompts, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_model(family, dtype=torch.bfloat16):
    return copy.deepcopy(tiny_model(family)).to("cuda", dtype)


CASES = {
    "plain": dict(page_size=16, max_batch_tokens=512),
    "chunked": dict(page_size=16, max_batch_tokens=24),
    "preempting": dict(page_size=4, num_pages=60, max_batch_tokens=64),
}


@pytest.mark.parametrize("attention", ["triton", "reference"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_async_equals_sync_on_cuda(family, case, attention):
    model = cuda_model(family)
    prompts = random_prompts(16, 1, 50, seed=3)
    results = {}
    for mode in ("sync", "async"):
        engine = Engine(model, BatchingConfig(mode=mode, attention=attention, **CASES[case]))
        results[mode] = [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=24, eos_token_ids=(2,))]
        assert engine.allocator.num_free == engine.allocator.num_pages
    assert results["async"] == results["sync"]


@pytest.mark.parametrize("attention", ["triton", "reference"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_graphs_give_the_eager_tokens(mode, attention):
    model = cuda_model("llama")
    prompts = random_prompts(13, 1, 80, seed=8)
    results = []
    for graphs in (False, True):
        engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, max_batch_tokens=64,
                                              attention=attention))
        results.append([o.output_token_ids for o in engine.generate(prompts, max_new_tokens=40)])
        if graphs:
            assert engine.graphs.num_replays > 0
    assert results[0] == results[1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_cuda_fp32_matches_stock_generate(family):
    """The default CUDA path (Triton attention, fused projections, graphs) against stock in fp32."""
    model = cuda_model(family, torch.float32)
    prompts = random_prompts(8, 5, 40, seed=4)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, batching="off")
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=16, batching=mode), expected)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_host_wait_per_step_and_no_hidden_sync(monkeypatch, family):
    model = cuda_model(family)
    prompts = random_prompts(16, 8, 40, seed=5)
    engine = Engine(model, BatchingConfig(mode="async", max_batch_tokens=64))
    engine.generate(prompts, max_new_tokens=32)  # warm-up: allocations, kernels, graph captures
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
    assert len(waits) == pipeline.num_steps - steps_before


def test_no_loop_kernel_on_the_default_stream(tmp_path):
    model = cuda_model("llama")
    engine = Engine(model, BatchingConfig(mode="async"))
    prompts = random_prompts(8, 8, 30, seed=6)
    engine.generate(prompts, max_new_tokens=4)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

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
def test_triton_attention_gives_the_reference_tokens_in_bf16(family):
    model = cuda_model(family)
    prompts = random_prompts(16, 1, 90, seed=9)
    results = {}
    for attention in ("triton", "reference"):
        engine = Engine(model, BatchingConfig(mode="async", attention=attention, max_batch_tokens=48))
        results[attention] = [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=24)]
        engine.close()
    assert results["triton"] == results["reference"]
