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
"""

from __future__ import annotations

import gc
import inspect
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from hf_async_cb.tools import bench

logger = logging.getLogger(__name__)

# ShareGPT-like lengths without the data set: lognormal prompt and output lengths (tokens), drawn
# again when outside [lo, hi] (vLLM's ShareGPT sampler drops such requests: prompts over 1024
# tokens, prompt + output over 2048, under 4 tokens). The medians are set so that the means after
# the cut are about those the vLLM paper gives for ShareGPT (161 prompt and 338 output tokens):
# ~161 and ~341. The spreads (sigma of the log) are chosen, not fitted: 1.0 for prompts (a heavy
# tail of long pasted contexts: p10 ~30, p90 ~370 tokens), 0.7 for outputs (p10 ~120, p90 ~650).
SHAREGPT = {"prompt": dict(median=108, sigma=1.0, lo=4, hi=1024),
            "output": dict(median=300, sigma=0.7, lo=4, hi=1024)}
LENGTHS = ("fixed", "uniform", "sharegpt")
WARMUPS = ("replay", "short")
SHORT_WARMUP = dict(requests=4, prompt=16, new=4)  # the "short" warm-up: all at once
PATHS = ("hf-cb-sync", "hf-cb-async", "sync", "async")
PEER_LIMIT_S = 150.0  # transformers' manager: its warm-up and timed run together (path_limit)
# What the CLI runs when no --lengths is given: ShareGPT-like on CUDA; on the CPU, where nothing is
# measured anyway, the short fixed lengths of bench's CPU workload.
DEFAULT_LENGTHS = {"cuda": "sharegpt", "cpu": "fixed"}


def default_lengths(device: torch.device) -> str:
    return DEFAULT_LENGTHS["cuda" if device.type == "cuda" else "cpu"]


@dataclass(frozen=True)
class Workload:
    """The requests of one run: prompt token ids, output lengths and arrival times (seconds after
    the run's start, non-decreasing). `rate` None: all at once."""

    prompts: list[list[int]]
    new: list[int]
    arrivals: list[float]
    rate: float | None
    lengths: str
    description: str
    system_prompt: int = 0  # tokens every prompt starts with (the same ones: a shared system prompt)

    def __len__(self) -> int:
        return len(self.prompts)


def arrival_times(requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests/s: exponential gaps of mean 1/rate,
    the first request at 0 (as vLLM sends its first request at once). rate inf: all at 0."""
    if not rate > 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(requests - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def _lognormal(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """`n` rounded lognormal draws in [lo, hi]: the ones outside are drawn again (a truncated lognormal)."""
    out = np.empty(0, dtype=np.int64)
    while len(out) < n:
        x = np.rint(np.exp(rng.normal(math.log(median), sigma, 2 * (n - len(out)) + 8))).astype(np.int64)
        out = np.concatenate([out, x[(x >= lo) & (x <= hi)]])
    return out[:n]


def draw_lengths(requests: int, lengths: str, prompt: int, new: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and output lengths per request. "fixed": `prompt` and `new` each; "uniform": integers
    drawn uniformly from [prompt // 2, prompt * 3 // 2] and [new // 2, new * 3 // 2] (at least 1),
    centred on the fixed lengths with the same mean; "sharegpt": SHAREGPT's truncated lognormals
    (`prompt` and `new` unused)."""
    if lengths == "fixed":
        return [prompt] * requests, [new] * requests
    rng = np.random.default_rng(seed)
    if lengths == "uniform":
        def uniform(n: int) -> list[int]:
            return rng.integers(max(1, n // 2), max(1, n * 3 // 2) + 1, requests).tolist()

        return uniform(prompt), uniform(new)
    if lengths == "sharegpt":
        return (_lognormal(rng, requests, **SHAREGPT["prompt"]).tolist(),
                _lognormal(rng, requests, **SHAREGPT["output"]).tolist())
    raise ValueError(f"unknown length distribution {lengths!r}: choose from {', '.join(LENGTHS)}")


def describe_lengths(lengths: str, prompt: int, new: int) -> str:
    if lengths == "fixed":
        return f"fixed: prompt {prompt} x {new} new"
    if lengths == "uniform":
        return (f"uniform: prompt {max(1, prompt // 2)}..{max(1, prompt * 3 // 2)} x "
                f"{max(1, new // 2)}..{max(1, new * 3 // 2)} new")
    p, o = SHAREGPT["prompt"], SHAREGPT["output"]
    return (f"sharegpt-like: lognormal prompt (median {p['median']}, sigma {p['sigma']}, {p['lo']}..{p['hi']}) x "
            f"new (median {o['median']}, sigma {o['sigma']}, {o['lo']}..{o['hi']})")


def make_workload(requests: int, vocab: int, rate: float = math.inf, lengths: str = "fixed", prompt: int = 128,
                  new: int = 256, seed: int = 0, system_prompt: int = 0) -> Workload:
    """N requests: arrivals, lengths and prompt token ids (in [3, vocab): clear of the special ids
    build_model gives) from three streams of `seed`. `system_prompt` tokens, the same for every
    request, come before each drawn prompt (what a chat service sends: a prefix cache's case)."""
    arrivals_seed, lengths_seed, tokens_seed = np.random.SeedSequence(seed).spawn(3)
    prompt_lens, new_lens = draw_lengths(requests, lengths, prompt, new, lengths_seed)
    arrivals = arrival_times(requests, rate, arrivals_seed)
    rng = np.random.default_rng(tokens_seed)
    shared = rng.integers(3, vocab, system_prompt).tolist()
    prompts = [shared + rng.integers(3, vocab, n).tolist() for n in prompt_lens]
    description = describe_lengths(lengths, prompt, new)
    if system_prompt:
        description = f"a shared {system_prompt}-token system prompt, then " + description
    return Workload(prompts, new_lens, arrivals, None if math.isinf(rate) else float(rate), lengths,
                    description, system_prompt)


# -- timings and metrics ----------------------------------------------------------------------------
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


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.perf_counter())


# -- the client: arrivals on time, one request at a time -----------------------------------------
def _drive(workload: Workload, submit: Callable[[int, Trace], None]) -> tuple[list[Trace], float]:
    """Submit request i at its arrival time (from this thread, sleeping in between); returns the
    traces (arrival: the stamp taken just before the submission) and the client's largest lag
    behind the schedule, in seconds (a client that cannot keep up delays arrivals, not TTFT)."""
    traces = [Trace(len(p), 0.0) for p in workload.prompts]
    lag = 0.0
    start = time.perf_counter()
    for i, at in enumerate(workload.arrivals):
        wait = start + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        traces[i].arrival = now = time.perf_counter()
        lag = max(lag, now - start - at)
        submit(i, traces[i])
    return traces, lag


def _decoding(sample: bool) -> dict:
    return bench.SAMPLING if sample else dict(do_sample=False)


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
        self.engine.start(mode)

    def counters(self) -> dict[str, int]:
        """Steps launched, graphs captured and graph steps run so far (what run_path reports per run)."""
        graphs = self.engine.graphs
        return {"steps": self.pipeline.num_steps, "captures": len(graphs) if graphs is not None else 0,
                "graph_steps": graphs.num_replays if graphs is not None else 0}

    def warm_up(self, workload: Workload, timeout: float | None = None, deadline: float | None = None) -> bool:
        """The replay warm-up (module docstring); whether it finished before `deadline`."""
        vocab = self.engine.vocab_size
        traces, _ = self.serve(fresh_prompts(workload, vocab), timeout, deadline)
        graphs = self.engine.graphs
        if graphs is not None:
            graphs.max_prefill_graphs = graphs.num_prefill_graphs  # the rest run eagerly: no capture in the run
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
        decoding = _decoding(self.sample)

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
                stamp(time.perf_counter())

            handles[i] = engine.add_request(workload.prompts[i],
                                            SamplingParams(max_new_tokens=workload.new[i], **decoding),
                                            on_token=on_token)

        traces, lag = _drive(workload, submit)
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


def hf_online_missing() -> str | None:
    """Why transformers' online continuous batching cannot be driven here; None when it can (the
    manager's add_request with record_timestamps, and continuous_batching_context_manager)."""
    try:
        from transformers import GenerationMixin
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError as error:
        return f"transformers has no continuous batching manager ({error})"
    if not hasattr(GenerationMixin, "continuous_batching_context_manager"):
        return "transformers' generation has no continuous_batching_context_manager"
    if "record_timestamps" not in inspect.signature(ContinuousBatchingManager.add_request).parameters:
        return "transformers' ContinuousBatchingManager.add_request does not record token timestamps"
    return None


class HFServer:
    """transformers' continuous batching manager, started (its own warm-up included); `serve` runs
    a workload through its add_request / get_result, with its per-token timestamps."""

    def __init__(self, model, path: str, config=None, sample: bool = False, sizing: Workload | None = None) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from hf_async_cb.config import BatchingConfig

        device = model.device
        options = {}
        if device.type == "cpu" and sizing is not None:
            # As bench: else it sizes its cache from the host's free RAM and its step for 8192
            # tokens. Pages for every request of `sizing` at once; our step budget.
            options["num_blocks"] = sum(-(-(len(p) + n) // bench.HF_PAGE) for p, n in zip(sizing.prompts, sizing.new))
            options["max_batch_tokens"] = (config or BatchingConfig()).for_device(device).max_batch_tokens
        page_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        cb = ContinuousBatchingConfig(use_async_batching=path.endswith("async"), **{page_key: bench.HF_PAGE}, **options)
        gcfg = GenerationConfig(max_new_tokens=max(sizing.new) if sizing else 16, eos_token_id=-1, pad_token_id=0,
                                **_decoding(sample))
        kwargs = dict(generation_config=gcfg, continuous_batching_config=cb, block=True, timeout=60)
        if sizing is not None and "workload_hints" in inspect.signature(model.continuous_batching_context_manager).parameters:
            from transformers.generation.continuous_batching.utils import WorkloadHints

            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, sizing.prompts)),
                                                     max_generated_length=max(sizing.new), num_requests=len(sizing))
        self._context = model.continuous_batching_context_manager(**kwargs)
        self.manager = self._context.__enter__()
        self._ids = 0
        self._vocab = model.config.vocab_size
        self.timed_out = False

    def counters(self) -> dict[str, int]:
        return {}

    def warm_up(self, workload: Workload, timeout: float | None = None, deadline: float | None = None) -> bool:
        """The replay (its own graph warm-up ran as it started); whether it finished before `deadline`."""
        traces, _ = self.serve(fresh_prompts(workload, self._vocab), timeout, deadline)
        return all(t.finished for t in traces)

    def serve(self, workload: Workload, timeout: float | None = None,
              deadline: float | None = None) -> tuple[list[Trace], float]:
        """As OurServer.serve: `timeout` for all the results (TimeoutError past it), none waited for
        past `deadline` (those left are marked unfinished, and the manager is hard-stopped at close)."""
        manager, ids = self.manager, {}

        def submit(i: int, trace: Trace) -> None:
            request_id = f"serve-{self._ids}"
            self._ids += 1
            ids[request_id] = i
            manager.add_request(workload.prompts[i], request_id=request_id, max_new_tokens=workload.new[i],
                                record_timestamps=True, eos_token_id=-1)

        traces, lag = _drive(workload, submit)
        limit = None if timeout is None else time.perf_counter() + timeout
        pending = set(ids)
        while pending:
            if deadline is not None and time.perf_counter() > deadline:
                for request_id in pending:
                    traces[ids[request_id]].finished = False
                self.timed_out = True
                break
            if limit is not None and time.perf_counter() > limit:
                raise TimeoutError(f"transformers' manager did not finish {len(pending)} requests within {timeout} s")
            result = manager.get_result(timeout=0.1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"transformers' manager stopped with {len(pending)} requests unfinished")
                continue
            if result.request_id not in pending:
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers' manager failed request {result.request_id}: {result.error}")
            pending.discard(result.request_id)
            trace = traces[ids[result.request_id]]
            trace.output_token_ids = list(result.generated_tokens)
            # A stamp per token it appends (and one for a token past the limit it drops).
            trace.token_times = list(result.timestamps or [])[: len(trace.output_token_ids)]
        return traces, lag

    def close(self) -> None:
        if self.timed_out:  # else its stop would first finish every request still queued
            self.manager.stop(block=True, timeout=30, hard_stop=True)
        self._context.__exit__(None, None, None)


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


def fresh_prompts(workload: Workload, vocab: int, seed: int = 1) -> Workload:
    """`workload` with other prompt tokens (the same lengths and arrivals): it meets the same step
    shapes, and leaves nothing in a prefix cache that the timed prompts could hit."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(workload)]))
    shared = rng.integers(3, vocab, workload.system_prompt).tolist()  # shared as the timed one's, other tokens
    return replace(workload, prompts=[shared + rng.integers(3, vocab, len(p) - workload.system_prompt).tolist()
                                      for p in workload.prompts])


def decode_buckets(workload: Workload, max_running: int) -> tuple[list[int], list[int]]:
    """The batch and context buckets of the decode steps `workload` can meet (cuda_graphs.py): batches
    of up to min(max_running, its requests) rows, contexts up to its longest prompt + output."""
    from hf_async_cb.engine.cuda_graphs import MIN_CONTEXT_BUCKET, _pow2

    batches = _pow2(min(max_running, len(workload)))
    contexts = max(MIN_CONTEXT_BUCKET, _pow2(max(len(p) + n for p, n in zip(workload.prompts, workload.new))))
    return ([1 << i for i in range(batches.bit_length())],
            [MIN_CONTEXT_BUCKET << i for i in range((contexts // MIN_CONTEXT_BUCKET).bit_length())])


def decode_grid(workload: Workload, max_running: int, step_tokens: int, vocab: int, seed: int = 2) -> list[Workload]:
    """Workloads (all at once, run one after the other) whose decode steps meet every bucket of
    `decode_buckets`: for batch b and context c, min(b, max_running) requests decode together, one
    of them with a c/2-token prompt (a decode step's context bucket is that of its longest
    request), the others with 4 tokens. They decode for as many steps as their prompts take to
    prefill at `step_tokens` a step, plus two: so all of them decode together at least once."""
    batches, contexts = decode_buckets(workload, max_running)
    rng = np.random.default_rng(seed)
    grid = []
    for c in contexts:
        for b in batches:
            n = min(b, max_running)
            lengths = [c // 2] + [4] * (n - 1)
            new = -(-(sum(lengths) + n) // step_tokens) + 2
            grid.append(Workload([rng.integers(3, vocab, k).tolist() for k in lengths], [new] * n, [0.0] * n, None,
                                 "fixed", f"decode bucket batch {b}, context {c}"))
    return grid


def short_warmup(vocab: int, seed: int = 0) -> Workload:
    n = SHORT_WARMUP
    return make_workload(n["requests"], vocab, math.inf, "fixed", n["prompt"], n["new"], seed + 1)


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


def _first_token_steps(traces: list[Trace]) -> dict | None:
    steps = [t.first_token_steps for t in traces if t.first_token_steps is not None]
    return None if not steps else {**_stats(steps, 1.0, ("mean", "p50", "p99")), "max": max(steps)}


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
    bench._sync(device)
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
        bench._sync(device)
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
                extra["first_token_steps"] = _first_token_steps(traces)
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
