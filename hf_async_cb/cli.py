"""Command line of hf_async_cb: `demo` (SmolLM2 on real prompts), `bench` (one workload through every
generation path; `bench --serve`: requests arriving over time, with their latencies) and `profile`
(a timeline of the sync and async loops)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time

import torch

from hf_async_cb.devices import synchronize

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clean Python code.",
    "Explain gravity to a child in one sentence.",
    "What is 17 times 3?",
    "Name a famous painting by Leonardo da Vinci.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


DEMO_RUNS = {"off": "stock generate", "sync": 'batching="sync"', "async": 'batching="async"'}


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids) -> int:
    """New tokens of a generate output, counted as the engine counts a request's output (and its
    progress bar shows them): each row up to and including its first EOS, none of the padding after
    it, which may be the EOS token itself (SmolLM2's is)."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def _timed_generate(model, inputs, mode: str, new: int, label: str) -> tuple[torch.Tensor, float]:
    """One greedy generate call of the demo and its seconds; our paths show a progress bar `label`."""
    from hf_async_cb.config import BatchingConfig

    kwargs = {} if mode == "off" else {"batching_config": BatchingConfig(progress=label)}
    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new, do_sample=False, batching=mode, **kwargs)
    synchronize(model.device)
    return out, time.perf_counter() - start


def demo(args: argparse.Namespace) -> int:
    """Each path runs twice: a first call (which pays the one-time set-up: our engine's build and
    checks, torch's lazy initialisation) and the timed call, so that set-up is shown apart and
    not read as the speed of a path."""
    from hf_async_cb.engine.eos import model_eos_token_ids
    from hf_async_cb.tools.demo_model import cache_dir, load_smollm2, needs_conversion

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if needs_conversion():
        print(f"First run: converting SmolLM2's GGUF file once to {cache_dir()} (a few seconds)...", flush=True)
    print(f"Loading SmolLM2-135M-Instruct ({dtype}, {device})...")
    model, tokenizer = load_smollm2(dtype=dtype, device=device)
    chats = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    width = inputs.input_ids.shape[1]
    eos = model_eos_token_ids(model, tokenizer)
    results = {}
    for i, mode in enumerate(DEMO_RUNS):
        print(f"[{i + 1}/{len(DEMO_RUNS)}] {DEMO_RUNS[mode]}: {len(DEMO_PROMPTS)} prompts, up to "
              f"{args.max_new_tokens} new tokens each, a first call then the timed one", flush=True)
        _, first = _timed_generate(model, inputs, mode, args.max_new_tokens, f"{DEMO_RUNS[mode]} first call")
        out, seconds = _timed_generate(model, inputs, mode, args.max_new_tokens, f"{DEMO_RUNS[mode]} timed")
        results[mode] = (out, first, seconds, generated_tokens(out, width, eos))

    answers = tokenizer.batch_decode(results["async"][0][:, width:], skip_special_tokens=True)
    for prompt, answer in zip(DEMO_PROMPTS, answers):
        print(f"\n>>> {prompt}\n{answer.strip()}")
    print()
    print(f"{'path':<28}{'first call s':>13}{'seconds':>9}{'new tokens':>12}{'tokens/s':>10}  same tokens as stock")
    stock = results["off"][0]
    for mode, (out, first, seconds, n) in results.items():
        same = "-" if mode == "off" else ("yes" if torch.equal(out, stock) else "NO")
        print(f"{DEMO_RUNS[mode]:<28}{first:>13.2f}{seconds:>9.2f}{n:>12}{n / seconds:>10.1f}  {same}")
    print("\nseconds: the second, timed call; the first call also pays the one-time set-up. New tokens count "
          "each answer's tokens up to its end-of-sequence token, that token included.")
    if device.type == "cpu":
        print("These are CPU timings of a 135M model: the async loop exists to keep a GPU busy, which a CPU run "
              "cannot show. See docs/benchmarks.md for GPU figures.")
    return 0


SERVE_ONLY = ("rate", "lengths", "warmup", "seed", "system_prompt")  # bench options that only --serve reads


def _bench_workload(args: argparse.Namespace, device: torch.device) -> tuple:
    """shape, requests, prompt and new tokens: those given, the device's defaults for the others
    (tools/bench.py's WORKLOADS), saying so when the defaults are the CPU's short check."""
    from hf_async_cb.tools import bench as b

    workload = b.default_workload(device)
    chosen = {k: getattr(args, k) for k in workload}
    defaulted = [k for k, v in chosen.items() if v is None]
    if device.type != "cuda" and defaulted:
        print(f"On {device.type} the defaults are a short check, not a measurement: "
              + ", ".join(f"--{k} {workload[k]}" for k in defaulted))
    shape, requests, prompt, new = (workload[k] if v is None else v for k, v in chosen.items())
    limit = b.SHAPES[shape].get("max_position_embeddings")
    longest = prompt * 3 // 2 if args.serve and args.lengths == "uniform" else prompt
    if args.serve and args.lengths == "sharegpt":
        from hf_async_cb.tools.serving_workload import SHAREGPT

        longest = SHAREGPT["prompt"]["hi"]
    system = (getattr(args, "system_prompt", 0) or 0) if args.serve else 0
    if limit is not None and longest + system > limit:
        given = f"--prompt {prompt}" + (f" and --system-prompt {system}" if system else "")
        raise SystemExit(f"{given}: prompts of up to {longest + system} tokens are longer than the {shape} shape's "
                         f"{limit} positions")
    return shape, requests, prompt, new


def _write_json(path: str | None, report: dict) -> None:
    import json

    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def bench(args: argparse.Namespace) -> int:
    """Defaults that are None depend on the device (tools/bench.py's WORKLOADS): a CPU run is a short
    check that every path it can run works, without the paths it cannot run."""
    from hf_async_cb.config import BatchingConfig
    from hf_async_cb.tools import bench as b

    if args.serve:
        if args.breakdown:
            raise SystemExit("--breakdown profiles the batch bench's async loop: not with --serve")
        return serve(args)
    given = [f"--{name.replace('_', '-')}" for name in SERVE_ONLY if getattr(args, name) is not None]
    if given:
        raise SystemExit(f"{', '.join(given)}: only with --serve")
    device = torch.device(args.device) if args.device else b.default_device()
    shape, requests, prompt, new = _bench_workload(args, device)
    if args.breakdown:
        return breakdown(args, device, shape, requests, prompt, new)
    if args.compare is not None:
        paths = tuple(args.compare.split(","))
    else:  # the mixed workload runs our paths only
        paths = ("sync", "async") if args.mixed else b.PATHS
    paths = _runnable(paths, device, lambda p: b.check_paths(p, args.mixed), b.runnable_paths)
    config = BatchingConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                            max_running_requests=max(requests, 1), cuda_graphs=args.cuda_graphs,
                            progress=args.progress, mixed_prefill_tokens=args.mixed_prefill_tokens)
    done = []

    def finished(r) -> None:  # as each path ends: a run cut short still says what it measured
        done.append(r)
        print(f"[bench] {r.path}: {r.tokens_per_s:,.0f} tokens/s, {b.format_seconds(r.seconds)} s", file=sys.stderr,
              flush=True)

    try:
        report = b.run(shape, requests, prompt, new, paths, device, config=config, mixed=args.mixed,
                       sample=args.sample, on_result=finished)
    except KeyboardInterrupt:  # --json keeps the paths that finished, marked as cut short
        _write_json(args.json, {"shape": shape, "requests": requests, "prompt": prompt, "new": new,
                                "device": str(device), "interrupted": True,
                                "results": [dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in done]})
        raise
    print(b.format_table(report))
    _write_json(args.json, report)
    return 0


def breakdown(args: argparse.Namespace, device: torch.device, shape: str, requests: int, prompt: int,
              new: int) -> int:
    """`bench --breakdown`: our async loop's step, by kernel kind and GEMM shape (tools/breakdown.py)."""
    from hf_async_cb.config import BatchingConfig
    from hf_async_cb.tools import bench as b
    from hf_async_cb.tools.breakdown import format_breakdown, step_breakdown

    if args.compare is not None or args.mixed or args.sample:
        raise SystemExit("--breakdown profiles our async loop on the fixed workload: no --compare, --mixed or --sample")
    model = b.build_model(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = BatchingConfig(mode="async", page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                            max_running_requests=max(requests, 1), cuda_graphs=args.cuda_graphs,
                            mixed_prefill_tokens=args.mixed_prefill_tokens)
    report = step_breakdown(model, b._prompts(requests, prompt, model.config.vocab_size), new, config)
    report["shape"] = shape
    print(f"{shape}: " + format_breakdown(report))
    _write_json(args.json, report)
    return 0


def _runnable(paths: tuple, device: torch.device, check, runnable) -> tuple:
    """The paths asked for, checked (a bad name ends the command) and cut to those `device` can run,
    each one left out said why."""
    try:
        check(paths)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    paths, notes = runnable(paths, device)
    for note in notes:
        print(note)
    if not paths:
        raise SystemExit(f"no path to run on {device}")
    return paths


def serve(args: argparse.Namespace) -> int:
    """`bench --serve`: the serving benchmark (tools/serving.py) on bench's workload options."""
    from hf_async_cb.config import BatchingConfig
    from hf_async_cb.tools import bench as b
    from hf_async_cb.tools import serving as s

    if args.mixed:
        raise SystemExit("--mixed is the batch bench's; with --serve, choose the lengths with --lengths")
    if args.rate is not None and not args.rate > 0:
        raise SystemExit(f"--rate must be > 0 requests/s (inf: all at once), got {args.rate}")
    device = torch.device(args.device) if args.device else b.default_device()
    shape, requests, prompt, new = _bench_workload(args, device)
    paths = tuple(args.compare.split(",")) if args.compare is not None else s.PATHS
    paths = _runnable(paths, device, s.check_paths, s.runnable_paths)
    config = BatchingConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                            max_running_requests=max(requests, 1), cuda_graphs=args.cuda_graphs,
                            mixed_prefill_tokens=args.mixed_prefill_tokens)
    report = s.run(shape, requests, math.inf if args.rate is None else args.rate,
                   args.lengths or s.default_lengths(device), prompt, new, paths, device, config=config,
                   sample=args.sample, warmup=args.warmup or "replay", seed=args.seed or 0,
                   system_prompt=args.system_prompt or 0)
    print(s.format_table(report))
    _write_json(args.json, report)
    return 0


def profile(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401 - drawn after the whole run: checked before it
    except ImportError:
        raise SystemExit("profile draws its timeline with matplotlib: pip install 'hf-async-cb[demo]' "
                         "(or matplotlib)") from None
    from hf_async_cb.config import BatchingConfig
    from hf_async_cb.engine.engine import Engine
    from hf_async_cb.engine.profiling import plot_timelines
    from hf_async_cb.tools.bench import _prompts, build_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts = _prompts(args.requests, args.prompt, model.config.vocab_size)
    profiles = {}
    for mode in ("sync", "async"):
        engine = Engine(model, BatchingConfig(mode=mode, profile=True, cuda_graphs=args.cuda_graphs,
                                              max_running_requests=max(args.requests, 1)))
        engine.generate(prompts, max_new_tokens=args.new)  # warm-up
        engine.generate(prompts, max_new_tokens=args.new)
        profiles[mode] = engine.last_profile
        summary = engine.last_profile.summary()
        print(mode, ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    plot_timelines(profiles, args.out, last_seconds=args.last_ms / 1e3 if args.last_ms else None)
    print(f"timeline written to {args.out}")
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None: those options' help says what they default to."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


CUDA_GRAPHS_HELP = ("our paths: replay decode steps (greedy or seeded sampling), and prefill and mixed steps with "
                    "the Triton attention, from CUDA graphs (BatchingConfig.cuda_graphs). Default: on when the "
                    "device is CUDA, off elsewhere (on the CPU, --cuda-graphs runs the same padded static-buffer "
                    "path eagerly)")


def _whole_number(minimum: int):
    """An argparse type: a whole number >= `minimum` (a usage error otherwise, not a traceback later)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


positive_int, non_negative_int = _whole_number(1), _whole_number(0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def device_name(text: str) -> str:
    """An argparse type: a device torch knows and this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"runs on cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available on this machine (this torch build or its driver)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return text


def writable_file(text: str) -> str:
    """An argparse type: a file path whose folder exists and can be written in, and that is no folder
    itself (checked before a long run, not after)."""
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name in it")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written (permissions)")
    return text


def png_file(text: str) -> str:
    """An argparse type: a writable file path for a picture, named .png (matplotlib would add the
    suffix to a name without one, and refuse one it does not know, after the whole run)."""
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"{text}: the timeline is a PNG; name it ....png")
    return writable_file(text)


def _workload_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """The random-weights workload shared by bench and profile. Without `defaults`, the workload
    defaults depend on the device (bench.WORKLOADS)."""
    from hf_async_cb.tools.bench import SHAPES, WORKLOADS

    d = defaults or {}
    per_device = {k: f"(default: {WORKLOADS['cuda'][k]} on CUDA, {WORKLOADS['cpu'][k]} on the CPU)"
                  for k in WORKLOADS["cuda"]}
    p.add_argument("--shape", default=d.get("shape"), choices=sorted(SHAPES),
                   help="model shape, random weights" + ("" if d else " " + per_device["shape"]))
    p.add_argument("--requests", type=positive_int, default=d.get("requests"),
                   help="requests in the workload" + ("" if d else " " + per_device["requests"]))
    serve = "" if d else ("; with --serve, the fixed length and the middle of the uniform range (1/2 to 3/2 of it; "
                          "sharegpt ignores it)")
    p.add_argument("--prompt", type=positive_int, default=d.get("prompt"),
                   help="prompt tokens per request" + serve + ("" if d else " " + per_device["prompt"]))
    p.add_argument("--new", type=positive_int, default=d.get("new"),
                   help="new tokens per request" + serve + ("" if d else " " + per_device["new"]))
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help=CUDA_GRAPHS_HELP)


CONSOLE_PROG = "hf-async-cb"  # the console script (pyproject.toml)
MODULE_PROG = "python -m hf_async_cb"  # __main__.py


def build_parser(prog: str = CONSOLE_PROG) -> argparse.ArgumentParser:
    """`prog`: how the user ran the command, for usage lines and errors."""
    from hf_async_cb.tools.bench import PATHS as BENCH_PATHS
    from hf_async_cb.tools.bench import ablation_suffixes as bench_ablations
    from hf_async_cb.tools.serving import LENGTHS, WARMUPS
    from hf_async_cb.tools.serving import PATHS as SERVE_PATHS

    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="SmolLM2-135M on a few real prompts: stock generate vs sync vs async",
                       formatter_class=_HelpFormatter)
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="new tokens per prompt")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="one workload on random weights through stock, HF CB and our loops",
                       formatter_class=_HelpFormatter)
    _workload_args(p)
    p.add_argument("--compare", default=None,
                   help="paths, comma-separated: stock (plain generate), hf-cb-sync and hf-cb-async (transformers' "
                        "own continuous batching), sync and async (ours, on a held Engine; they take the ablation "
                        f"suffixes {bench_ablations()}), generate-sync and generate-async (ours, through "
                        f"model.generate(batching=...)) (default: {','.join(BENCH_PATHS)}, less the paths the device "
                        "cannot run, e.g. hf-cb-async on the CPU; with --mixed: sync,async; with --serve: "
                        f"{','.join(SERVE_PATHS)}, less what the device or transformers cannot run)")
    p.add_argument("--sample", action="store_true",
                   help="sampled decoding (temperature 0.8, top-p 0.95; ours seeded) instead of greedy, on every path")
    p.add_argument("--mixed", action="store_true",
                   help="prompts and outputs of 64..1024 tokens per request (our paths only)")
    p.add_argument("--page-size", type=positive_int, default=16, help="KV-cache page size of our paths")
    p.add_argument("--max-batch-tokens", type=positive_int, default=None,
                   help="token budget of a step of our paths (and of HF CB's on the CPU); default: the device's "
                        "(BatchingConfig.for_device: 8192 on a GPU of 70 GiB or more, 512 on the CPU)")
    p.add_argument("--mixed-prefill-tokens", type=positive_int, default=None,
                   help="at most this many prompt tokens in a step that also decodes (BatchingConfig."
                        "mixed_prefill_tokens); default: no cap, the whole step budget")
    p.add_argument("--breakdown", action="store_true",
                   help="profile our async loop instead: kernel time per step by kind (GEMMs, attention, the rest) "
                        "and each GEMM shape's achieved TB/s")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    p.add_argument("--json", type=writable_file, default=None, help="also write the full report here")
    p.add_argument("--serve", action="store_true",
                   help="the serving benchmark instead (tools/serving.py): requests arriving over time at a "
                        "held engine, a row per path with throughput and TTFT, ITL and E2E latency percentiles")
    p.add_argument("--rate", type=float, default=None,
                   help="with --serve: Poisson arrivals of this many requests/s; inf: all at once (default: inf)")
    p.add_argument("--lengths", default=None, choices=LENGTHS,
                   help="with --serve: prompt and output lengths: fixed (--prompt and --new), uniform (1/2 to 3/2 "
                        "of --prompt and of --new), sharegpt (lognormal, ShareGPT-like: means ~161 and ~341 "
                        "tokens) (default: sharegpt on CUDA, fixed on the CPU)")
    p.add_argument("--warmup", default=None, choices=WARMUPS,
                   help="with --serve: before the timed run, replay its workload once (keeps graph captures out "
                        "of it) or send a few short requests (default: replay)")
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="with --serve: seed of the arrivals, lengths and prompt tokens (default: 0)")
    p.add_argument("--system-prompt", type=non_negative_int, default=None,
                   help="with --serve: this many tokens, the same for every request, before each prompt (a "
                        "shared system prompt; compare async with async-nocache for what prefix caching saves) "
                        "(default: 0)")
    p.set_defaults(func=bench)
    p = sub.add_parser("profile", help="CPU and GPU timeline of the sync and async loops, as a PNG",
                       formatter_class=_HelpFormatter)
    _workload_args(p, dict(shape="tiny", requests=16, prompt=32, new=32))
    p.add_argument("--last-ms", type=positive_float, default=None, help="draw only the last N ms of each run")
    p.add_argument("--out", type=png_file, default="timeline.png", help="the PNG to write")
    p.set_defaults(func=profile)
    return parser


def main(argv: list[str] | None = None, prog: str = CONSOLE_PROG) -> int:
    """The console script's entry point; `python -m hf_async_cb` passes prog=MODULE_PROG."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser(prog).parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not the frames it landed in (a bench says what it finished)
        print("interrupted", file=sys.stderr)
        return 130
