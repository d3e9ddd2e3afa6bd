"""Where a step's time goes: kernel time by kind (GEMMs, attention, the rest) and each GEMM shape's
achieved bandwidth, from torch.profiler, so that the step tables of docs/benchmarks.md come from
one command (`python -m hf_async_cb bench --breakdown`).

Two profiled runs of the same workload on a held Engine, both after a warm-up:
1. as configured (CUDA graphs on): every kernel the steps launch, summed by kind, per step;
2. eager (no graphs), with input shapes recorded: each matrix product's shape and device time, so
   that bytes moved (both operands read once, the result written once) over time give its TB/s.
   Graph replays hide which operator launched a kernel, hence the second run; the kernels are the
   same in both.

On the CPU the same tables come from operator CPU times (no kernels, no bandwidth that means
anything): a smoke test of the code, not a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import torch

GEMM_OPS = ("aten::mm", "aten::addmm")
KINDS = ("GEMMs", "attention", "rest")


def kind_of(name: str) -> str:
    """The kind of a CUDA kernel or (on the CPU) an operator, by its name."""
    n = name.lower()
    if "paged_attention" in n or "merge_splits" in n or "scaled_dot_product" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "splitk", "aten::mm", "aten::addmm", "aten::bmm")):
        return "GEMMs"
    return "rest"


@dataclass
class GemmShape:
    """One matrix-product shape of a step: [m, k] x [k, n], its calls and device time per step."""

    m: int
    k: int
    n: int
    calls_per_step: float
    ms_per_step: float
    itemsize: int

    @property
    def bytes_per_call(self) -> int:
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.itemsize

    @property
    def tb_per_s(self) -> float:
        seconds = self.ms_per_step / 1e3
        return self.bytes_per_call * self.calls_per_step / seconds / 1e12 if seconds > 0 else float("nan")


def gemm_shapes(averages, steps: int, itemsize: int, on_cuda: bool) -> list[GemmShape]:
    """GEMM rows from profiler averages grouped by input shape (key_averages(group_by_input_shape=True))."""
    rows = []
    for avg in averages:
        if avg.key not in GEMM_OPS or not avg.input_shapes:
            continue
        shapes = [s for s in avg.input_shapes if len(s) == 2]
        if len(shapes) < 2:
            continue
        (m, k), (_, n) = shapes[-2], shapes[-1]
        total_us = avg.device_time_total if on_cuda else avg.self_cpu_time_total
        rows.append(GemmShape(m, k, n, avg.count / steps, total_us / 1e3 / steps, itemsize))
    return sorted(rows, key=lambda r: -r.ms_per_step)


def _profiled(engine, prompts, new: int, record_shapes: bool):
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    pipeline = engine.pipeline(engine.config.mode)
    before = pipeline.num_steps
    if on_cuda:
        torch.cuda.synchronize(engine.device)
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        engine.generate(prompts, max_new_tokens=new)
        if on_cuda:
            torch.cuda.synchronize(engine.device)
    return prof, pipeline.num_steps - before


def step_breakdown(model, prompts: list[list[int]], new: int, config) -> dict:
    """Both profiled runs (see the module docstring) on `model`; the report `format_breakdown` prints."""
    from hf_async_cb.engine.engine import Engine

    on_cuda = next(model.parameters()).device.type == "cuda"
    report = {"mode": config.mode, "requests": len(prompts), "prompt": len(prompts[0]), "new": new}
    with Engine(model, config) as engine:
        engine.generate(prompts, max_new_tokens=new)  # warm-up: captures, compiles
        prof, steps = _profiled(engine, prompts, new, record_shapes=False)
        totals: dict[str, float] = collections.defaultdict(float)
        kernels = 0
        for event in prof.events():
            if on_cuda:
                if event.device_type != torch.autograd.DeviceType.CUDA or "memcpy" in event.name.lower():
                    continue
                totals[kind_of(event.name)] += event.device_time_total / 1e3
                kernels += 1
            elif event.name.startswith("aten::"):
                totals[kind_of(event.name)] += event.self_cpu_time_total / 1e3
        report.update(steps=steps, kinds={k: totals[k] / max(steps, 1) for k in KINDS},
                      kernels_per_step=kernels / max(steps, 1) if on_cuda else None,
                      device=str(engine.device))
    eager = dataclasses.replace(config, cuda_graphs=False, prefill_graphs=False)
    with Engine(model, eager) as engine:
        engine.generate(prompts, max_new_tokens=new)
        prof, steps = _profiled(engine, prompts, new, record_shapes=True)
        itemsize = next(model.parameters()).element_size()
        rows = gemm_shapes(prof.key_averages(group_by_input_shape=True), max(steps, 1), itemsize, on_cuda)
    report["gemms"] = [dataclasses.asdict(r) | {"tb_per_s": r.tb_per_s, "bytes_per_call": r.bytes_per_call}
                       for r in rows]
    return report


def format_breakdown(report: dict) -> str:
    """Markdown: time per step by kind, then each GEMM shape with its achieved bandwidth."""
    steps = report["steps"]
    total = sum(report["kinds"].values()) or float("nan")
    unit = "kernel" if report.get("kernels_per_step") is not None else "operator (CPU)"
    lines = [f"{report['requests']} requests x prompt {report['prompt']} x {report['new']} new, {report['mode']} "
             f"on {report['device']}: {unit} time per step over {steps} steps (prefill included)",
             "| kind | ms/step | share |", "|---|---|---|"]
    for k in KINDS:
        lines.append(f"| {k} | {report['kinds'][k]:.3f} | {100 * report['kinds'][k] / total:.0f}% |")
    lines.append(f"| all | {total:.3f} | 100% |")
    if report.get("kernels_per_step") is not None:
        lines.append(f"\nkernels per step: {report['kernels_per_step']:.0f}")
    lines += ["", "GEMMs (eager run, shapes recorded): [m, k] x [k, n], bytes = both operands read once and the "
              "result written once", "| m x k x n | calls/step | ms/step | MB/call | TB/s |", "|---|---|---|---|---|"]
    for g in report["gemms"]:
        lines.append(f"| {g['m']} x {g['k']} x {g['n']} | {g['calls_per_step']:.1f} | {g['ms_per_step']:.3f} | "
                     f"{g['bytes_per_call'] / 1e6:.2f} | {g['tb_per_s']:.2f} |")
    return "\n".join(lines)
