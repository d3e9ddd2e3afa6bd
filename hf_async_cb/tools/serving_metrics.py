"""What a serving run reports: each request's timestamps (Trace) in; the metrics vLLM's serving
benchmark gives (summarize: throughput, TTFT, ITL, E2E) and their markdown table out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hf_async_cb.tools import bench


@dataclass
class Trace:
    """One request's timestamps (time.perf_counter seconds): when the client submitted it and when
    each output token became visible."""

    prompt_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    finished: bool = True  # False: it had not finished when its run's time limit came
    first_token_steps: int | None = None  # ours: steps launched from its submission to its first token
    first_build: float | None = None  # ours: when the step that sampled its first token was built

    @property
    def finish(self) -> float:
        return self.token_times[-1]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival


def _stats(values, scale: float, keys=("mean", "p50", "p90", "p99")) -> dict[str, float | None]:
    """Mean and percentiles (numpy's, linearly interpolated, as vLLM's) times `scale`; None when empty."""
    values = np.asarray(values, dtype=np.float64)
    out = {}
    for key in keys:
        if not len(values):
            out[key] = None
        elif key == "mean":
            out[key] = float(values.mean() * scale)
        else:
            out[key] = float(np.percentile(values, int(key[1:])) * scale)
    return out


def summarize(traces: list[Trace]) -> dict:
    """The run's metrics, over requests that produced at least one token:

    - duration_s: last request's finish − first request's arrival; a request finishes at its last
      token's time.
    - request_throughput: requests / duration_s; output_throughput: output tokens / duration_s;
      total_token_throughput: (prompt + output tokens) / duration_s.
    - ttft_ms: per request, first token's time − arrival (queueing and prefill included); mean,
      p50, p90, p99 over requests.
    - itl_ms: the gaps between consecutive tokens of one request (tokens − 1 per request), pooled
      over all requests; mean, p50, p90, p99.
    - e2e_s: per request, last token's time − arrival; mean, p50, p99.
    """
    done = [t for t in traces if t.token_times and t.finished]
    if not done:
        raise ValueError("no request finished with a token")
    duration = max(t.finish for t in done) - min(t.arrival for t in done)
    outputs = sum(len(t.token_times) for t in done)
    prompts = sum(t.prompt_tokens for t in done)
    return {
        "requests": len(done), "failed": len(traces) - len(done), "duration_s": duration,
        "output_tokens": outputs, "prompt_tokens": prompts,
        "request_throughput": len(done) / duration, "output_throughput": outputs / duration,
        "total_token_throughput": (prompts + outputs) / duration,
        "ttft_ms": _stats([t.ttft for t in done], 1e3),
        "itl_ms": _stats([gap for t in done for gap in t.itls], 1e3),
        "e2e_s": _stats([t.e2e for t in done], 1.0, ("mean", "p50", "p99")),
    }


def empty_summary(traces: list[Trace]) -> dict:
    """`summarize`'s keys for a run in which no request finished: counts, and None for the rest."""
    stats = {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"requests": 0, "failed": len(traces), "duration_s": None, "output_tokens": 0, "prompt_tokens": 0,
            "request_throughput": None, "output_throughput": None, "total_token_throughput": None,
            "ttft_ms": dict(stats), "itl_ms": dict(stats), "e2e_s": {"mean": None, "p50": None, "p99": None}}


def first_token_step_stats(traces: list[Trace]) -> dict | None:
    """Ours: the steps launched from each request's submission to its first token (mean, p50, p99,
    max); None when no trace counted them (transformers' manager)."""
    steps = [t.first_token_steps for t in traces if t.first_token_steps is not None]
    return None if not steps else {**_stats(steps, 1.0, ("mean", "p50", "p99")), "max": max(steps)}


def ttft_split(traces: list[Trace]) -> dict | None:
    """Ours: each TTFT split where the step that sampled the first token was built, in ms (p50, p99):
    `to_build` from the submission (the wait for admission: the step running, the loop's schedule),
    `after_build` to the token seen (that step's launch and run, and the delivery); None when no
    trace has it (transformers' manager)."""
    split = [(t.first_build - t.arrival, t.token_times[0] - t.first_build) for t in traces
             if t.first_build is not None and t.token_times]
    if not split:
        return None
    return {name: _stats([s[i] for s in split], 1e3, ("p50", "p99")) for i, name in enumerate(("to_build", "after_build"))}


# -- the table ---------------------------------------------------------------------------------------
def _ms(stats: dict, key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{value:,.1f}"


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = (
    ("req/s", lambda r: _number(r["request_throughput"], ".2f")),
    ("out tok/s", lambda r: _number(r["output_throughput"], ",.0f")),
    ("total tok/s", lambda r: _number(r["total_token_throughput"], ",.0f")),
    ("TTFT p50 ms", lambda r: _ms(r["ttft_ms"], "p50")),
    ("TTFT p90 ms", lambda r: _ms(r["ttft_ms"], "p90")),
    ("TTFT p99 ms", lambda r: _ms(r["ttft_ms"], "p99")),
    ("ITL p50 ms", lambda r: _ms(r["itl_ms"], "p50")),
    ("ITL p90 ms", lambda r: _ms(r["itl_ms"], "p90")),
    ("ITL p99 ms", lambda r: _ms(r["itl_ms"], "p99")),
    ("E2E p50 s", lambda r: _number(r["e2e_s"]["p50"], ".3f")),
    ("E2E p99 s", lambda r: _number(r["e2e_s"]["p99"], ".3f")),
    ("warm-up s", lambda r: _number(r["warmup_s"], ".2f")),
    ("captures in run", lambda r: _number(r.get("extra", {}).get("graphs_captured_in_run"), "d")),
    ("note", lambda r: r.get("note") or ""),
)


def format_table(report: dict) -> str:
    """A markdown table, a row per path, under a line naming the workload and the device."""
    rate = report["rate"]
    arrival = "all at once" if rate is None else f"Poisson {rate:g} req/s"
    sampled = f", sampled {bench.SAMPLING}" if report.get("sample") else ""
    lines = [
        f"{report['shape']}, {report['requests']} requests, arrival {arrival}, lengths "
        f"{report['length_description']} (mean prompt {report['mean_prompt']:.0f}, mean new "
        f"{report['mean_new']:.0f}){sampled}, {report['dtype']} on {report['gpu']}; warm-up: {report['warmup']}",
        "| path | " + " | ".join(title for title, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for r in report["results"]:
        lines.append(f"| {r['path']} | " + " | ".join(cell(r) for _, cell in COLUMNS) + " |")
    return "\n".join(lines)
