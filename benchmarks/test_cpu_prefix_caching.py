"""What prefix caching costs the host when nothing hits, and what it saves when rows share prompts.

    python -m pytest benchmarks/test_cpu_prefix_caching.py --benchmark-enable

The GPU figures (group, few-shot, none; beside stock and transformers' continuous batching) come
from `python -m hf_async_cb.tools.shared_prefix` (docs/benchmarks.md). CI runs these once with
benchmarks disabled, so they cannot rot.
"""

import pytest
import torch
import transformers

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.prefix_cache import PrefixCache
from hf_async_cb.engine.requests import Request, SamplingParams
from hf_async_cb.engine.scheduler import Scheduler
from hf_async_cb.tools.shared_prefix import workload_prompts


def admit_all(prompts: list[list[int]], caching: bool, page_size: int = 16) -> Scheduler:
    """Admit and "compute" every prompt, step by step, as the loop's host side does."""
    pages = sum(-(-(len(p) + 1) // page_size) for p in prompts) + 8
    cache = PrefixCache(page_size) if caching else None
    scheduler = Scheduler(PageAllocator(pages), page_size, max_batch_tokens=8192, max_running_requests=len(prompts),
                          prefix_cache=cache)
    for p in prompts:
        scheduler.add(Request(p, SamplingParams(max_new_tokens=2)))
    while scheduler.waiting or any(r.num_computed < len(r.prompt_token_ids) for r in scheduler.running):
        for chunk in scheduler.schedule().chunks:
            chunk.request.num_computed += chunk.num_tokens
    return scheduler


@pytest.mark.parametrize("caching", [False, True], ids=["off", "on"])
def test_host_cost_of_admitting_256_distinct_512_token_prompts(benchmark, caching):
    """No prefix shared: the page keys are made and looked up for nothing (the cost of being on)."""
    prompts, _ = workload_prompts("none", vocab=32000)
    scheduler = benchmark(admit_all, prompts, caching)
    assert len(scheduler.running) == len(prompts)


@pytest.mark.parametrize("caching", [False, True], ids=["off", "on"])
def test_group_workload_end_to_end_on_a_tiny_model(benchmark, caching):
    """GRPO-like groups (each prompt repeated as consecutive rows) on a tiny random Llama: the tokens
    are the same with the cache on and off; with it on, only the groups' first rows prefill."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts, new = workload_prompts("group", vocab=256, scale=0.25)  # 8 prompts of 256 tokens x 2 rows
    engine = Engine(model, BatchingConfig(mode="async", prefix_caching=caching, max_batch_tokens=1024))

    def run():
        engine.clear_prefix_cache()  # every round from an empty cache: only in-call reuse counts
        return [o.output_token_ids for o in engine.generate(prompts, max_new_tokens=new // 4, eos_token_ids=())]

    outputs = benchmark(run)
    off = [o.output_token_ids for o in Engine(model, BatchingConfig(mode="sync", prefix_caching=False))
           .generate(prompts, max_new_tokens=new // 4, eos_token_ids=())]
    assert outputs == off
    if caching:
        assert engine.prefix_cache_stats()["hit_tokens"] > 0
