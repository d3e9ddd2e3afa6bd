"""The serving benchmark (tools/serving.py) on the CPU: the arrival process and the length
distributions it draws, its metrics against numpy on hand-made timestamps, and end-to-end runs on
the tiny shape whose requests each get exactly their tokens, timed one stamp per token, and the
tokens Engine.generate gives for the same prompts."""

import math

import numpy as np
import pytest
import torch

from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.tools import bench, serving


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: two contending OpenMP threads slow a tiny model's steps a lot
    yield bench.build_model("tiny", torch.device("cpu"), torch.float32)
    torch.set_num_threads(threads)


def test_poisson_arrivals_have_the_rate():
    rate, n = 50.0, 20000
    times = np.array(serving.arrival_times(n, rate, seed=3))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all() and len(times) == n
    assert abs(gaps.mean() - 1 / rate) < 0.03 / rate  # exponential gaps of mean 1/rate ...
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # ... whose standard deviation is their mean
    counts = np.bincount(times.astype(int))[:-1]  # arrivals per whole second
    assert abs(counts.mean() - rate) < 0.05 * rate and abs(counts.var() / counts.mean() - 1) < 0.25  # Poisson
    assert serving.arrival_times(100, rate, seed=3) == times[:100].tolist()  # seeded
    assert serving.arrival_times(100, rate, seed=4) != times[:100].tolist()


def test_all_at_once_has_zero_gaps():
    assert serving.arrival_times(5, math.inf) == [0.0] * 5
    workload = serving.make_workload(5, 256, math.inf, "fixed", 8, 4)
    assert workload.arrivals == [0.0] * 5 and workload.rate is None
    with pytest.raises(ValueError, match="rate must be > 0"):
        serving.arrival_times(5, 0.0)


def test_length_distributions_keep_their_bounds_and_seeds():
    assert serving.draw_lengths(3, "fixed", 10, 7) == ([10] * 3, [7] * 3)
    prompts, outputs = map(np.array, serving.draw_lengths(5000, "uniform", 10, 7, seed=1))
    assert prompts.min() == 5 and prompts.max() == 15 and outputs.min() == 3 and outputs.max() == 10
    assert abs(prompts.mean() - 10) < 0.2 and abs(outputs.mean() - 6.5) < 0.2
    assert serving.draw_lengths(4, "uniform", 1, 1) == ([1] * 4, [1] * 4)  # never below one token
    prompts, outputs = map(np.array, serving.draw_lengths(20000, "sharegpt", 0, 0, seed=2))
    p, o = serving.SHAREGPT["prompt"], serving.SHAREGPT["output"]
    assert prompts.min() >= p["lo"] and prompts.max() <= p["hi"] and outputs.min() >= o["lo"] and outputs.max() <= o["hi"]
    assert abs(prompts.mean() - 161) < 8 and abs(outputs.mean() - 341) < 10  # the documented means
    assert abs(np.median(prompts) - p["median"]) < 6 and prompts.max() > 900  # a long tail, cut at 1024
    for kind in serving.LENGTHS:
        assert serving.draw_lengths(50, kind, 32, 16, seed=9) == serving.draw_lengths(50, kind, 32, 16, seed=9)
    assert serving.draw_lengths(50, "sharegpt", 0, 0, seed=9) != serving.draw_lengths(50, "sharegpt", 0, 0, seed=10)
    with pytest.raises(ValueError, match="unknown length distribution"):
        serving.draw_lengths(1, "zipf", 1, 1)


def test_a_workload_keeps_its_requests_whatever_the_rate():
    steady = serving.make_workload(20, 256, 4.0, "uniform", 16, 8, seed=5)
    burst = serving.make_workload(20, 256, math.inf, "uniform", 16, 8, seed=5)
    assert steady.prompts == burst.prompts and steady.new == burst.new and steady.arrivals != burst.arrivals
    assert all(3 <= t < 256 for p in steady.prompts for t in p)
    assert [len(p) for p in steady.prompts] == serving.draw_lengths(
        20, "uniform", 16, 8, np.random.SeedSequence(5).spawn(3)[1])[0]


def test_metrics_from_hand_made_timestamps():
    traces = [serving.Trace(4, 0.00, [0.10, 0.15, 0.25]),
              serving.Trace(6, 0.05, [0.30, 0.32]),
              serving.Trace(2, 0.20, [0.50])]
    m = serving.summarize(traces)
    assert m["duration_s"] == pytest.approx(0.5) and m["requests"] == 3 and m["failed"] == 0
    assert m["request_throughput"] == pytest.approx(6.0) and m["output_throughput"] == pytest.approx(12.0)
    assert m["total_token_throughput"] == pytest.approx(36.0)
    ttft, itl, e2e = [0.10, 0.25, 0.30], [0.05, 0.10, 0.02], [0.25, 0.27, 0.30]
    assert m["ttft_ms"]["p50"] == pytest.approx(250) and m["ttft_ms"]["mean"] == pytest.approx(650 / 3)
    assert m["itl_ms"]["p50"] == pytest.approx(50) and m["e2e_s"]["p50"] == pytest.approx(0.27)
    for key, values, scale in (("ttft_ms", ttft, 1e3), ("itl_ms", itl, 1e3), ("e2e_s", e2e, 1)):
        for q in (90, 99) if key != "e2e_s" else (99,):
            assert m[key][f"p{q}"] == pytest.approx(np.percentile(values, q) * scale)
    one_token = serving.summarize([serving.Trace(1, 0.0, [0.2])])
    assert one_token["itl_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    table = serving.format_table(dict(
        shape="tiny", requests=1, rate=16.0, lengths="fixed", length_description="fixed: prompt 1 x 1 new",
        mean_prompt=1.0, mean_new=1.0, warmup="short", dtype="torch.float32", gpu="cpu",
        results=[dict(one_token, path="sync", warmup_s=0.5, extra={})]))
    assert "arrival Poisson 16 req/s" in table and "| sync | 5.00 | 5 | 10 | 200.0 |" in table
    assert "| - | - | - |" in table and "none" not in table.lower() and "nan" not in table.lower()


def test_add_request_calls_on_token_for_every_token(tiny):
    with Engine(tiny, BatchingConfig(mode="async")) as engine:
        engine.start()
        seen = []
        handle = engine.add_request([5, 6, 7], max_new_tokens=6, on_token=lambda request, token: seen.append(token))
        assert handle.result(timeout=30).output_token_ids == seen == list(handle) and len(seen) == 6
        engine.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_request_gets_its_tokens_as_engine_generate_gives_them(tiny, mode):
    workload = serving.make_workload(6, tiny.config.vocab_size, 200.0, "uniform", 12, 6, seed=1)
    run = serving.run_path(mode, tiny, workload, warmup="short", timeout=60)
    with Engine(tiny, BatchingConfig(mode="sync")) as engine:  # the oracle, on the same prompts
        expected = engine.generate(workload.prompts, [SamplingParams(max_new_tokens=n) for n in workload.new])
    for trace, n, out in zip(run.traces, workload.new, expected):
        assert len(trace.token_times) == len(trace.output_token_ids) == n
        assert trace.output_token_ids == out.output_token_ids
        assert 0 <= trace.ttft <= trace.e2e and len(trace.itls) == n - 1 and min(trace.itls, default=0) >= 0
    row = run.row()
    assert row["requests"] == 6 and row["output_tokens"] == sum(workload.new) and row["warmup_s"] > 0


@pytest.mark.skipif(serving.hf_online_missing() is not None, reason=str(serving.hf_online_missing()))
def test_transformers_online_batching_is_timed_token_by_token(tiny):
    workload = serving.make_workload(3, tiny.config.vocab_size, math.inf, "uniform", 12, 6, seed=2)
    run = serving.run_path("hf-cb-sync", tiny, workload, warmup="short", timeout=60)
    for trace, n in zip(run.traces, workload.new):
        assert len(trace.token_times) == len(trace.output_token_ids) == n and 0 <= trace.ttft <= trace.e2e


def test_paths():
    serving.check_paths(["sync", "async-eager", "hf-cb-async"])
    with pytest.raises(ValueError, match="unknown serving path 'stock'"):
        serving.check_paths(["stock"])
    kept, notes = serving.runnable_paths(serving.PATHS, torch.device("cpu"))
    assert "hf-cb-async" not in kept and "sync" in kept and any("hf-cb-async" in note for note in notes)


def test_the_replay_warm_up_keeps_the_shapes_and_not_the_prompts():
    workload = serving.make_workload(6, 256, 30.0, "uniform", 12, 6, seed=1)
    warm = serving.fresh_prompts(workload, 256)
    assert [len(p) for p in warm.prompts] == [len(p) for p in workload.prompts]
    assert warm.arrivals == workload.arrivals and warm.new == workload.new
    assert all(a != b for a, b in zip(warm.prompts, workload.prompts))  # nothing for a prefix cache to serve


def test_the_decode_grid_meets_every_decode_bucket_the_run_can_meet(tiny):
    """Counted on the graph keys the steps compute (the CPU computes them too): every (batch, context)
    decode bucket a run of the workload can meet is met by the grid, also when its prompts take
    several steps to prefill (a small step budget)."""
    workload = serving.make_workload(12, tiny.config.vocab_size, 50.0, "uniform", 40, 30, seed=3)
    batches, contexts = serving.decode_buckets(workload, max_running=12)
    assert batches == [1, 2, 4, 8, 16] and contexts == [64, 128]
    assert serving.decode_buckets(workload, max_running=5)[0] == [1, 2, 4, 8]
    engine = Engine(tiny, BatchingConfig(mode="sync", cuda_graphs=True, max_running_requests=12, max_batch_tokens=48))
    met, key_for = set(), engine.graphs.key_for

    def record(plan):
        key = key_for(plan)
        met.add(key)
        return key

    engine.graphs.key_for = record
    for group in serving.decode_grid(workload, 12, 48, tiny.config.vocab_size):
        engine.generate(group.prompts, [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in group.new])
    decode = {(k.batch, k.context) for k in met if k is not None and k.tokens == 0}
    assert {(b, c) for b in batches for c in contexts} <= decode
    assert all(c in contexts for _, c in decode)  # no bucket the run cannot meet


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_replay_warmed_run_captures_no_graph(tiny, mode):
    """After the replay warm-up (with the decode grid, and no new prefill bucket), the timed run
    captures nothing, however its arrivals interleave; the report counts its steps, eager ones and
    the steps from each submission to its first token."""
    workload = serving.make_workload(16, tiny.config.vocab_size, 400.0, "uniform", 24, 12, seed=4)
    config = BatchingConfig(cuda_graphs=True, max_running_requests=16, max_batch_tokens=96)
    run = serving.run_path(mode, tiny, workload, config, timeout=120)
    assert run.extra["graphs_captured_in_run"] == 0 and run.note is None
    assert run.extra["steps_in_run"] > 0 and 0 <= run.extra["eager_steps_in_run"] <= run.extra["steps_in_run"]
    assert run.extra["first_token_steps"]["p50"] >= 1
    assert [len(t.output_token_ids) for t in run.traces] == workload.new
    # Each TTFT split where the step of its first token was built: after the submission, before the token.
    assert all(t.arrival <= t.first_build <= t.token_times[0] for t in run.traces)
    split = run.extra["ttft_split_ms"]
    assert 0 <= split["to_build"]["p50"] and 0 < split["after_build"]["p50"]


def test_a_run_names_the_buckets_its_eager_prefill_steps_missed(tiny, monkeypatch):
    """With no prefill bucket captured before the timed run (a warm-up that captured none), every
    prefill step runs eagerly for want of one: the report names each such step's own bucket, and
    their counts add up to the prefill_cap steps."""
    from hf_async_cb.tools.serving_engine import OurServer

    def freeze_only(self, workload, timeout=None, deadline=None):
        self.engine.graphs.max_prefill_graphs = 0
        return True

    monkeypatch.setattr(OurServer, "warm_up", freeze_only)
    workload = serving.make_workload(6, tiny.config.vocab_size, 400.0, "uniform", 24, 4, seed=5)
    config = BatchingConfig(cuda_graphs=True, max_running_requests=6, max_batch_tokens=96)
    run = serving.run_path("sync", tiny, workload, config, timeout=120)
    missed = run.extra["missed_buckets"]
    assert sum(missed.values()) == run.extra["eager_prefill_cap"] > 0
    assert all(len(k.split()[0].split("x")) == 3 for k in missed) and run.extra["captured_prefill_buckets"] == []


@pytest.mark.skipif(serving.hf_online_missing() is not None, reason=str(serving.hf_online_missing()))
def test_a_peer_past_its_time_limit_or_failing_still_gets_its_row(monkeypatch):
    """transformers' manager out of time (a limit of 0 s) gets a row with a note, and so does one
    that fails; the other paths' rows are there, and the table prints."""
    monkeypatch.setattr(serving, "PEER_LIMIT_S", 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = serving.run("tiny", 4, 100.0, "uniform", 8, 4, paths=("hf-cb-sync", "sync"), device="cpu",
                             warmup="short")
        rows = {r["path"]: r for r in report["results"]}
        assert "did not finish within the 0 s limit" in rows["hf-cb-sync"]["note"]
        assert rows["hf-cb-sync"]["requests"] == 0 and rows["sync"]["requests"] == 4 and rows["sync"]["note"] is None
        table = serving.format_table(report)
        assert "| hf-cb-sync | - |" in table and "none" not in table.lower() and "nan" not in table.lower()

        def fail(*args, **kwargs):
            raise RuntimeError("no manager today")

        monkeypatch.setattr(serving, "HFServer", fail)
        report = serving.run("tiny", 2, 100.0, "uniform", 8, 4, paths=("hf-cb-sync",), device="cpu", warmup="short")
        assert report["results"][0]["note"] == "failed: RuntimeError: no manager today"
    finally:
        torch.set_num_threads(threads)


def test_a_shared_system_prompt_starts_every_prompt_and_the_warm_up_shares_another():
    workload = serving.make_workload(6, 256, 4.0, "uniform", 16, 8, seed=3, system_prompt=40)
    shared = workload.prompts[0][:40]
    assert all(p[:40] == shared and len(p) > 40 for p in workload.prompts)
    assert [len(p) - 40 for p in workload.prompts] == [
        len(p) for p in serving.make_workload(6, 256, 4.0, "uniform", 16, 8, seed=3).prompts]
    warm = serving.fresh_prompts(workload, 256)
    assert [len(p) for p in warm.prompts] == [len(p) for p in workload.prompts]
    assert all(p[:40] == warm.prompts[0][:40] for p in warm.prompts) and warm.prompts[0][:40] != shared


def test_the_arrival_rates_benchmark_runs_on_the_cpu_and_explains_its_eager_steps(tmp_path):
    """benchmarks/serving_rates.py on the tiny shape (the graphs' eager stand-in): a row per loop, every
    request done, and the eager-steps column the run's count with its reasons (DecodeGraphs.eager)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import serving_rates

    out = tmp_path / "rates.json"
    assert serving_rates.main(["--shape", "tiny", "--device", "cpu", "--rates", "50", "--min-requests", "6",
                               "--seconds", "0.1", "--lengths", "fixed", "--prompt", "8", "--new", "4",
                               "--peer-rate", "0", "--cuda-graphs", "--json", str(out)]) == 0
    results = [r for report in json.loads(out.read_text())["reports"] for r in report["results"]]
    assert [r["path"] for r in results] == ["sync", "async"]
    for r in results:
        assert r["failed"] == 0 and r["note"] is None
        assert "lent_larger" in r["extra"] and r["extra"]["eager_steps_in_run"] >= 0
    assert serving_rates._eager({"eager_steps_in_run": 45, "eager_prefill_cap": 30, "eager_too_large": 15,
                                 "eager_row_options": 0}) == "45 (prefill_cap 30, too_large 15)"
    assert serving_rates._eager({"eager_steps_in_run": 3}) == "3" and serving_rates._eager({}) == "-"
