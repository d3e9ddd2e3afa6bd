"""GPU benchmark suite: the bench workloads under pytest-benchmark, for comparing commits.

    python -m pytest benchmarks/test_gpu_throughput.py --benchmark-enable --benchmark-autosave
    python -m pytest benchmarks/test_gpu_throughput.py --benchmark-enable --benchmark-compare

Each round generates the whole workload with an engine that has already captured its graphs; the
extra_info of each result carries tokens/s. Skipped (with the reason shown) without CUDA; the
side-by-side tables against stock and HF's batching come from `python -m hf_async_cb bench`.
"""

import pytest
import torch

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.tools.bench import _prompts, build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WORKLOADS = {"llama3.2-1b x 64": ("llama3.2-1b", 64, 128, 64), "llama3-8b x 32": ("llama3-8b", 32, 128, 64)}


@pytest.fixture(scope="module", params=list(WORKLOADS))
def workload(request):
    shape, requests, prompt, new = WORKLOADS[request.param]
    model = build_model(shape, torch.device("cuda"), torch.bfloat16)
    yield model, _prompts(requests, prompt, model.config.vocab_size), new
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_generate_throughput(benchmark, workload, mode):
    model, prompts, new = workload
    with Engine(model, BatchingConfig(mode=mode, max_running_requests=len(prompts), max_batch_tokens=2048)) as engine:
        engine.generate(prompts, max_new_tokens=new)  # warm-up: graph captures, kernel compiles

        def run():
            engine.clear_prefix_cache()  # each round a workload not seen before (its own sharing only)
            outs = engine.generate(prompts, max_new_tokens=new)
            torch.cuda.synchronize()
            return outs

        outs = benchmark(run)
    tokens = sum(len(o.output_token_ids) for o in outs)
    assert tokens == len(prompts) * new
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.mean


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_generate_throughput(benchmark, workload, mode):
    """The same workload through model.generate(batching=...): the runtime it keeps on the model
    makes a warm call cost what the held engine's does (compare with test_generate_throughput)."""
    import hf_async_cb

    model, prompts, new = workload
    ids = torch.tensor(prompts, device="cuda")
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, batching=mode, do_sample=False,
                   batching_config=BatchingConfig(max_running_requests=len(prompts), max_batch_tokens=2048),
                   eos_token_id=None, pad_token_id=0)
    model.generate(ids, **options)  # the first call builds the runtime (captures, compiles)

    def run():
        hf_async_cb.clear_prefix_cache(model)  # each round a workload not seen before (its own sharing only)
        out = model.generate(ids, **options)
        torch.cuda.synchronize()
        return out

    out = benchmark(run)
    hf_async_cb.release(model)
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    assert tokens == len(prompts) * new
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.mean
