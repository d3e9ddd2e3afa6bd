#!/usr/bin/env python
"""A long soak of the online API (Engine.start / add_request / abort / shutdown), for the GPU machine.

    python benchmarks/gpu_soak.py --minutes 3                         # tiny llama shape, fp32, on CUDA
    python benchmarks/gpu_soak.py --minutes 10 --shape llama3.2-1b    # a real shape, random weights
    python benchmarks/gpu_soak.py --minutes 0.5 --device cpu          # the same checks on the CPU

Producer threads submit random requests while others run (random prompts and lengths; greedy, or
sampled with random temperature / top-k / top-p / min-p, seeded or not; now and then a repetition
penalty, min_new_tokens, suppressed tokens; EOS or not), keeping a bounded backlog, and another
thread aborts a random share of them at random moments (still queued, running, or already done).
At the end every request is checked:
- none lost (each handle done, with a finish reason) or duplicated (request ids unique, the
  streamed tokens are exactly the output tokens); ABORTED only where an abort was sent;
- its stop agrees with its parameters: at most max_new_tokens, LENGTH at exactly that many, an
  EOS token only as the last token (never before min_new_tokens), no suppressed token;
- every greedy request is re-run in sync mode (the non-overlapped loop, in other batches) and must
  give the same tokens (a prefix of them, for an aborted one). Logits computed in other batch
  shapes may round differently, so a divergence is accepted only at a near-tie: where a plain
  forward of the model (outside the engine) puts the two picks' logits within --tie-tolerance of
  each other; those are counted and printed;
- seeded sampled requests are re-run too: their draws do not depend on the batch, so they must
  match as well, except at near-ties (which cannot be told apart for sampled tokens): in float32,
  more than max(2, 2%) of them differing is a failure (in half precision they are only counted);
- afterwards no KV page is held, no loop thread (nor any other new thread) is alive.
Prints a summary (requests done / aborted, tokens/s, pages leaked, threads alive) and exits with
status 1 on any failure. It finishes within --minutes: submissions stop at about 35% of the time
left after the warm-up, and the sync re-check stops at the deadline, saying how many it left.

tests/test_gpu_reliability.py runs a short soak through run_soak() on CUDA.
"""

from __future__ import annotations

import time

_STARTED = time.monotonic()  # --minutes counts from here, imports included

import argparse  # noqa: E402
import functools  # noqa: E402
import heapq  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable as a script from anywhere

from hf_async_cb import BatchingConfig, Engine, FinishReason, SamplingParams  # noqa: E402
from hf_async_cb.engine.requests import RequestOutput  # noqa: E402
from hf_async_cb.tools.bench import build_model  # noqa: E402

LOOP_THREAD = "hf_async_cb-loop"

# Per shape: prompt and output lengths, and the engine's budgets.
SHAPE_DEFAULTS = {
    "tiny": dict(max_prompt=96, max_new=64, max_running=64, max_batch_tokens=256),
    "llama3.2-1b": dict(max_prompt=512, max_new=128, max_running=128, max_batch_tokens=1024),
}


@dataclass
class Work:
    prompt: list[int]
    params: SamplingParams
    abort_after: float | None  # seconds after its submission at which an abort is sent; None: never


def make_work(index: int, *, seed: int, vocab: int, max_prompt: int, max_new: int, abort_share: float) -> Work:
    """Request `index` of the workload: a function of (seed, index) alone, whatever the thread timing."""
    rng = random.Random(seed * 1_000_003 + index)
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
    new = rng.randint(1, max_new)
    kw: dict = {}
    if rng.random() < 0.5:
        kw.update(do_sample=True, temperature=rng.choice([0.5, 0.8, 1.0, 1.3]), top_k=rng.choice([0, 1, 8, 50]),
                  top_p=rng.choice([1.0, 0.95, 0.6]), min_p=rng.choice([0.0, 0.0, 0.05]),
                  seed=index if rng.random() < 0.7 else None)
    if rng.random() < 0.1:
        kw["repetition_penalty"] = rng.choice([0.9, 1.2, 1.5])
    if rng.random() < 0.1:
        kw["min_new_tokens"] = rng.randint(1, new)
    if rng.random() < 0.05:
        kw["suppress_tokens"] = tuple(rng.randrange(3, vocab) for _ in range(3))
    if rng.random() < 0.05:
        kw["begin_suppress_tokens"] = tuple(rng.randrange(3, vocab) for _ in range(3))
    if rng.random() < 0.5:
        kw["eos_token_ids"] = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 2)))
    else:  # named, not the model's default: the checks below read the ids
        kw["eos_token_ids"] = ()
    abort_after = None
    if rng.random() < abort_share:
        abort_after = rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.5)])
    return Work(prompt, SamplingParams(max_new_tokens=new, **kw), abort_after)


@dataclass
class Submitted:
    index: int
    work: Work
    handle: object  # hf_async_cb.engine.request_handle.RequestHandle
    abort_sent: bool = False


@dataclass
class Report:
    submitted: int = 0
    finished: int = 0  # ended by EOS or length
    aborted: int = 0
    failed: int = 0  # a step's error, or lost
    cancelled: int = 0  # still running at the results deadline: aborted by the shutdown
    tokens: int = 0
    online_s: float = 0.0
    check_s: float = 0.0
    preemptions: int = 0
    greedy_checked: int = 0
    greedy_ties: int = 0
    seeded_checked: int = 0
    seeded_differ: int = 0
    unchecked: int = 0  # re-runs left out at the deadline
    pages_leaked: int = 0
    loop_threads_alive: int = 0
    stray_threads: list[str] = field(default_factory=list)
    ties: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.online_s, 1e-9)

    def summary(self) -> str:
        lines = [
            f"requests: {self.submitted} submitted, {self.finished} finished, {self.aborted} aborted, "
            f"({self.cancelled} by the shutdown at the deadline), {self.failed} failed or lost",
            f"tokens: {self.tokens:,} generated online in {self.online_s:.1f} s ({self.tokens_per_s:,.0f} tok/s), "
            f"{self.preemptions} preemptions",
            f"sync re-check: {self.greedy_checked} greedy ({self.greedy_ties} near-tie divergences), "
            f"{self.seeded_checked} seeded ({self.seeded_differ} differ), {self.unchecked} left unchecked (time); "
            f"{self.check_s:.1f} s",
            f"pages leaked: {self.pages_leaked}; loop threads alive: {self.loop_threads_alive}; "
            f"other new threads alive: {len(self.stray_threads)} {self.stray_threads or ''}".rstrip(),
        ]
        lines += [f"  near-tie: {t}" for t in self.ties[:10]]
        if self.problems:
            lines.append(f"FAIL: {len(self.problems)} problem(s)")
            lines += [f"  {p}" for p in self.problems[:30]]
        else:
            lines.append("PASS")
        return "\n".join(lines)


def first_divergence(got: RequestOutput, ref: RequestOutput, prefix: bool) -> tuple[int | None, str]:
    """`got` against its sync re-run `ref`, all of it or (prefix) its start: (index of the first
    differing token, "") or (None, "") if they agree, or (None, what else disagrees)."""
    a, b = got.output_token_ids, ref.output_token_ids
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j, ""
    if prefix and len(a) <= len(b):
        return None, ""
    if not prefix and len(a) == len(b) and got.finish_reason == ref.finish_reason:
        return None, ""
    return None, f"{len(a)} tokens ({got.finish_reason}) vs sync {len(b)} ({ref.finish_reason})"


@torch.no_grad()
def logit_gap(model: torch.nn.Module, context: list[int], a: int, b: int, params: SamplingParams) -> float:
    """|logit(a) - logit(b)| after `context`, from a plain forward of the model (an oracle outside the
    engine), with the request's repetition penalty applied as stock applies it."""
    logits = model(input_ids=torch.tensor([context], device=model.device)).logits[0, -1].float()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(context)), device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked < 0, picked * params.repetition_penalty, picked / params.repetition_penalty)
    return abs(logits[a] - logits[b]).item()


def check_output(entry: Submitted, out: RequestOutput, streamed: list[int]) -> list[str]:
    """What must hold for any request, whatever its sampling."""
    p, toks, name = entry.work.params, out.output_token_ids, f"request {entry.index}"
    problems = []
    if out.prompt_token_ids != entry.work.prompt:
        problems.append(f"{name}: its prompt changed")
    if streamed != toks:
        problems.append(f"{name}: streamed {len(streamed)} tokens {streamed[:8]}..., output {len(toks)} {toks[:8]}...")
    if out.finish_reason is FinishReason.ABORTED:
        if not entry.abort_sent:
            problems.append(f"{name}: ABORTED but no abort was sent")
    elif out.finish_reason not in (FinishReason.EOS, FinishReason.LENGTH):
        problems.append(f"{name}: finish reason {out.finish_reason}")
    if len(toks) > p.max_new_tokens:
        problems.append(f"{name}: {len(toks)} tokens > max_new_tokens {p.max_new_tokens}")
    if out.finish_reason is FinishReason.LENGTH and len(toks) != p.max_new_tokens:
        problems.append(f"{name}: LENGTH at {len(toks)} of {p.max_new_tokens} tokens")
    eos_at = [j for j, t in enumerate(toks) if t in p.eos_token_ids]
    if out.finish_reason is FinishReason.EOS and eos_at != [len(toks) - 1]:
        problems.append(f"{name}: EOS finish with EOS tokens at {eos_at} of {len(toks)}")
    if out.finish_reason is not FinishReason.EOS and eos_at:
        problems.append(f"{name}: EOS token at {eos_at} but finished {out.finish_reason}")
    if eos_at and eos_at[0] < p.min_new_tokens:
        problems.append(f"{name}: EOS at token {eos_at[0]} < min_new_tokens {p.min_new_tokens}")
    if any(t in p.suppress_tokens for t in toks):
        problems.append(f"{name}: a suppressed token was generated")
    if toks and toks[0] in p.begin_suppress_tokens:
        problems.append(f"{name}: a begin-suppressed token came first")
    return problems


def warm_up(engine: Engine, make: Callable[[int], Work], n: int = 16) -> None:
    """Compile the kernels and capture the graphs that the soak's first steps would otherwise wait for."""
    works = [make(10**9 + k) for k in range(n)]  # outside the soak's indices
    for mode in ("async", "sync"):
        engine.generate([w.prompt for w in works], [w.params for w in works], mode=mode)


def run_soak(engine: Engine, make: Callable[[int], Work], *, requests: int, submit_until: float,
             results_until: float, check_until: float, tie_tolerance: float, producers: int = 2,
             backlog: int = 64, rerun_chunk: int = 256) -> Report:
    """Run the soak on `engine` (not started; warmed up) and check it. Times are time.monotonic() values:
    submissions stop at `submit_until` (or after `requests`), results are awaited until
    `results_until`, the sync re-check stops at `check_until`."""
    report = Report()
    threads_before = set(threading.enumerate())
    submitted: list[Submitted] = []
    lock = threading.Lock()
    next_index = iter(range(requests))
    aborts: list[tuple[float, int, Submitted]] = []  # heap of (due time, index, entry)
    producers_done = threading.Event()
    helper_errors: list[str] = []

    def produce(k: int) -> None:
        rng = random.Random(7919 * k + 1)
        pending: list = []
        try:
            while time.monotonic() < submit_until:
                pending = [h for h in pending if not h.done]
                if len(pending) >= max(1, backlog // producers):
                    time.sleep(0.001)
                    continue
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                work = make(i)
                entry = Submitted(i, work, engine.add_request(work.prompt, work.params))
                with lock:
                    submitted.append(entry)
                    if work.abort_after is not None:
                        heapq.heappush(aborts, (time.monotonic() + work.abort_after, i, entry))
                pending.append(entry.handle)
                if rng.random() < 0.05:  # bursts and lulls
                    time.sleep(rng.uniform(0.0, 0.01))
        except BaseException as error:  # noqa: BLE001 - reported as a problem
            helper_errors.append(f"producer {k}: {error!r}")

    def abort_loop() -> None:
        try:
            while True:
                now = time.monotonic()
                with lock:
                    due = []
                    while aborts and aborts[0][0] <= now:
                        due.append(heapq.heappop(aborts)[2])
                    drained = not aborts
                for entry in due:
                    entry.abort_sent = True  # before the call: an ABORTED output always finds it set
                    engine.abort(entry.handle)
                if producers_done.is_set() and drained and not due:
                    return
                time.sleep(0.0005)
        except BaseException as error:  # noqa: BLE001
            helper_errors.append(f"aborter: {error!r}")

    engine.start()
    start = time.monotonic()
    workers = [threading.Thread(target=produce, args=(k,), name=f"soak-producer-{k}") for k in range(producers)]
    aborter = threading.Thread(target=abort_loop, name="soak-aborter")
    for t in workers + [aborter]:
        t.start()
    for t in workers:
        t.join(max(1.0, results_until - time.monotonic()))
    producers_done.set()
    aborter.join(max(1.0, results_until - time.monotonic()))
    report.problems += helper_errors

    outputs: dict[int, RequestOutput] = {}

    def collect(entry: Submitted, timeout: float) -> bool:
        """Its output into `outputs` (a failed step is a problem); False if it is not done in time."""
        try:
            outputs[entry.index] = entry.handle.result(timeout=timeout)
        except TimeoutError:
            return False
        except RuntimeError as error:
            report.failed += 1
            report.problems.append(f"request {entry.index}: failed: {error.__cause__ or error!r}")
        return True

    # Requests still running at `results_until` are cancelled by the shutdown: they must then end
    # ABORTED like any other abort; one that does not end even then is lost.
    late = [e for e in submitted if not collect(e, max(0.0, results_until - time.monotonic()))]
    report.online_s = time.monotonic() - start
    report.submitted = len(submitted)
    report.cancelled = len(late)
    for entry in late:
        entry.abort_sent = True  # by the shutdown below
    try:
        engine.shutdown(cancel=bool(late), timeout=60)
    except TimeoutError as error:
        report.problems.append(f"shutdown: {error}")
    for entry in late:
        if not collect(entry, 5.0):
            report.failed += 1
            report.problems.append(f"request {entry.index}: lost (not done even after the shutdown)")

    ids = [out.request_id for out in outputs.values()]
    if len(set(ids)) != len(ids):
        report.problems.append(f"{len(ids) - len(set(ids))} duplicated request ids")
    for entry in submitted:
        out = outputs.get(entry.index)
        if out is None:
            continue
        report.tokens += len(out.output_token_ids)
        report.preemptions += out.num_preemptions
        if out.finish_reason is FinishReason.ABORTED:
            report.aborted += 1
        else:
            report.finished += 1
        report.problems += check_output(entry, out, list(entry.handle))

    allocator = engine.allocator
    report.pages_leaked = allocator.num_pages - allocator.num_free
    if report.pages_leaked:
        report.problems.append(f"{report.pages_leaked} KV pages still held after shutdown")
    if engine.scheduler.has_work:
        report.problems.append("the scheduler still has work after shutdown")
    alive = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    report.loop_threads_alive = sum(t.name == LOOP_THREAD for t in alive)
    report.stray_threads = [t.name for t in alive if t.name != LOOP_THREAD]
    if alive:
        report.problems.append(f"threads left alive: {[t.name for t in alive]}")

    # The sync re-check: greedy requests (must match, or diverge only at a near-tie) and seeded ones.
    rerun = [e for e in submitted if e.index in outputs
             and (not e.work.params.do_sample or e.work.params.seed is not None)]
    rerun.sort(key=lambda e: e.work.params.max_new_tokens)  # chunks of like lengths: fewer half-empty steps
    if engine._background is not None:  # the loop did not stop: generate() is refused
        report.unchecked = len(rerun)
        rerun = []
    begin, seconds_per_request, check_began = 0, None, time.monotonic()
    while begin < len(rerun):
        left = check_until - time.monotonic()
        size = 16 if seconds_per_request is None else min(rerun_chunk, int(left / seconds_per_request))
        if left <= 0 or size < 1:  # the next chunk would overrun the deadline
            report.unchecked = len(rerun) - begin
            break
        chunk = rerun[begin: begin + size]
        began = time.monotonic()
        refs = engine.generate([e.work.prompt for e in chunk], [e.work.params for e in chunk], mode="sync")
        seconds_per_request = (time.monotonic() - began) / len(chunk)
        begin += len(chunk)
        for entry, ref in zip(chunk, refs):
            out, params = outputs[entry.index], entry.work.params
            j, mismatch = first_divergence(out, ref, prefix=out.finish_reason is FinishReason.ABORTED)
            name = f"request {entry.index} ({'seeded' if params.do_sample else 'greedy'})"
            if j is not None:
                mismatch = (f"token {j}: {out.output_token_ids[j]} vs sync {ref.output_token_ids[j]} "
                            f"(after {out.output_token_ids[:j]})")
            if params.do_sample:
                report.seeded_checked += 1
                if j is not None or mismatch:
                    report.seeded_differ += 1
                    report.ties.append(f"{name}: {mismatch}")
                continue
            report.greedy_checked += 1
            if j is not None:
                gap = logit_gap(engine.model, out.prompt_token_ids + out.output_token_ids[:j],
                                out.output_token_ids[j], ref.output_token_ids[j], params)
                if gap <= tie_tolerance:
                    report.greedy_ties += 1
                    report.ties.append(f"{name}: {mismatch}, logit gap {gap:.2e}")
                    continue
                mismatch += f", logit gap {gap:.2e} > {tie_tolerance:g}: not a near-tie"
            if mismatch:
                report.problems.append(f"{name} differs from its sync re-run: {mismatch}")
    report.check_s = time.monotonic() - check_began
    # In half precision near-ties are common, and cannot be told apart from errors for sampled tokens.
    if engine.dtype == torch.float32 and report.seeded_differ > max(2, 0.02 * report.seeded_checked):
        report.problems.append(f"{report.seeded_differ} of {report.seeded_checked} seeded requests differ "
                               "from their sync re-run (more than near-ties explain)")
    leaked = allocator.num_pages - allocator.num_free
    if leaked:
        report.problems.append(f"{leaked} KV pages held after the sync re-check")
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0, help="wall-time budget, start-up included (default 3)")
    p.add_argument("--requests", type=int, default=5000, help="most requests to submit (default 5000)")
    p.add_argument("--shape", choices=sorted(SHAPE_DEFAULTS), default="tiny")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--mode", choices=["sync", "async"], default="async", help="the online loop's mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--abort-share", type=float, default=0.1, help="share of requests aborted (default 0.1)")
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--max-new", type=int, default=None)
    p.add_argument("--max-running", type=int, default=None, help="BatchingConfig.max_running_requests")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None,
                   help="default: a third of what max_running requests of the longest kind need, to force preemption")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--backlog", type=int, default=None, help="most requests outstanding (default 2 x max_running)")
    p.add_argument("--tie-tolerance", type=float, default=None,
                   help="largest gap between the logits of two diverging greedy picks, from a plain forward of "
                        "the model, for a near-tie (default 1e-4 in float32, 0.1 otherwise)")
    args = p.parse_args(argv)
    for name, value in SHAPE_DEFAULTS[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_pages is None:
        worst = -(-(args.max_prompt + args.max_new) // args.page_size)
        args.num_pages = max(worst, args.max_running * worst // 3)
    if args.backlog is None:
        args.backlog = 2 * args.max_running
    if args.tie_tolerance is None:
        args.tie_tolerance = 1e-4 if args.dtype == "float32" else 0.1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = 60.0 * args.minutes
    deadline = _STARTED + budget - max(2.0, 0.03 * budget)  # room for the summary and closing
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    model = build_model(args.shape, device, dtype)
    config = BatchingConfig(mode=args.mode, page_size=args.page_size, num_pages=args.num_pages,
                            max_batch_tokens=args.max_batch_tokens, max_running_requests=args.max_running,
                            seed=args.seed)
    make = functools.partial(make_work, seed=args.seed, vocab=model.config.vocab_size, max_prompt=args.max_prompt,
                             max_new=args.max_new, abort_share=args.abort_share)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_soak: {args.shape} ({dtype}) on {device} ({gpu}), torch {torch.__version__}; {args.minutes} min; "
          f"up to {args.requests} requests, prompts 1..{args.max_prompt}, 1..{args.max_new} new, "
          f"{args.abort_share:.0%} aborted; {config}", flush=True)
    with Engine(model, config) as engine:
        began = time.monotonic()
        warm_up(engine, make)
        now = time.monotonic()
        print(f"warm-up: {now - began:.1f} s; {now - _STARTED:.1f} s since start", flush=True)
        left = deadline - now
        if left <= 5.0:
            print(f"FAIL: no time left for the soak after the warm-up ({left:.1f} s); give it more --minutes")
            return 1
        report = run_soak(engine, make, requests=args.requests, submit_until=now + 0.35 * left,
                          results_until=now + 0.5 * left, check_until=deadline, tie_tolerance=args.tie_tolerance,
                          producers=args.producers, backlog=args.backlog)
        graphs = len(engine.graphs) if engine.graphs is not None else 0
    print(report.summary())
    print(f"CUDA graphs: {graphs}; wall {time.monotonic() - _STARTED:.1f} s of {budget:.0f} s", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
