#!/usr/bin/env python
"""Quantized 8B models through generate(): stock generate beside generate(batching="async"), per form.

    PYTHONPATH=. python benchmarks/gpu_quantized.py [--forms torchao-int8,bnb-nf4] [--new 512] [--json out.json]

Random bf16 weights in the Llama-3-8B shape, quantized as a user would: torchao's `quantize_` on the loaded
model, quanto's `quantize` + `freeze`, or `from_pretrained(..., quantization_config=...)` for
bitsandbytes and HQQ (the model is saved once to a temporary folder for those). Per form, in one
process: stock generate on 32 x 128 -> 512 greedy, then ours (its first call timed apart, then the
timed call on prompts it has not cached), the rows whose tokens equal stock's, and the fraction of
the bandwidth floor: the quantized weights' bytes as stored (inner tensors of subclasses, scales and
zero points included) plus the K/V a step reads, at the measured copy bandwidth. Each form's row is
written to --json as soon as it is done; forms left when --budget seconds have passed are skipped.
Each row also says where ours' first call went (`first_call_phases`: hf_async_cb/tools/phases.py) and,
with `--paths kernels`, the top kernels per step of one more profiled call.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time

import torch

import hf_async_cb
from hf_async_cb.model.weight_kinds import is_plain
from hf_async_cb.tools import phases, timing
from hf_async_cb.tools.bench import SHAPES, _prompts, build_model, copy_bandwidth, run_path


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights occupy as stored: each distinct storage once, a tensor subclass
    counted by its inner tensors (torchao), quantization states that are buffers or attributes
    included where the state dict holds them (bitsandbytes, HQQ, quanto)."""
    seen: set = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if not is_plain(t):
            flatten = getattr(t, "__tensor_flatten__", None)
            if callable(flatten):
                names, _ = flatten()
                for name in names:
                    inner = getattr(t, name, None)
                    if isinstance(inner, torch.Tensor):
                        add(inner)
                return
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for value in model.state_dict().values():
        if isinstance(value, torch.Tensor):
            add(value)
    return total


def _torchao(config_name: str, **settings):
    def make(base):
        from torchao import quantization

        model = base()
        quantization.quantize_(model, getattr(quantization, config_name)(**settings))
        return model
    return make


def _quanto(weights: str, exclude: str | None = None):
    def make(base):
        from optimum import quanto

        model = base()
        quanto.quantize(model, weights=getattr(quanto, weights), exclude=exclude)
        quanto.freeze(model)
        return model
    return make


def _pretrained(make_config):
    """A form loaded with `from_pretrained(..., quantization_config=make_config())` from the saved model."""
    def make(base, path, device):
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=make_config(), device_map=str(device), dtype=torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model
    make.needs_checkpoint = True
    return make


def _bnb(**settings):
    import transformers

    return _pretrained(lambda: transformers.BitsAndBytesConfig(**settings))


def _hqq(group_size: int = 64, nbits: int = 4):
    """HQQ's own linears put in place of the layers' projections (tests/models.hqq_in_place: transformers'
    HqqConfig loading is not available in every release), `nbits` in groups of `group_size`."""
    from hqq.core import quantize

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from models import hqq_in_place

    return lambda base: hqq_in_place(base(), quantize, nbits=nbits, group_size=group_size)


FORMS = {
    "torchao-int8": lambda: _torchao("Int8WeightOnlyConfig"),
    "bnb-nf4": lambda: _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "hqq-4bit": _hqq,
    "hqq-4bit-g128": lambda: _hqq(128),
    "quanto-int8": lambda: _quanto("qint8"),
    "bnb-int8": lambda: _bnb(load_in_8bit=True),
    "torchao-int4": lambda: _torchao("Int4WeightOnlyConfig", group_size=128),
    "torchao-float8": lambda: _torchao("Float8WeightOnlyConfig"),
    # quanto's 4/2-bit forms: bf16 int4 in groups of 128 is quanto's tinygemm tensor, whose decode steps read
    # copies of its codes (model/quanto_grouped.py); int2 stays quanto's plain tensor, read as stored.
    "quanto-int4": lambda: _quanto("qint4"),
    # lm_head left in bf16, as transformers' QuantoConfig leaves the output embeddings: on an H100 stock
    # generate crashed with the head quantized ("Expected A.is_contiguous()": its prefill hands lm_head
    # the last position's slice of the hidden states, which quanto's 4-bit kernel refuses, presumably).
    "quanto-int4-head-bf16": lambda: _quanto("qint4", exclude="lm_head"),
    "quanto-int2-head-bf16": lambda: _quanto("qint2", exclude="lm_head"),
    "bnb-fp4": lambda: _bnb(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.bfloat16),
    "hqq-2bit": lambda: _hqq(64, nbits=2),
    "hqq-3bit": lambda: _hqq(64, nbits=3),
    "hqq-8bit": lambda: _hqq(64, nbits=8),
}


def run_form(name: str, make, base, path, device, prompts, new: int, bandwidth: float | None,
             paths: tuple[str, ...] = ()) -> dict:
    row: dict = {"form": name}
    t = time.perf_counter()
    model = make(base, path, device) if getattr(make, "needs_checkpoint", False) else make(base)
    row["load_s"] = round(time.perf_counter() - t, 1)
    c = model.config
    weights = stored_bytes(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_step = len(prompts) * (len(prompts[0]) + new / 2) * 2 * c.num_hidden_layers * c.num_key_value_heads \
        * head_dim * 2
    floor_ms = None if bandwidth is None else (weights + kv_step) / bandwidth * 1e3
    row.update(weight_gib=round(weights / 2**30, 2), floor_ms_per_step=floor_ms and round(floor_ms, 3))
    ids = torch.tensor(prompts, device=device)
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
    try:
        stock_s, stock = timing.timed(lambda: model.generate(ids, batching="off", **options), device)
    except Exception as error:  # noqa: BLE001 - stock's own failure is reported; ours still runs
        stock_s, stock = None, None
        row["stock_error"] = f"{type(error).__name__}: {error}"[:300]
        print(f"  {name}: stock generate failed: {row['stock_error']}", flush=True)
    else:
        row["stock_s"] = round(stock_s, 3)
        print(f"  {name}: stock {stock_s:.2f} s", flush=True)
    phases.taken()
    first_call = lambda: model.generate(ids, batching="async", **options)  # noqa: E731
    if "first-profile" in paths:  # the first call under cProfile: its slowest functions, cumulative
        first_s, _ = timing.timed(lambda: _profiled(first_call, row), device)
    else:
        first_s, _ = timing.timed(first_call, device)
    row["first_call_phases"] = phases.taken()  # (where the first call's time went: tools/phases.py)
    ours_s, ours = timing.timed(lambda: model.generate(ids, batching="async", **options), device, unseen=model)
    tokens = len(prompts) * new
    row.update(first_call_s=round(first_s, 2), async_s=round(ours_s, 3), async_tok_s=round(tokens / ours_s),
               of_floor=floor_ms and round(tokens / ours_s / (len(prompts) / floor_ms * 1e3), 3), rows=len(prompts))
    if stock is not None:
        row.update(speedup=round(stock_s / ours_s, 2), stock_tok_s=round(tokens / stock_s),
                   rows_equal=int((stock == ours).all(dim=1).sum()))
        row["first_diff_p50"] = _first_difference(stock[:, ids.shape[1]:], ours[:, ids.shape[1]:])
    if "sync" in paths:  # our loop without the overlap, on the same runtime (its first call timed apart)
        timing.timed(lambda: model.generate(ids, batching="sync", **options), device, unseen=model)
        sync_s, sync = timing.timed(lambda: model.generate(ids, batching="sync", **options), device, unseen=model)
        row.update(sync_s=round(sync_s, 3),
                   sync_rows_equal=int((stock == sync).all(dim=1).sum()) if stock is not None else None)
    if "kernels" in paths:  # where a step's device time goes: one more async call, profiled
        row["kernels"] = top_kernels(lambda: model.generate(ids, batching="async", **options), device, new)
    from hf_async_cb.generate import runtime

    engine = getattr(runtime._RUNTIMES.get(model), "engine", None)
    if engine is not None:  # how it ran: CUDA graphs, and the projections the int8 and HQQ 4-bit GEMMs took
        graphs = engine.graphs
        row["cuda_graphs"] = graphs is not None
        if graphs is not None:  # (a capture that fails runs that shape eagerly: counted, not just enabled)
            row.update(graphs_captured=graphs.num_captured, graph_replays=graphs.num_replays,
                       graphs_failed=len(graphs.failed))
        gemms = engine.prepared_model.decode_gemms
        row["decode_gemms"] = gemms.summary() if gemms is not None else None
    if "quanto-own" in paths and name.startswith("quanto-int"):  # the A/B: quanto's own forward in every step
        # (after the summary above: the runtime is rebuilt without the grouped form)
        from hf_async_cb.model import quanto_grouped

        row["quanto_own_forward_async_s"] = _async_s_with(model, lambda: model.generate(ids, batching="async", **options),
                                                          device, quanto_grouped, "ROUTED", False)
    if "library-prefill" in paths:  # the A/B: grouped projections' prefill steps on the library's own forward
        from hf_async_cb.model import decode_gemm

        row["library_prefill_async_s"] = _async_s_with(model, lambda: model.generate(ids, batching="async", **options),
                                                       device, decode_gemm, "GROUPED_DENSE_ABOVE_MAX_M", False)
    hf_async_cb.release(model)
    if "hf-cb" in paths:  # transformers' own continuous batching on the same quantized model
        try:
            row["hf_cb_s"] = round(run_path("hf-cb", model, prompts, new).seconds, 3)
        except Exception as error:  # noqa: BLE001 - reported beside the row
            row["hf_cb_s"] = f"{type(error).__name__}: {error}"[:200]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _async_s_with(model, call, device: torch.device, module, name: str, value) -> float:
    """Seconds of `call` (prefix cache emptied, after one untimed call) with `module.name` set to `value`,
    on a runtime built for it (released before and after: the row's summary was read before)."""
    saved = getattr(module, name)
    hf_async_cb.release(model)
    setattr(module, name, value)
    try:
        timing.timed(call, device, unseen=model)
        seconds, _ = timing.timed(call, device, unseen=model)
        return round(seconds, 3)
    finally:
        setattr(module, name, saved)
        hf_async_cb.release(model)


def top_kernels(call, device: torch.device, steps: int, top: int = 12) -> list[dict]:
    """The `top` kernels by device time over one profiled `call` of about `steps` steps: name, calls
    and microseconds per step (CUDA graph replays show their kernels too)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    totals: dict[str, list] = {}
    for event in prof.events():
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals.setdefault(event.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(kernel=name, calls_per_step=round(n / steps, 1), us_per_step=round(us / steps, 1))
            for name, (n, us) in ranked]


def _profiled(call, row: dict, top: int = 20):
    """call() under cProfile: its `top` functions by cumulative time (row["first_call_profile"]) and by
    their own time (row["first_call_self"])."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    out = profile.runcall(call)
    stats = pstats.Stats(profile).stats
    for key, column in (("first_call_profile", 3), ("first_call_self", 2)):
        found = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[:top]
        row[key] = [f"{times[column]:8.2f} s {times[1]:>7} {file.rsplit('/', 1)[-1]}:{line} {name}"
                    for (file, line, name), times in found]
        print(f"  first call, by {'cumulative' if column == 3 else 'own'} time:", flush=True)
        for entry in row[key]:
            print("   ", entry, flush=True)
    return out


def _first_difference(a: torch.Tensor, b: torch.Tensor):
    """The median position of the first differing new token over rows that differ (None: none)."""
    differ = (a != b)
    rows = differ.any(dim=1)
    if not rows.any():
        return None
    return int(differ[rows].float().argmax(dim=1).median())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--budget", type=float, default=540.0, help="seconds; forms left after it are skipped")
    p.add_argument("--device", default="cuda", help="cpu: a check that the script runs (no floor)")
    p.add_argument("--paths", default="", help="also run beside async: sync, hf-cb, quanto-own (quanto's 4/2-bit "
                   "linears on their own forward: the grouped form's A/B), kernels (a profiled call: top "
                   "kernels per step), first-profile (the first call under cProfile: its slowest functions), "
                   "library-prefill (HQQ's and quanto's grouped projections' prefill steps on their own forward "
                   "instead of the weight rebuilt whole: kernels/grouped_dequant.py's A/B)")
    p.add_argument("--bnb-4bit-buckets", default=None,
                   help="rows buckets at which bitsandbytes' Linear4bit takes the codebook form (e.g. 2,4,8; "
                        "default: decode_gemm.BNB_4BIT_CUDA_BUCKETS)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.bnb_4bit_buckets is not None:
        from hf_async_cb.model import decode_gemm

        decode_gemm.BNB_4BIT_CUDA_BUCKETS = frozenset(int(b) for b in args.bnb_4bit_buckets.split(",") if b)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device = torch.device(args.device)
    phases.time_phases()
    bandwidth = copy_bandwidth(device)
    names = args.forms.split(",")
    constructors = {}
    for name in names:
        try:
            constructors[name] = FORMS[name]()
        except ImportError as error:
            constructors[name] = error

    def base():
        return build_model(args.shape, device, torch.bfloat16)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as path:
        if any(getattr(c, "needs_checkpoint", False) for c in constructors.values()):
            t = time.perf_counter()
            model = base()
            model.save_pretrained(path)
            del model
            gc.collect()
            torch.cuda.empty_cache()
            print(f"saved the {args.shape} model in {time.perf_counter() - t:.1f} s", flush=True)
        prompts = _prompts(args.requests, args.prompt, SHAPES[args.shape]["vocab_size"])
        for name in names:
            made = constructors[name]
            if time.perf_counter() - start > args.budget:
                rows.append({"form": name, "outcome": "skipped (budget)"})
                continue
            if isinstance(made, Exception):
                rows.append({"form": name, "outcome": f"not installed ({made})"})
                continue
            try:
                row = run_form(name, made, base, path, device, prompts, args.new, bandwidth,
                               tuple(x for x in args.paths.split(",") if x))
                row["outcome"] = "ran"
            except ValueError as error:  # a refusal by name
                row = {"form": name, "outcome": "refused", "reason": str(error).splitlines()[0][:300]}
            except Exception as error:  # noqa: BLE001 - reported
                row = {"form": name, "outcome": "CRASH", "reason": f"{type(error).__name__}: {error}"[:300]}
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"bandwidth_tb_s": bandwidth and bandwidth / 1e12, "shape": args.shape, "requests": args.requests,
                               "prompt": args.prompt, "new": args.new, "rows": rows}, f, indent=1)
    print("| form | weights GiB | stock s | hf-cb s | sync s | async s | speedup | of floor | first call s | rows equal |")
    for r in rows:
        if r.get("outcome") == "ran":
            print(f"| {r['form']} | {r['weight_gib']} | {r.get('stock_s', r.get('stock_error'))} | {r.get('hf_cb_s', '-')} | "
                  f"{r.get('sync_s', '-')} | {r['async_s']} | {r.get('speedup', '-')}x | {r['of_floor']} | {r['first_call_s']} | "
                  f"{r.get('rows_equal', '-')}/{r['rows']} |")
        else:
            print(f"| {r['form']} | {r['outcome']} {r.get('reason', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
