"""The serving benchmark: requests arriving over time at a held engine, timed token by token.

The batch benchmark (tools/bench.py) hands a whole workload over at once and measures throughput.
A server sees something else: requests arrive one by one while others run, each with its own
prompt and output length, and what its users feel is latency: how long until the first token
(TTFT), how steady the tokens come after it (ITL), how long the whole answer takes (E2E). This
module measures those as vLLM's serving benchmark does, on random weights in real shapes
(bench.build_model):

- Workload (`make_workload`): N requests; arrivals all at once (rate inf) or a Poisson process of
  `rate` requests/s (exponential gaps from a seeded generator, the first request at 0); prompt and
  output lengths "fixed", "uniform" or "sharegpt" (LENGTHS); prompt tokens random ids. Arrivals,
  lengths and tokens come from separate seeded streams: changing the rate keeps the requests.
- Paths: "sync" / "async" (ours, on a held Engine in online mode: `start`, `add_request` at each
  arrival from the client thread, the handles' results, `shutdown`), with bench's ablation suffixes
  ("async-eager"), and "hf-cb-sync" / "hf-cb-async": transformers' own continuous batching driven
  the same way through its online manager (`continuous_batching_context_manager`, `add_request`
  with `record_timestamps`, `get_result`), where the installed transformers has it (5.17 and later
  do) and the device can run it. A stock `generate` has no notion of arrivals: it is not a path.
- Timestamps: ours stamp each token in `add_request`'s `on_token` callback, on the engine's loop
  thread, the moment the token reaches its handle; transformers' manager stamps each token on its
  own loop thread as it appends it (`record_timestamps`). Both are when a streaming client could
  first see the token, taken on one clock (time.perf_counter) with the client's arrival stamps.
- Warm-up (WARMUPS): before the timed run, on the same engine or manager, "replay" runs the timed
  workload once (its arrivals and lengths, other prompt tokens: a prefix cache, ours or
  transformers' block sharing, must not serve the timed prompts), "short" a few short requests.
  Graph buckets are captured on first use and depend on how the arrivals interleave, so after the
  replay ours run `decode_grid` (a decode step of every (batch, context) bucket the run can meet)
  and capture no new prefill bucket (those the replay did not meet run eagerly): a warmed run
  captures nothing. Ours report the captures and eager steps during the timed run, and per request
  the steps launched between its submission and its first token. The warm-up time reported runs
  from building the engine (or manager) to the end of the warm-up requests.
- Time limits: a path whose warm-up or timed run outlasts its limit (PEER_LIMIT_S for
  transformers' manager) gets a row all the same, over the requests that finished, with a note;
  so does a path that fails.
- Metrics (`summarize`, exact definitions there) and a markdown table (`format_table`).

The parts, each in a module of its own (every name stays importable from here): the workload
(serving_workload.py), the warm-ups (serving_warmup.py), the client submitting on schedule
(serving_client.py), our Engine's paths (serving_engine.py), transformers' manager's
(serving_hf_cb.py), the metrics and their table (serving_metrics.py). This module runs the paths.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_async_cb.tools import bench, timing
from hf_async_cb.tools.serving_engine import OurServer
from hf_async_cb.tools.serving_hf_cb import HFServer, hf_online_missing
from hf_async_cb.tools.serving_metrics import (COLUMNS, Trace, empty_summary, first_token_step_stats, format_table,
                                               summarize, ttft_split)
from hf_async_cb.tools.serving_warmup import (SHORT_WARMUP, WARMUPS, decode_buckets, decode_grid, fresh_prompts,
                                              short_warmup)
from hf_async_cb.tools.serving_workload import (DEFAULT_LENGTHS, LENGTHS, SHAREGPT, Workload, arrival_times,
                                                default_lengths, describe_lengths, draw_lengths, make_workload)

__all__ = ["COLUMNS", "DEFAULT_LENGTHS", "HFServer", "LENGTHS", "OurServer", "PATHS", "PEER_LIMIT_S", "PathRun",
           "SHAREGPT", "SHORT_WARMUP", "Trace", "WARMUPS", "Workload", "arrival_times", "check_paths",
           "decode_buckets", "decode_grid", "default_lengths", "describe_lengths", "draw_lengths", "empty_summary",
           "format_table", "fresh_prompts", "hf_online_missing", "make_workload", "open_server", "path_limit", "run",
           "run_path", "runnable_paths", "short_warmup", "summarize"]

logger = logging.getLogger(__name__)

PATHS = ("hf-cb-sync", "hf-cb-async", "sync", "async")
PEER_LIMIT_S = 150.0  # transformers' manager: its warm-up and timed run together (path_limit)


def check_paths(paths) -> None:
    for path in paths:
        if path not in PATHS and bench.our_path(path) is None:
            raise ValueError(f"unknown serving path {path!r}: choose from {', '.join(PATHS)} "
                             f"(sync, async with {bench.ablation_suffixes()})")


def runnable_paths(paths, device: torch.device) -> tuple[tuple[str, ...], list[str]]:
    """The paths that can run on `device` with the installed transformers, and a note for each one left out."""
    missing = hf_online_missing()
    kept, notes = [], []
    for path in paths:
        if path.startswith("hf-cb-") and missing is not None:
            notes.append(f"skipped {path}: {missing}")
        elif path == "hf-cb-async" and device.type not in bench.HF_ASYNC_DEVICES:
            notes.append(f"skipped {path}: transformers' async batching needs a device in {bench.HF_ASYNC_DEVICES}, "
                         f"not {device.type}")
        else:
            kept.append(path)
    return tuple(kept), notes


def open_server(path: str, model, config=None, sample: bool = False, sizing: Workload | None = None):
    """The started engine or manager of `path`; `sizing`: the largest workload it will serve."""
    if path.startswith("hf-cb-"):
        return HFServer(model, path, config, sample, sizing)
    return OurServer(model, path, config, sample)


@dataclass
class PathRun:
    path: str
    traces: list[Trace]
    warmup_s: float | None
    extra: dict = field(default_factory=dict)
    note: str | None = None  # why some requests (or the timed run) are missing: a time limit, a failure

    def row(self) -> dict:
        finished = any(t.token_times and t.finished for t in self.traces)
        metrics = summarize(self.traces) if finished else empty_summary(self.traces)
        return {"path": self.path, "warmup_s": self.warmup_s, **metrics, "extra": self.extra, "note": self.note}


def path_limit(path: str, peer_limit_s: float | None = None) -> float | None:
    """Seconds a path's warm-up and timed run may take together: `peer_limit_s` (None: PEER_LIMIT_S)
    for transformers' manager (on a slow host it can take minutes), none for ours (their `timeout`
    still applies)."""
    if not path.startswith("hf-cb-"):
        return None
    return PEER_LIMIT_S if peer_limit_s is None else peer_limit_s


def run_path(path: str, model, workload: Workload, config=None, sample: bool = False, warmup: str = "replay",
             timeout: float | None = 600.0, limit_s: float | None = None) -> PathRun:
    """Start `path`, warm it up (WARMUPS), serve `workload` timed, stop it. `timeout`: seconds to wait
    for a run's results before TimeoutError; `limit_s`: seconds from the start for the warm-up and
    the timed run together, past which what finished is reported (with a note) instead."""
    if warmup not in WARMUPS:
        raise ValueError(f"unknown warm-up {warmup!r}: choose from {', '.join(WARMUPS)}")
    device = model.device
    gc.collect()  # the previous path's pool and graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    timing.sync(device)
    start = time.perf_counter()
    server = open_server(path, model, config, sample, sizing=workload)
    deadline = None if limit_s is None else start + limit_s
    extra: dict = {}
    note = None
    try:
        if warmup == "replay":
            warmed = server.warm_up(workload, timeout, deadline)
        else:
            warmed = all(t.finished for t in server.serve(short_warmup(model.config.vocab_size), timeout, deadline)[0])
        timing.sync(device)
        warmup_s = time.perf_counter() - start
        if not warmed:
            traces = [Trace(len(p), 0.0, finished=False) for p in workload.prompts]
            note = f"the warm-up did not finish within the {limit_s:g} s limit: no timed run"
        else:
            before = server.counters()
            traces, lag = server.serve(workload, timeout, deadline)
            after = server.counters()
            extra["client_lag_ms"] = lag * 1e3
            if before:
                extra["graphs_captured_in_run"] = after["captures"] - before["captures"]
                extra["steps_in_run"] = after["steps"] - before["steps"]
                extra["eager_steps_in_run"] = extra["steps_in_run"] - (after["graph_steps"] - before["graph_steps"])
                extra["first_token_steps"] = first_token_step_stats(traces)
                extra["ttft_split_ms"] = ttft_split(traces)
                extra.update({k: after[k] - before.get(k, 0) for k in after
                              if k.startswith(("late_", "eager_")) or k == "lent_larger"})
                missed = {k[len("bucket "):]: after[k] - before.get(k, 0) for k in after if k.startswith("bucket ")}
                if any(missed.values()):  # the buckets of the eager prefill steps, and those captured
                    extra["missed_buckets"] = {k: n for k, n in sorted(missed.items(), key=lambda kv: -kv[1]) if n}
                    extra["captured_prefill_buckets"] = server.captured_prefill_buckets()
            unfinished = sum(not t.finished for t in traces)
            if unfinished:
                note = f"{unfinished}/{len(traces)} requests not finished within the {limit_s:g} s limit"
    finally:
        server.close()
    return PathRun(path, traces, warmup_s, extra, note)


def run(shape: str, requests: int, rate: float = math.inf, lengths: str = "sharegpt", prompt: int = 128,
        new: int = 256, paths=("sync", "async"), device=None, dtype=None, config=None, sample: bool = False,
        warmup: str = "replay", seed: int = 0, model=None, peer_limit_s: float | None = None,
        system_prompt: int = 0) -> dict:
    """Every path on one serving workload; the report `format_table` prints (json-serialisable:
    rate None is all at once). `model`: one already built for `shape` on `device` (else built here);
    `peer_limit_s`: transformers' manager's time limit (None: PEER_LIMIT_S)."""
    check_paths(paths)
    device = torch.device(device) if device is not None else bench.default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if model is None:
        model = bench.build_model(shape, device, dtype)
    workload = make_workload(requests, model.config.vocab_size, rate, lengths, prompt, new, seed, system_prompt)
    results = []
    for path in paths:
        try:
            results.append(run_path(path, model, workload, config, sample, warmup,
                                    limit_s=path_limit(path, peer_limit_s)).row())
        except Exception as error:  # noqa: BLE001 - a peer's failure is its row's note; ours raise
            if not path.startswith("hf-cb-"):
                raise
            logger.exception("serving path %s failed", path)
            failed = [Trace(len(p), 0.0, finished=False) for p in workload.prompts]
            reason = str(error).splitlines()[0] if str(error) else ""
            results.append(PathRun(path, failed, None, note=f"failed: {type(error).__name__}: {reason}").row())
    return {"shape": shape, "requests": requests, "rate": workload.rate, "lengths": lengths, "system_prompt": system_prompt,
            "length_description": workload.description, "prompt": prompt, "new": new, "seed": seed,
            "mean_prompt": float(np.mean([len(p) for p in workload.prompts])),
            "mean_new": float(np.mean(workload.new)), "sample": sample, "warmup": warmup, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "results": results}
