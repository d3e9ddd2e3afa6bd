"""The bench command on the CPU (tiny shape): every path generates the whole workload, greedy and
sampled, and ablation suffixes parse into BatchingConfig changes."""

import pytest

from hf_async_cb.tools import bench


@pytest.mark.parametrize("sample", [False, True])
def test_every_path_generates_the_whole_workload(sample):
    report = bench.run("tiny", 4, 8, 6, paths=("stock", "sync", "async-eager"), device="cpu", sample=sample)
    assert [r["path"] for r in report["results"]] == ["stock", "sync", "async-eager"]
    assert all(r["tokens"] == 4 * 6 for r in report["results"])
    assert report["sample"] is sample
    table = bench.format_table(report)
    assert table.count("\n| ") == 4 and ("sampled" in table) is sample  # the header and a row per path


def test_ablation_suffixes():
    assert bench.our_path("async-noprefill-eager") == ("async", {"prefill_graphs": False, "cuda_graphs": False})
    assert bench.our_path("sync-ref") == ("sync", {"attention": "reference"})
    assert bench.our_path("stock") is None and bench.our_path("async-bogus") is None
    with pytest.raises(ValueError, match="unknown path"):
        bench.check_paths(["async-bogus"])


def test_progress_bars_say_which_path_and_phase(monkeypatch):
    """Our paths' bars read "sync warm-up", "sync timed"...: several bars in one run say which is which."""
    from hf_async_cb import BatchingConfig
    from hf_async_cb.engine.progress import Progress

    labels = []
    init = Progress.__init__

    def recording(self, requests, enabled):
        init(self, requests, enabled)
        if self.bar is not None:
            labels.append(self.bar.desc)

    monkeypatch.setattr(Progress, "__init__", recording)
    bench.run("tiny", 2, 4, 2, paths=("sync", "generate-async"), device="cpu", config=BatchingConfig(progress=True))
    assert labels == ["sync warm-up (first call)", "sync warm-up", "generate-async warm-up (first call)",
                      "generate-async warm-up", "sync first call", "sync timed", "generate-async first call",
                      "generate-async timed"]


def test_transformers_batching_runs_without_its_eos_warning():
    """hf-cb paths say "no EOS" as transformers' continuous batching asks (-1), so that it does not
    warn that eos_token_id is unset, and every request still runs to its last token."""
    import logging

    import torch

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    model = bench.build_model("tiny", torch.device("cpu"), torch.float32)
    prompts = bench._prompts(2, 6, model.config.vocab_size)
    records = Records()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")  # transformers' (it does not propagate)
    cb_logger.addHandler(records)
    try:
        result = bench.run_path("hf-cb-sync", model, prompts, 3)
    finally:
        cb_logger.removeHandler(records)
    assert result.tokens == 2 * 3
    assert not [m for m in records.messages if "eos_token_id" in m], records.messages


def test_a_timed_call_on_unseen_prompts_hits_nothing_an_earlier_call_cached():
    """tools/timing.timed(..., unseen=...) empties the prefix cache of a model's generate runtime, or
    of an Engine, before the clock starts: the second run of the same prompts prefills them all."""
    import torch

    import hf_async_cb
    from hf_async_cb import BatchingConfig, Engine
    from hf_async_cb.tools.timing import timed

    cpu = torch.device("cpu")
    model = bench.build_model("tiny", cpu, torch.float32)
    prompts = bench._prompts(2, 40, model.config.vocab_size)
    ids = torch.tensor(prompts)

    def generate():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, batching="sync",
                              do_sample=False, eos_token_id=None, pad_token_id=0)

    generate()
    hits = hf_async_cb.prefix_cache_stats(model)["hit_tokens"]
    seconds, out = timed(generate, cpu, unseen=model)
    assert seconds > 0 and out.shape == (2, 42)
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] == hits
    generate()  # without emptying it, the same prompts hit
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] > hits
    hf_async_cb.release(model)

    with Engine(model, BatchingConfig(mode="sync")) as engine:
        engine.generate(prompts, max_new_tokens=2)
        hits = engine.prefix_cache_stats()["hit_tokens"]
        timed(lambda: engine.generate(prompts, max_new_tokens=2), cpu, unseen=engine)
        assert engine.prefix_cache_stats()["hit_tokens"] == hits
