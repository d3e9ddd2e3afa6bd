"""The command line on a CPU-only machine: the default bench runs (without the paths the CPU cannot
run, with no NaN), every option's default is in --help, the demo labels its runs and says when it
converts SmolLM2 once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from hf_async_cb import cli
from hf_async_cb.tools import bench, demo_model

ROOT = Path(__file__).resolve().parent.parent


def test_default_bench_runs_on_a_cpu_only_machine():
    """`python -m hf_async_cb bench` with no argument, as a user on a laptop would type it."""
    # One thread: on shared cores, two OpenMP threads contending make a tiny model's steps ~100x slower.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "hf_async_cb", "bench"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "skipped hf-cb-async: transformers' async batching needs a device in ('cuda', 'xpu'), not cpu" in out
    assert "--shape tiny, --requests 8, --prompt 32, --new 32" in out
    assert "nan" not in out.lower() and "not measured on cpu" in out and "% of floor" not in out
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and "path" not in line]
    assert rows == ["| stock", "| hf-cb-sync", "| sync", "| async", "| generate-async"]


def test_paths_the_device_cannot_run_are_dropped_with_a_note():
    kept, notes = bench.runnable_paths(bench.PATHS, torch.device("cpu"))
    assert kept == ("stock", "hf-cb-sync", "sync", "async", "generate-async") and len(notes) == 1 and "hf-cb-async" in notes[0]
    assert bench.runnable_paths(bench.PATHS, torch.device("cuda")) == (bench.PATHS, [])
    assert bench.default_workload(torch.device("cpu"))["shape"] == "tiny"
    assert bench.default_workload(torch.device("cuda"))["shape"] == "llama3.2-1b"


def _report(bandwidth: float | None, floor_ms: float | None) -> dict:
    result = dict(path="sync", seconds=2.0, tokens=64, steps=8, gpu_busy=None, decode_ms_per_step=None,
                  peak_memory_gib=None, extra={"warmup_s": 1.0}, tokens_per_s=32.0)
    return dict(shape="tiny", requests=4, prompt=8, new=16, sample=False, device="cpu", gpu="cpu",
                dtype="torch.float32", bandwidth_tb_s=bandwidth, floor_ms_per_step=floor_ms,
                floor_tokens_per_s=None if floor_ms is None else 4 / floor_ms * 1e3, results=[result])


def test_table_has_a_floor_only_where_one_was_measured():
    cpu = bench.format_table(_report(None, None))
    assert "nan" not in cpu.lower() and "not measured on cpu" in cpu and "floor |" not in cpu
    # Columns no row fills are left out; a first call faster than the timed one is noise: no extra, not -1.00.
    assert "GPU busy" not in cpu and "| sync | 32 | 2.00 | 8 | 1.00 | 0 |" in cpu
    gpu = bench.format_table(_report(4.0, 0.5))
    assert "copy bandwidth 4.00 TB/s; floor 0.50 ms/step = 8,000 tok/s" in gpu and "| 0.4% |" in gpu
    mixed = bench.format_table(_report(4.0, None))
    assert "no floor for the mixed workload" in mixed and "nan" not in mixed.lower()


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_help_shows_every_default(capsys):
    assert "later" not in _help(capsys) and "`bench`" in _help(capsys)
    text = _help(capsys, "bench")
    for expected in ("--page-size PAGE_SIZE KV-cache page size of our paths (default: 16)", "8192 on a GPU of 70 GiB",
                     "(default: llama3.2-1b on CUDA, tiny on the CPU)", "(default: 64 on CUDA, 8 on the CPU)",
                     "less the paths the device cannot run", "progress bars (default: True)"):
        assert expected in text
    for expected in ("Poisson arrivals of this many requests/s; inf: all at once (default: inf)",
                     "(default: sharegpt on CUDA, fixed on the CPU)", "a few short requests (default: replay)",
                     "prompt tokens (default: 0)", "less what the device or transformers cannot run"):
        assert expected in text
    assert "default: None" not in text
    text = _help(capsys, "profile")
    assert "(default: tiny)" in text and "(default: 16)" in text and "(default: timeline.png)" in text
    assert "(default: 64)" in _help(capsys, "demo")


def test_cuda_graphs_help_says_what_the_config_does(capsys):
    from hf_async_cb.config import BatchingConfig

    assert BatchingConfig().cuda_graphs is None  # None: on CUDA only (Engine), which the help must say
    text = _help(capsys, "bench")
    assert "Default: on when the device is CUDA, off elsewhere" in text and "prefill and mixed steps" in text


def test_demo_says_it_converts_once_then_labels_each_run(capsys, monkeypatch):
    class Stop(Exception):
        pass

    monkeypatch.setattr(demo_model, "needs_conversion", lambda: True)
    monkeypatch.setattr(demo_model, "load_smollm2", lambda **kw: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        cli.main(["demo", "--device", "cpu"])
    assert "First run: converting SmolLM2's GGUF file once to" in capsys.readouterr().out


@pytest.mark.skipif(not demo_model.is_available(), reason="SmolLM2 is not installed")
def test_demo_labels_each_run(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as above: shared cores
    try:
        assert cli.main(["demo", "--device", "cpu", "--max-new-tokens", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    out = captured.out
    for line in ("[1/3] stock generate: 8 prompts", '[2/3] batching="sync": 8 prompts', '[3/3] batching="async"'):
        assert line in out
    # Each path runs a first call (set-up) before its timed one, shown apart; the bars say which run they are.
    assert "first call s" in out and "a first call then the timed one" in out
    for label in ('batching="sync" first call', 'batching="sync" timed', 'batching="async" timed'):
        assert label in captured.err


def test_conversion_is_logged_at_info_with_an_honest_estimate(tmp_path, monkeypatch, caplog):
    """load_smollm2's first call, with transformers' loaders faked: one INFO line, no WARNING."""
    import transformers

    class Fake:
        config = types.SimpleNamespace(quantization_config=None)
        hf_quantizer = None
        padding_side = "right"

        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return cls()

        def save_pretrained(self, path: Path) -> None:
            Path(path).mkdir(parents=True, exist_ok=True)
            Path(path, "config.json").write_text("{}")

        def to(self, device):
            return self

        def eval(self):
            return self

    monkeypatch.setenv("HF_ASYNC_CB_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "gguf_path", lambda: tmp_path / demo_model.GGUF_NAME)
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Fake)
    monkeypatch.setattr(transformers, "AutoTokenizer", Fake)
    with caplog.at_level(logging.DEBUG, logger=demo_model.__name__):
        demo_model.load_smollm2()
    records = [r for r in caplog.records if r.name == demo_model.__name__]
    assert [r.levelno for r in records] == [logging.INFO] and "a few seconds" in records[0].getMessage()
    assert not demo_model.needs_conversion()


def test_roofline_column_where_a_roofline_was_measured():
    """The roofline (prefill at the measured matmul peak, decode steps at the floor) is the run's
    ideal time; each row shows ideal / its own time."""
    report = dict(_report(4.0, 0.5), roofline_s=1.0, peak_tflops=790.0)
    table = bench.format_table(report)
    assert "roofline 1.00 s (prefill at the measured 790 TFLOP/s" in table and "| 0.50 |" in table
    assert "roofline" not in bench.format_table(_report(4.0, 0.5))


def test_prefill_flops_counts_active_weights_and_causal_attention():
    model = bench.build_model("tiny", torch.device("cpu"), torch.float32)
    c = model.config
    body = sum(p.numel() for p in model.parameters()) - 2 * c.vocab_size * c.hidden_size  # untied embeddings
    attention = 2 * c.num_hidden_layers * c.hidden_size * 8 * 8
    assert bench.prefill_flops(model, 2, 8) == 2 * (2 * body * 8 + 2 * c.vocab_size * c.hidden_size + attention)
    moe = bench.build_model("tiny-moe", torch.device("cpu"), torch.float32)
    dense_equivalent = sum(p.numel() for n, p in moe.named_parameters() if ".experts." not in n)
    assert bench.prefill_flops(moe, 1, 4) < 2 * 4 * dense_equivalent + 2 * 4 * sum(
        p.numel() for n, p in moe.named_parameters() if ".experts." in n)


def test_bench_serve_prints_a_row_per_path(capsys, tmp_path):
    """`bench --serve`: the serving table on bench's workload options; its options are refused without it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as above: shared cores
    try:
        assert cli.main(["bench", "--serve", "--device", "cpu", "--shape", "tiny", "--requests", "3", "--prompt", "8",
                         "--new", "4", "--rate", "100", "--lengths", "uniform", "--compare", "sync,async,hf-cb-async",
                         "--warmup", "short", "--json", str(tmp_path / "serve.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "skipped hf-cb-async" in out and "arrival Poisson 100 req/s, lengths uniform: prompt 4..12 x 2..6 new" in out
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and "path" not in line]
    assert rows == ["| sync", "| async"] and "TTFT p99 ms" in out and "nan" not in out.lower()
    assert '"itl_ms"' in (tmp_path / "serve.json").read_text()
    for argv in (["--rate", "2"], ["--lengths", "fixed"], ["--serve", "--mixed"], ["--serve", "--compare", "stock"],
                 ["--serve", "--rate", "0"]):
        with pytest.raises(SystemExit):
            cli.main(["bench", "--device", "cpu", *argv])


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--new", "0"], ["--prompt", "-3"], ["--requests", "2.5"],
                                  ["--mixed-prefill-tokens", "0"], ["--seed", "-1"], ["--device", "foo"],
                                  ["--device", "tpu"], ["--json", "/nonexistent/folder/report.json"],
                                  ["--json", "/tmp"]])
def test_workload_sizes_below_one_are_usage_errors(argv, capsys):
    """Values that cannot run are refused by the parser (exit 2, the flag named), not by a traceback
    (nor, for --json, after the whole run)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", *argv])
    assert stop.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--prompt", "3000"], ["--serve", "--lengths", "uniform", "--prompt", "1400"],
                                  ["--serve", "--system-prompt", "2100", "--prompt", "4"],
                                  ["--serve", "--lengths", "sharegpt", "--system-prompt", "1100"]])
def test_prompts_past_the_shape_positions_are_refused_before_any_work(argv):
    """A prompt the shape's positions cannot hold (tiny: 2048; with --serve's uniform lengths, up to
    1.5x --prompt; ShareGPT-like ones up to 1,024; a shared system prompt before each) stops with the
    reason, not a traceback after the model is built."""
    with pytest.raises(SystemExit, match="longer than the tiny shape's 2048 positions"):
        cli.main(["bench", "--device", "cpu", "--shape", "tiny", "--requests", "1", "--new", "2", *argv])


def test_seconds_keep_three_digits_and_a_first_call_extra_is_never_negative():
    """A fast path's time is not rounded to 0.0; the set-up a first call adds is clamped at 0."""
    assert [bench.format_seconds(x) for x in (0.004123, 0.04123, 4.123, 41.23, 412.3, 0.0)] == \
        ["0.00412", "0.0412", "4.12", "41.2", "412", "0"]
    report = _report(None, None)
    report["results"] = [dict(report["results"][0], path="stock", seconds=0.0123, extra={}),
                         dict(report["results"][0], path="sync", seconds=2.0, extra={"warmup_s": 3.5})]
    table = bench.format_table(report)
    assert "| stock | 32 | 0.0123 | 8 | - | - |" in table and "| sync | 32 | 2.00 | 8 | 3.50 | 1.50 |" in table


def test_compare_help_shows_the_default_a_run_uses_and_names_every_path(capsys, monkeypatch):
    """--compare's default in --help is what a run without it runs (generate-async included), the
    help names the generate-sync / generate-async paths, and an unknown path's error lists every
    path there is."""
    text = _help(capsys, "bench")
    compact = text.replace(" ", "")  # (argparse may break a line after a path's hyphen)
    assert f"(default:{','.join(bench.PATHS)},lessthepathsthedevicecannotrun" in compact
    assert "generate-syncandgenerate-async" in compact and "generate-async" in bench.PATHS

    class Ran(Exception):
        pass

    def run(shape, requests, prompt, new, paths, *args, **kwargs):
        raise Ran(paths)

    monkeypatch.setattr(bench, "run", run)
    with pytest.raises(Ran) as ran:
        cli.main(["bench", "--device", "cpu"])
    assert ran.value.args[0] == bench.runnable_paths(bench.PATHS, torch.device("cpu"))[0]
    every = ("stock", "hf-cb-sync", "hf-cb-async", "sync", "async", "generate-sync", "generate-async")
    bench.check_paths(every)  # all of them run
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--device", "cpu", "--compare", "stock,bogus"])
    message = str(stop.value)
    assert message.startswith("unknown path 'bogus'")
    assert set(message.split("choose from ")[1].split(" (")[0].split(", ")) == set(every)


def test_usage_names_the_command_the_user_ran(capsys, monkeypatch):
    """The console script says hf-async-cb; `python -m hf_async_cb` says so."""
    import runpy

    assert _help(capsys).startswith("usage: hf-async-cb ")
    monkeypatch.setattr(sys, "argv", ["__main__.py", "--help"])
    with pytest.raises(SystemExit):
        runpy.run_module("hf_async_cb", run_name="__main__")
    assert capsys.readouterr().out.startswith("usage: python -m hf_async_cb ")


def test_demo_counts_new_tokens_as_the_engine_and_its_bar_do():
    """Up to and including each row's EOS, not the padding after it, which is the EOS token itself
    for SmolLM2 (pad = EOS): the count of the engine's outputs, which its progress bar shows."""
    import copy

    from models import random_prompts, stock_generate, tiny_model

    from hf_async_cb import BatchingConfig, Engine

    prompts = random_prompts(4, 3, 12, seed=31)
    first = stock_generate(tiny_model("llama"), prompts[:1], max_new_tokens=6, eos_token_id=None)
    eos = int(first[0, len(prompts[0]) + 2])  # the first row's third token: that row ends there
    model = copy.deepcopy(tiny_model("llama"))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    out = stock_generate(model, prompts, max_new_tokens=6)
    width = max(map(len, prompts))
    with Engine(model, BatchingConfig(mode="sync")) as engine:
        engine_count = sum(len(o.output_token_ids) for o in engine.generate(prompts, max_new_tokens=6))
    assert engine_count < 4 * 6  # some row stopped at its EOS
    assert cli.generated_tokens(out, width, (eos,)) == engine_count


@pytest.mark.parametrize("out", ["/tmp", "timeline.xyz", "/nonexistent/folder/t.png"])
def test_a_timeline_that_cannot_be_written_is_a_usage_error_before_the_run(out, capsys):
    """profile --out is checked by the parser (a folder, a name matplotlib would change or refuse, a
    folder that does not exist), not after the whole workload ran."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["profile", "--out", out])
    assert stop.value.code == 2 and "--out" in capsys.readouterr().err


def test_options_that_do_not_go_together_and_shapes_too_large_are_refused_up_front(monkeypatch):
    with pytest.raises(SystemExit, match="--breakdown .*not with --serve"):
        cli.main(["bench", "--serve", "--breakdown"])
    monkeypatch.setattr(bench, "_available_host_memory", lambda: 2**30)  # a 1 GiB machine
    with pytest.raises(SystemExit, match=r"llama3-8b shape's weights take 29.9 GiB .* 1.0 GiB free"):
        bench.build_model("llama3-8b", torch.device("cpu"), torch.float32)


def test_ctrl_c_ends_a_command_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "bench", interrupted)  # (the parser is built in main(): it takes this one)
    assert cli.main(["bench"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"


@pytest.mark.parametrize("name", ["release", "runtime_info", "prefix_cache_stats", "clear_prefix_cache"])
def test_the_runtime_helpers_say_what_they_take(name):
    import hf_async_cb

    with pytest.raises(TypeError, match=rf"{name}\(\) takes the model generate\(\) ran on"):
        getattr(hf_async_cb, name)("not a model")


def test_a_bench_cut_short_keeps_the_paths_it_finished_in_its_json(monkeypatch, tmp_path, capsys):
    """Ctrl-C after the first path: --json still gets that path's row, marked as cut short."""
    import json

    real = bench.run_path

    def async_interrupted(path, *args, **kwargs):
        if path == "async" and kwargs.get("phase") != "warm-up":  # (every path is warmed up first)
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(bench, "run_path", async_interrupted)
    out = tmp_path / "report.json"
    code = cli.main(["bench", "--device", "cpu", "--shape", "tiny", "--requests", "2", "--prompt", "4", "--new", "2",
                     "--compare", "sync,async", "--json", str(out)])
    assert code == 130
    report = json.loads(out.read_text())
    assert report["interrupted"] and [r["path"] for r in report["results"]] == ["sync"]
