"""The serving benchmark's "sync" / "async" paths (with bench's ablation suffixes): a held Engine
in online mode, each request added at its arrival and stamped token by token on the loop thread.
"""

from __future__ import annotations

import time
from dataclasses import replace

from hf_async_cb.tools import bench
from hf_async_cb.tools.serving_client import decoding_options, drive
from hf_async_cb.tools.serving_metrics import Trace
from hf_async_cb.tools.serving_warmup import decode_grid, fresh_prompts
from hf_async_cb.tools.serving_workload import Workload


def _bucket(key) -> str:
    """A graph bucket as text: batch x context x tokens, and what else sets it apart."""
    marks = [name for name in ("sampled", "tall", "shared") if getattr(key, name)]
    marks += ["penalty"] * (key.penalty is not None) + ["blocked"] * bool(key.blocked)
    return f"{key.batch}x{key.context}x{key.tokens}" + "".join(f" {m}" for m in marks)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.perf_counter())


class OurServer:
    """A held Engine with its loop started in `mode`; `serve` runs a workload against it."""

    def __init__(self, model, path: str, config=None, sample: bool = False) -> None:
        from hf_async_cb.config import BatchingConfig
        from hf_async_cb.engine.engine import Engine

        mode, changes = bench.our_path(path)
        config = config or BatchingConfig()
        if sample and config.seed is None:
            changes["seed"] = 0
        self.sample = sample
        self.engine = Engine(model, replace(config, mode=mode, progress=False, **changes))
        self.pipeline = self.engine.pipeline(mode)
        self.pipeline.stamp_first_builds = True  # TTFT split at the build of the step of the first token
        self.engine.start(mode)

    def counters(self) -> dict[str, int]:
        """Steps launched, graphs captured and graph steps run so far (what run_path reports per run)."""
        graphs = self.engine.graphs
        counts = {"steps": self.pipeline.num_steps, "captures": len(graphs) if graphs is not None else 0,
                  "graph_steps": graphs.num_replays if graphs is not None else 0}
        if graphs is not None:  # why steps ran eagerly (DecodeGraphs.eager), and decode steps lent a larger graph
            counts.update({f"eager_{why}": n for why, n in graphs.eager.items()}, lent_larger=graphs.num_lent_larger)
            # The buckets of the steps that ran eagerly for want of a captured one (keys as text: JSON).
            counts.update({f"bucket {_bucket(k)}": n for k, n in graphs.eager_buckets.items()})
        loop = self.engine._background
        worker = getattr(loop, "_worker", None)
        if worker is not None and worker.cadence is not None:  # late admission: why steps were (not) put off
            counts.update({f"late_{k}": getattr(worker, f"late_{k}") for k in ("waits", "queued", "unknown", "idled")})
        return counts

    def captured_prefill_buckets(self) -> list[str]:
        """The prefill/mixed buckets captured so far (what a timed run's eager steps missed)."""
        graphs = self.engine.graphs
        return [] if graphs is None else sorted(_bucket(k) for k in graphs._graphs if k.tokens)

    def warm_up(self, workload: Workload, timeout: float | None = None, deadline: float | None = None) -> bool:
        """The replay warm-up (tools/serving.py's docstring); whether it finished before `deadline`."""
        vocab = self.engine.vocab_size
        traces, _ = self.serve(fresh_prompts(workload, vocab), timeout, deadline)
        graphs = self.engine.graphs
        if graphs is not None:
            graphs.max_prefill_graphs = graphs.num_prefill_graphs  # the rest run eagerly: no capture in the run
            graphs.evict_after = 0  # (and no place changes hands)
            config = self.engine.config
            for group in decode_grid(workload, config.max_running_requests, config.max_batch_tokens, vocab):
                traces += self.serve(group, timeout, deadline)[0]
        return all(t.finished for t in traces)

    def serve(self, workload: Workload, timeout: float | None = None,
              deadline: float | None = None) -> tuple[list[Trace], float]:
        """Run `workload`; each result is waited for at most `timeout` s (TimeoutError past it), and
        none past `deadline` (a time.perf_counter() value): those left then are marked unfinished."""
        from hf_async_cb.engine.requests import SamplingParams

        engine, pipeline, handles = self.engine, self.pipeline, {}
        decoding = decoding_options(self.sample)

        def submit(i: int, trace: Trace) -> None:
            # The stamp runs on the loop thread, between steps: a clock read and an append per
            # token. A reader thread per request (iterating its handle) would instead wake on every
            # token and contend for the GIL with the loop it measures, and its wake-up delay would
            # land in the timestamps.
            stamp = trace.token_times.append
            submitted = pipeline.num_steps  # (read off the loop's thread: a step may be launching)

            def on_token(request, token) -> None:
                if trace.first_token_steps is None:
                    trace.first_token_steps = pipeline.num_steps - submitted
                    trace.first_build = request.first_build_s
                stamp(time.perf_counter())

            handles[i] = engine.add_request(workload.prompts[i],
                                            SamplingParams(max_new_tokens=workload.new[i], **decoding),
                                            on_token=on_token)

        traces, lag = drive(workload, submit)
        for i, trace in enumerate(traces):
            left = _remaining(deadline)
            by_deadline = left is not None and (timeout is None or left <= timeout)
            try:
                trace.output_token_ids = handles[i].result(left if by_deadline else timeout).output_token_ids
            except TimeoutError:
                if not by_deadline:
                    raise
                trace.finished = False
        return traces, lag

    def close(self) -> None:
        self.engine.close()  # the loop stopped (cancelling what a failed run left), the model given back
