"""CPU-side cost of one step, which the async loop must hide behind the GPU's step.

    python -m pytest benchmarks --benchmark-enable                     # measure
    python -m pytest benchmarks --benchmark-enable --benchmark-autosave
    python -m pytest benchmarks --benchmark-enable --benchmark-compare  # against the last saved run

CI runs them once with benchmarks disabled (pyproject addopts), so they cannot rot.
"""

import pytest
import torch

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.devices import Streams
from hf_async_cb.engine.batch import BatchBuilder
from hf_async_cb.engine.cuda_graphs import DecodeGraphs
from hf_async_cb.engine.io_slots import IOSlot
from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.requests import Request, SamplingParams
from hf_async_cb.engine.scheduler import Scheduler


def decoding_scheduler(running: int, context: int = 512, page_size: int = 16) -> Scheduler:
    """`running` requests in steady decode, each `context` tokens deep."""
    pages_each = -(-(context + 64) // page_size)
    scheduler = Scheduler(PageAllocator(running * pages_each + 8), page_size, max_batch_tokens=running,
                          max_running_requests=running)
    for i in range(running):
        req = Request(list(range(3, 3 + context)), SamplingParams(max_new_tokens=64))
        scheduler.add(req)
    def prefilling():
        return scheduler.waiting or any(r.num_computed < len(r.prompt_token_ids) for r in scheduler.running)

    while prefilling():  # admit and "compute" the prompts, to their last token
        for chunk in scheduler.schedule().chunks:
            if chunk.request.num_computed < len(chunk.request.prompt_token_ids):
                chunk.request.num_computed += chunk.num_tokens
            else:  # a finished prompt's decode chunk: its token is "sampled" below
                chunk.request.num_computed = chunk.start
    for req in scheduler.running:
        req.output_token_ids.append(5)
    return scheduler


@pytest.mark.parametrize("running", [32, 256, 1024])
def test_schedule_and_build_one_decode_step(benchmark, running):
    scheduler = decoding_scheduler(running)
    builder = BatchBuilder(page_size=16, trash_slot=0, page_table=scheduler.page_table)
    slot = IOSlot(Streams(torch.device("cpu")))

    graphs = DecodeGraphs(None, running, is_cuda=False, prefill=True)  # only its bucket choice runs

    def step():  # what the loop does on the host: schedule, pick the graph bucket, build the padded step
        plan = scheduler.schedule()
        key = graphs.key_for(plan)
        inputs = builder.build(plan, slot, {}, (key.batch, key.context, key.tokens))
        for chunk in plan.chunks:  # undo, so that every round measures the same step
            chunk.request.num_computed = chunk.start
        return inputs

    plan = scheduler.schedule()
    assert len(plan.chunks) == running and all(c.num_tokens == 1 for c in plan.chunks), "not a pure decode step"
    for chunk in plan.chunks:
        chunk.request.num_computed = chunk.start
    inputs = benchmark(step)
    assert inputs.input_ids.shape[1] >= running


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tiny_model_end_to_end(benchmark, mode):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    engine = Engine(model, BatchingConfig(mode=mode))
    prompts = [[3 + (i * 7 + j) % 250 for j in range(16)] for i in range(32)]
    outputs = benchmark(lambda: engine.generate(prompts, max_new_tokens=16))
    assert all(len(o.output_token_ids) == 16 for o in outputs)


def test_mixed_prefill_and_decode_steps(benchmark):
    """Long prompts admitted beside decoding requests: steps mixing one-token rows with prefill
    chunks, where the reference attention's padding once cost 8-30x the needed work (CPU path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=2048)).eval()
    engine = Engine(model, BatchingConfig(mode="sync", max_batch_tokens=512))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(300, 900, (16,), generator=g)]
    outputs = benchmark(lambda: engine.generate(prompts, max_new_tokens=8))
    assert all(len(o.output_token_ids) == 8 for o in outputs)


def test_online_backlog(benchmark):
    """10,000 tiny requests queued on the background loop at once: the loop's per-step work must not
    grow with the backlog (each pass once scanned every queued handle for aborts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    engine = Engine(model, BatchingConfig(mode="async", max_running_requests=64))

    def run():
        engine.start()
        try:
            handles = [engine.add_request([3 + i % 200, 5, 7], max_new_tokens=2, eos_token_ids=()) for i in range(10000)]
            return [h.result(timeout=600) for h in handles]
        finally:
            engine.shutdown(timeout=600)

    outputs = benchmark.pedantic(run, rounds=1, iterations=1)
    assert len(outputs) == 10000 and all(len(o.output_token_ids) == 2 for o in outputs)


@pytest.mark.parametrize("shared", [False, True])
def test_find_shared_prefix_groups_of_a_256_row_decode_step(benchmark, shared):
    """The host's part of reading shared prefixes once (engine/shared_prefix_groups.py): 256 rows over
    1,088 tokens in pages of 16, in groups of 8 sharing their first 64 pages, or sharing none (the
    one-column check that returns at once)."""
    import numpy as np

    from hf_async_cb.engine.shared_prefix_groups import shared_prefix_groups

    rng = np.random.default_rng(0)
    pages = rng.permutation(256 * 68)
    if shared:
        prefixes = pages[:32 * 64].reshape(32, 64)
        own = pages[32 * 64:32 * 64 + 256 * 4].reshape(256, 4)
        table = np.concatenate([np.repeat(prefixes, 8, axis=0), own], axis=1)
    else:
        table = pages.reshape(256, 68)
    lens = np.full(256, 1024 + 60)
    groups = benchmark(shared_prefix_groups, table, lens, 256, 16)
    assert (groups is not None) == shared
    if shared:
        assert groups.group_start[:33].tolist() == list(range(0, 257, 8)) and set(groups.shared_len.tolist()) == {1024}
        assert groups.keys_saved == 32 * 7 * 1024
