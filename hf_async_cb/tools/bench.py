"""Benchmarks on random weights in real shapes: the same workload through every generation path.

Paths: "stock" (plain generate), "hf-cb-sync" / "hf-cb-async" (transformers' own continuous
batching), "sync" / "async" (ours, on a held Engine), "generate-sync" / "generate-async" (ours through
model.generate(batching=...): the runtime it keeps on the model), and ablations of ours: a suffix "-ref" runs the pure-torch
reference attention, "-unfused" leaves the model unfused (projections and element-wise work),
"-noew" fuses the projections only, "-eager" runs without CUDA graphs
(e.g. "async-ref-unfused"). The "mixed" workload gives each request its own prompt and output
length (our paths only: the others take one length for a whole batch). The floor is what memory
bandwidth allows: each decode step reads every weight once and the KV of every running request, at
the copy bandwidth measured on the same device in the same process (CUDA only: a CPU run has no
floor). The defaults depend on the device (`default_workload`, `runnable_paths`): a CPU run is a
short smoke test of every path that runs there, not a measurement.
"""

from __future__ import annotations

import gc
import inspect
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from hf_async_cb.tools import timing

logger = logging.getLogger(__name__)

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Its real 128K context (llama3 rope scaling), so that long-prompt runs (a 32K prompt) fit.
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                      "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
                        tie_word_embeddings=True),
    # A mixture of experts: Qwen3-30B-A3B's layer (128 experts, 8 active, GQA 32/4 of head_dim 128),
    # 12 of its 48 layers (7.6B parameters, 1.1B active per token), so that stock finishes in minutes.
    "qwen3-moe-12l": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=8192,
                          rope_theta=1000000.0, norm_topk_prob=True),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, vocab_size=256, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048),
}
GENERATE_PATHS = ("generate-sync", "generate-async")  # ours through model.generate(batching=...)
KNOWN_PATHS = ("stock", "hf-cb-sync", "hf-cb-async", "sync", "async") + GENERATE_PATHS
PATHS = ("stock", "hf-cb-sync", "hf-cb-async", "sync", "async", "generate-async")  # a run without --compare
# The default workload per device: the GPU one takes minutes per path on a CPU, where nothing is
# measured anyway (no CUDA events, no floor): there it only shows that every path runs.
WORKLOADS = {"cuda": dict(shape="llama3.2-1b", requests=64, prompt=128, new=256),
             "cpu": dict(shape="tiny", requests=8, prompt=32, new=32)}
HF_ASYNC_DEVICES = ("cuda", "xpu")  # transformers' async batching refuses other devices
ABLATIONS = {"ref": {"attention": "reference"}, "unfused": {"fuse_projections": False, "fuse_elementwise": False},
             "noew": {"fuse_elementwise": False}, "eager": {"cuda_graphs": False},
             "noprefill": {"prefill_graphs": False}, "cublas": {"skinny_gemm": False},
             "nocache": {"prefix_caching": False}, "late": {"late_admission": True},
             "early": {"late_admission": False}}


def our_path(path: str) -> tuple[str, dict] | None:
    """"async-ref-eager" -> ("async", the BatchingConfig changes of those ablations); None if not ours."""
    mode, *variants = path.split("-")
    if mode not in ("sync", "async") or any(v not in ABLATIONS for v in variants):
        return None
    return mode, {k: v for variant in variants for k, v in ABLATIONS[variant].items()}


def ablation_suffixes() -> str:
    """"-ref/-unfused/...": what our paths' names may end with."""
    return "/".join(f"-{name}" for name in ABLATIONS)


def check_paths(paths, mixed: bool = False) -> None:
    for path in paths:
        if path not in KNOWN_PATHS and our_path(path) is None:
            raise ValueError(f"unknown path {path!r}: choose from {', '.join(KNOWN_PATHS)} "
                             f"(sync, async with {ablation_suffixes()})")
        if mixed and (path in PATHS[:3] or path in GENERATE_PATHS):
            raise ValueError(f"the mixed workload runs our paths only, not {path!r}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_workload(device: torch.device) -> dict:
    """shape, requests, prompt and new tokens of the default run on `device` (non-CUDA: the CPU's)."""
    return dict(WORKLOADS["cuda" if device.type == "cuda" else "cpu"])


def runnable_paths(paths, device: torch.device) -> tuple[tuple[str, ...], list[str]]:
    """The paths that can run on `device`, and a one-line note for each one left out."""
    kept, notes = [], []
    for path in paths:
        if path == "hf-cb-async" and device.type not in HF_ASYNC_DEVICES:
            notes.append(f"skipped {path}: transformers' async batching needs a device in {HF_ASYNC_DEVICES}, "
                         f"not {device.type}")
        else:
            kept.append(path)
    return tuple(kept), notes


@dataclass
class Result:
    path: str
    seconds: float
    tokens: int
    steps: int | None = None
    gpu_busy: float | None = None  # fraction of steady-decode wall time the compute stream was busy
    decode_ms_per_step: float | None = None
    peak_memory_gib: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0)
    _check_fits(shape, config, device, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # benchmarks ignore EOS: every request runs to max_new
    model.generation_config.pad_token_id = 0
    return model


def _check_fits(shape: str, config, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with the sizes, a shape whose weights alone exceed the memory the device has free (an
    8B float32 model on a small CPU machine was killed by the kernel after minutes of building)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        weights = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) * dtype.itemsize
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_host_memory()
    if free is not None and weights > free:
        raise SystemExit(f"the {shape} shape's weights take {weights / 2**30:.1f} GiB in {dtype} and {device} has "
                         f"{free / 2**30:.1f} GiB free: pick a smaller --shape")


def _available_host_memory() -> int | None:
    """Bytes the kernel says a process can still take (MemAvailable, page cache included); None
    where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float | None:
    """Bytes per second of a device-to-device copy, read + write counted; None (not measured) off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.randn(int(gib * 2**30 / 4), device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    return 2 * gib * 2**30 / seconds


def matmul_peak(device: torch.device, n: int = 8192) -> float | None:
    """FLOP/s of a large bf16 matmul on `device` (what a compute-bound prefill can reach); None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    del a, b
    return 2 * n**3 * 10 / (start.elapsed_time(end) / 1e3)


def prefill_flops(model, requests: int, prompt: int) -> float:
    """FLOPs of prefilling `requests` prompts of `prompt` tokens: 2 per active weight per token (the
    embedding table is a lookup; the LM head runs at each prompt's last token only), plus causal
    attention (q.k and p.v over half the square of the prompt, per layer and query head)."""
    c = model.config
    experts, active = getattr(c, "num_experts", None), getattr(c, "num_experts_per_tok", None)
    share = active / experts if experts and active else 1.0
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in model.named_parameters()
               if p is not embed and p is not head)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * prompt * prompt
    return requests * (2 * body * prompt + 2 * head.numel() + attention)


def floor_ms_per_step(model, requests: int, prompt: int, new: int, bandwidth: float) -> float:
    """Weights once + the average KV read of a decode step, at the measured bandwidth. In a mixture
    of experts, a step reads only the experts its rows route to: with k of E experts per token,
    uniform routing touches a fraction 1 - (1 - k/E)^requests of each layer's experts."""
    c = model.config
    experts, active = getattr(c, "num_experts", None), getattr(c, "num_experts_per_tok", None)
    touched = 1 - (1 - active / experts) ** requests if experts and active else 1.0
    weight_bytes = sum(p.numel() * p.element_size() * (touched if ".experts." in name else 1.0)
                       for name, p in model.named_parameters())
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize
    avg_context = prompt + new / 2
    return (weight_bytes + requests * avg_context * kv_per_token) / bandwidth * 1e3


def _prompts(requests: int, prompt: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (requests, prompt), generator=g).tolist()


# --sample: what every path draws with instead of greedy picks (ours seeded, so reproducible). top_k
# is explicit: generate's default (GenerationConfig.top_k = 50) would apply to stock and HF only.
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
HF_PAGE = 256  # transformers' continuous batching: tokens per page (its default)


def bar_labels(path: str, phase: str = "") -> tuple[str, str]:
    """The progress bars' labels of a path's first and timed calls: "sync first call", "sync timed";
    in a phase of their own (run()'s short warm-up pass), "sync warm-up (first call)", "sync warm-up"."""
    return (f"{path} {phase} (first call)", f"{path} {phase}") if phase else (f"{path} first call", f"{path} timed")


def _labelled(config, label: str):
    """`config` with its progress bar (if on) labelled `label`."""
    return replace(config, progress=label) if config.progress else config


def run_path(path: str, model, prompts: list[list[int]], new, config=None, sample: bool = False,
             phase: str = "") -> Result:
    """`new`: new tokens per request, one int for all or a list (mixed workload, our paths only).
    `sample`: draw with SAMPLING on every path instead of greedy picks. `phase`: what the progress
    bars of our paths say beside the path (bar_labels)."""
    decoding = SAMPLING if sample else dict(do_sample=False)
    first_call, timed = bar_labels(path, phase)
    device = model.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    timing.sync(device)
    start = time.perf_counter()
    extra: dict = {}
    steps = busy = decode_ms = None
    if path == "stock":
        ids = torch.tensor(prompts, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, batching="off",
                             eos_token_id=None, pad_token_id=0, **decoding)
        tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    elif path in GENERATE_PATHS:
        import hf_async_cb

        ids = torch.tensor(prompts, device=device)
        batching_config = replace(config or hf_async_cb.BatchingConfig(), seed=0)
        options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, batching=path.split("-")[1],
                       batching_config=_labelled(batching_config, first_call),
                       eos_token_id=None, pad_token_id=0, **decoding)
        # The first call builds the model's runtime (captures, compiles): timed on its own, as ours.
        warm = time.perf_counter()
        model.generate(ids, **options)
        timing.sync(device)
        extra["warmup_s"] = time.perf_counter() - warm
        options["batching_config"] = _labelled(batching_config, timed)  # (per call: the runtime is kept)
        # The timed call must not reuse the prompts the first call cached: it measures a workload
        # seen for the first time, as the other paths do (sharing within the call still counts).
        seconds, out = timing.timed(lambda: model.generate(ids, **options), device, unseen=model)
        tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        hf_async_cb.release(model)
        return Result(path, seconds, tokens, extra=extra)
    elif path.startswith("hf-cb"):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # -1: no EOS, said as transformers' continuous batching asks (None makes it warn, then use -1).
        gcfg = GenerationConfig(max_new_tokens=new, eos_token_id=-1, pad_token_id=0, **decoding)
        sizing = {}
        if device.type == "cpu":
            # Else HF sizes its cache from the host's free RAM and its step for 8192 tokens, and fills
            # those tensors (with their attention mask) for tens of seconds: the workload's pages and our step budget.
            lengths = new if isinstance(new, list) else [new] * len(prompts)
            sizing["num_blocks"] = sum(-(-(len(p) + n) // HF_PAGE) for p, n in zip(prompts, lengths))
            from hf_async_cb.config import BatchingConfig

            sizing["max_batch_tokens"] = (config or BatchingConfig()).for_device(device).max_batch_tokens
        # Its page size is `block_size` in transformers 5.17, `page_size` in newer releases.
        page_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        cb = ContinuousBatchingConfig(use_async_batching=path.endswith("async"), **{page_key: HF_PAGE}, **sizing)
        outs = model.generate_batch(prompts, generation_config=gcfg, continuous_batching_config=cb)
        tokens = sum(len(o.generated_tokens) for o in outs.values())
    else:
        from hf_async_cb.config import BatchingConfig
        from hf_async_cb.engine.engine import Engine
        from hf_async_cb.engine.requests import SamplingParams

        mode, changes = our_path(path)
        config = config or BatchingConfig()
        if sample and config.seed is None:
            changes["seed"] = 0
        engine = Engine(model, _labelled(replace(config, mode=mode, **changes), first_call))
        pipeline = engine.pipeline(mode)
        decoding = dict(decoding, eos_token_ids=())  # no EOS, as every other path
        params = [SamplingParams(max_new_tokens=n, **decoding) for n in new] if isinstance(new, list) \
            else SamplingParams(max_new_tokens=new, **decoding)
        # Warm-up: the same workload once (graph captures, kernel selection), timed on its own.
        warm = time.perf_counter()
        engine.generate(prompts, params)
        timing.sync(device)
        extra["warmup_s"] = time.perf_counter() - warm
        engine.config = _labelled(engine.config, timed)
        pipeline.record_step_times = device.type == "cuda"
        pipeline.num_steps = 0
        engine.clear_prefix_cache()  # (as for generate paths: no reuse of the warm-up's prompts)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        tokens = sum(len(o.output_token_ids) for o in outs)
        steps = pipeline.num_steps
        if pipeline.record_step_times:
            busy, decode_ms = pipeline.decode_busy_fraction()
        extra["discarded_tokens"] = pipeline.num_discarded
        if engine.graphs is not None:
            extra["graphs"] = len(engine.graphs)
        engine.close()
    timing.sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return Result(path, seconds, tokens, steps, busy, decode_ms, peak, extra)


def mixed_workload(requests: int, vocab: int, lo: int = 64, hi: int = 1024) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths drawn uniformly from [lo, hi], fixed seed."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(lo, hi + 1, (2, requests), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths[0]]
    return prompts, lengths[1]


def run(shape: str, requests: int, prompt: int, new: int, paths=PATHS, device=None, dtype=None,
        config=None, mixed: bool = False, sample: bool = False, on_result=None) -> dict:
    """Every path on one workload. The floor fields are None where there is no floor: off CUDA (no
    bandwidth measured) and for the mixed workload (no single step shape). `on_result(result)` is
    called as each path finishes, so that a run cut short still reports the paths it finished."""
    check_paths(paths, mixed)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(shape, device, dtype)
    bandwidth = copy_bandwidth(device)
    peak = matmul_peak(device)
    floor = roofline = None
    if mixed:
        prompts, new = mixed_workload(requests, model.config.vocab_size)
    else:
        prompts = _prompts(requests, prompt, model.config.vocab_size)
        if bandwidth is not None:
            floor = floor_ms_per_step(model, requests, prompt, new, bandwidth)
            roofline = prefill_flops(model, requests, prompt) / peak + new * floor / 1e3
    # Warm-up: one short pass through every path (kernels, allocator, lazy imports).
    for path in paths:
        run_path(path, model, prompts[:2], 2, config, sample, phase="warm-up")
    results = []
    for path in paths:
        results.append(run_path(path, model, prompts, new, config, sample))
        if on_result is not None:
            on_result(results[-1])
    if mixed:
        prompt, new = "64..1024", "64..1024"
    return {"shape": shape, "requests": requests, "prompt": prompt, "new": new, "sample": sample, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype), "bandwidth_tb_s": bandwidth / 1e12 if bandwidth is not None else None,
            "floor_ms_per_step": floor, "floor_tokens_per_s": requests / floor * 1e3 if floor is not None else None,
            "peak_tflops": peak / 1e12 if peak is not None else None, "roofline_s": roofline,
            "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]}


def _cell(value, fmt: str) -> str | None:
    return None if value is None else format(value, fmt)


def format_seconds(seconds: float | None) -> str | None:
    """Three significant digits (0.00412, 4.12, 412): a fast path's time is not rounded to 0.0."""
    if seconds is None:
        return None
    if seconds <= 0:
        return "0"
    return f"{seconds:.{max(0, 2 - math.floor(math.log10(seconds)))}f}"


def first_call_extra(result: dict) -> float | None:
    """What the first call took beyond the timed one (set-up a user pays once), clamped at 0: the
    timed call taking longer is noise between two runs of the same work, not a negative set-up."""
    warmup = result["extra"].get("warmup_s")
    return None if warmup is None else max(0.0, warmup - result["seconds"])


# (title, cell of a result row, given the report's floor in tok/s or None, and its roofline in s or
# None). A column no row has a value for is left out (on a CPU: the floor, the roofline, the
# CUDA-event timings and peak memory).
COLUMNS = (
    ("tokens/s", lambda r, floor: f"{r['tokens_per_s']:,.0f}"),
    ("% of floor", lambda r, floor: None if floor is None else f"{100 * r['tokens_per_s'] / floor:.1f}%"),
    ("of roofline", lambda r, floor: None if r.get("roofline_s") is None else f"{r['roofline_s'] / r['seconds']:.2f}"),
    ("s", lambda r, floor: format_seconds(r["seconds"])),
    ("steps", lambda r, floor: _cell(r["steps"], "d")),
    ("decode ms/step", lambda r, floor: _cell(r["decode_ms_per_step"], ".2f")),
    ("GPU busy (decode)", lambda r, floor: _cell(r["gpu_busy"] and 100 * r["gpu_busy"], ".1f")),
    ("peak GiB", lambda r, floor: _cell(r["peak_memory_gib"], ".1f")),
    # The first call runs the same workload (builds, captures, compiles): its time, and what it
    # costs beyond the timed call's (what a user pays once).
    ("first call s", lambda r, floor: format_seconds(r["extra"].get("warmup_s"))),
    ("first call extra s", lambda r, floor: format_seconds(first_call_extra(r))),
)


def format_table(report: dict) -> str:
    """A markdown table, a row per path, under a line naming the workload, the device and the floor."""
    floor = report.get("floor_tokens_per_s")
    if report.get("bandwidth_tb_s") is None:
        bound = f"copy bandwidth and floor not measured on {report['device']} (they need CUDA)"
    elif floor is None:
        bound = f"copy bandwidth {report['bandwidth_tb_s']:.2f} TB/s; no floor for the mixed workload"
    else:
        bound = (f"copy bandwidth {report['bandwidth_tb_s']:.2f} TB/s; floor {report['floor_ms_per_step']:.2f} "
                 f"ms/step = {floor:,.0f} tok/s")
    if report.get("roofline_s") is not None:
        bound += (f"; roofline {report['roofline_s']:.2f} s (prefill at the measured "
                  f"{report['peak_tflops']:.0f} TFLOP/s, then every decode step at the floor)")
    cells = [[cell(dict(r, roofline_s=report.get("roofline_s")), floor) for _, cell in COLUMNS]
             for r in report["results"]]
    shown = [i for i in range(len(COLUMNS)) if any(row[i] is not None for row in cells)]
    lines = [
        f"{report['shape']}, {report['requests']} requests x prompt {report['prompt']} x {report['new']} new"
        f"{', sampled ' + str(SAMPLING) if report.get('sample') else ''}, "
        f"{report['dtype']} on {report['gpu']}; {bound}",
        "| path | " + " | ".join(COLUMNS[i][0] for i in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for r, row in zip(report["results"], cells):
        lines.append(f"| {r['path']} | " + " | ".join("-" if row[i] is None else row[i] for i in shown) + " |")
    return "\n".join(lines)
