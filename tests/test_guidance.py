"""Classifier-free guidance (`generate(guidance_scale=..., negative_prompt_ids=...)`) against stock
generate: each row runs stock's guidance processor on its own, which runs the model on the row's
unconditional context with a cache of its own (the callbacks' stock model,
model/callback_forwards.py), its negative prompt that row's (generate/row_processors.py)."""

from __future__ import annotations

import pytest
import torch
from models import left_pad, random_prompts, tiny_model

from hf_async_cb import BatchingConfig

MODES = ["sync", "async"]
PROMPTS = random_prompts(4, 3, 10, seed=5)
NEGATIVE = random_prompts(4, 2, 6, seed=6)


def generate(model, mode=None, **kwargs):
    ids, mask = left_pad(PROMPTS)
    if mode is not None:
        kwargs["batching"] = mode
    return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["last_token", "negative_prompt", "positive_prompt"])
def test_guided_rows_give_stock_tokens(case, mode):
    model = tiny_model("llama")
    options = {"guidance_scale": 1.5}
    if case != "last_token":  # (left-padded, with their mask)
        ids, mask = left_pad(NEGATIVE)
        options = {"guidance_scale": 2.0 if case == "negative_prompt" else 0.0,
                   "negative_prompt_ids": ids, "negative_prompt_attention_mask": mask}
    expected = generate(model, **options)
    assert not torch.equal(expected, generate(model))  # (the guidance changes the tokens)
    assert torch.equal(generate(model, mode, batching_config=BatchingConfig(fuse_projections=True), **options),
                       expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_negative_prompt_of_another_batch_size_is_refused_before_any_work(mode):
    model = tiny_model("llama")
    ids, mask = left_pad(NEGATIVE[:2])
    with pytest.raises(ValueError, match="a row per prompt"):
        generate(model, mode, guidance_scale=2.0, negative_prompt_ids=ids)
    with pytest.raises(ValueError, match="without negative_prompt_ids"):
        generate(model, mode, guidance_scale=2.0, negative_prompt_attention_mask=mask)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("negative", [False, True])
def test_a_guidance_processor_of_the_callers_gives_stock_tokens(negative, mode):
    """Stock's UnbatchedClassifierFreeGuidanceLogitsProcessor built for the whole batch and passed in
    `logits_processor`: made anew per row with that row's unconditional context."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    model = tiny_model("llama")
    ids, mask = left_pad(NEGATIVE) if negative else (None, None)

    def guided():
        return LogitsProcessorList([UnbatchedClassifierFreeGuidanceLogitsProcessor(2.0, model, ids, mask)])

    expected = generate(model, logits_processor=guided())
    assert not torch.equal(expected, generate(model))
    assert torch.equal(generate(model, mode, logits_processor=guided()), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", ["roomy", "tight"])
def test_the_rows_unconditional_forwards_run_together_and_rows_that_miss_steps_catch_up(config, mode, monkeypatch):
    """Ten guided rows: with room, one unconditional forward per step for all of them (stock runs one
    per step too; per row it would be ten); in a small pool with a small step budget (rows started
    apart, one preempted after some tokens and resumed: its context recomputed), stock's tokens."""
    from hf_async_cb.generate import guidance

    forwards, restarts = [], []
    run, start = guidance.GuidedRows._forward, guidance.GuidedRows._start
    monkeypatch.setattr(guidance.GuidedRows, "_forward", lambda self, *a: forwards.append(a[0].shape[0]) or run(self, *a))
    monkeypatch.setattr(guidance.GuidedRows, "_start",
                        lambda self, entries: restarts.extend(r.calls for r, _ in entries if r.calls) or start(self, entries))
    model = tiny_model("llama")
    prompts = random_prompts(10, 3, 12, seed=9)
    ids, mask = left_pad(prompts)
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, guidance_scale=1.5)
    expected = model.generate(ids, **options)
    tight = config == "tight"
    batching = BatchingConfig(page_size=4, num_pages=8, max_batch_tokens=8, max_running_requests=3,
                              prefix_caching=False) if tight else None
    forwards.clear()
    assert torch.equal(model.generate(ids, batching=mode, batching_config=batching, **options), expected)
    if tight:
        assert restarts, "no row was preempted after its first tokens: the test needs a smaller pool"
    else:
        assert len(forwards) <= 8 + 2 and max(forwards) == len(prompts), forwards


def test_the_guidance_benchmark_runs_on_the_cpu():
    """benchmarks/guidance_bench.py on the tiny shape: every path's rows equal stock's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import guidance_bench

    report = guidance_bench.main(["--device", "cpu", "--shape", "tiny", "--rows", "6", "--prompt", "12", "--new", "5",
                                  "--repeat", "1"])
    assert [report[path]["rows_equal_stock"] for path in ("stock", "sync", "async")] == [6, 6, 6]
