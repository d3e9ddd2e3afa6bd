"""CUDA graphs for steps: one per bucket, captured on first use.

DecodeGraphs holds an engine's graphs: it picks each step's bucket (engine/graph_keys.py), captures
a bucket's graph on its first step (engine/captured_graph.py), lends captured graphs to steps whose
own bucket is not, and at the cap on prefill graphs may give a captured bucket's place to one that
keeps missing (PREFILL_EVICT_AFTER_MISSES).
The graphs do not depend on the I/O slot, so the sync and async loops share them, and all of them
share one memory pool (they never run at the same time).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from operator import add

import torch

from hf_async_cb.engine import graph_keys
from hf_async_cb.engine.batch import StepInputs
from hf_async_cb.engine.captured_graph import CapturedGraph, release_generators_after_failed_capture
from hf_async_cb.engine.graph_keys import GraphKey, pow2, pow4, token_bucket, prefill_context_bucket
from hf_async_cb.engine.runner import ModelRunner
from hf_async_cb.engine.step_plan import StepPlan
from hf_async_cb.sampling.device_processors import block_bucket, prefix_bucket, sequence_shapes

logger = logging.getLogger(__name__)

# At the cap, a prefill/mixed bucket whose steps ran eagerly this many times (since it last took a place)
# takes the place of the captured prefill bucket replayed least since its capture, where that one was
# replayed fewer times: its graph is dropped once the device has finished its queued work, and the new
# one is captured. The first buckets of a serving load (a few short requests, small batches) then no
# longer keep its later, larger ones eager for good (8B serving on an H100: all 60 eager steps of one
# run fell into four 256-request buckets, none of them among the 16 captured). A place changes hands
# at most once per this many eager steps. 0 (the default until measured on a GPU): never.
PREFILL_EVICT_AFTER_MISSES = 0
# Whether every capture runs its step eagerly first. The first capture of a thread does (it creates the
# thread's cuBLAS handle and its workspace on the capture stream, which a capture must not allocate);
# later ones skip it and retry with it where the capture fails (a kernel loading lazily, say). The
# warm-up cost as much host time as the recording itself: a later call with a new batch size spent
# half of its captures' time in it (benchmarks/gpu_capture_cost.py compares the two).
WARM_UP_EVERY_CAPTURE = False
# A greedy step whose bucket has been captured only for sampled steps replays that graph this many times
# (its draw takes a greedy row's argmax, as the greedy graph does, plus a few launches that return at
# once) before the bucket captures a greedy graph of its own: a greedy call after sampled ones then
# captures nothing in its first steps (0.11 s of captures on the H200 for a 1B call), while a long run
# of greedy steps still ends on the greedy graphs. 0 turns the lending off.
LEND_SAMPLED_STEPS = 1024
# A decode step whose bucket is not captured replays a larger captured decode bucket that holds it (more
# padding rows, a wider block table) this many times before it captures its own: a later call with a new
# batch size (7 rows after a call of 64) then captures no decode graph, while a shape that keeps coming
# back still ends on its own graph. A capture costs a 1B model's host 30-45 ms (docs/benchmarks.md); a
# decode step padded from 8 rows to 64 costs little more than its own (its weights are read once either
# way). Prefill and mixed steps are not lent (below the cap): a warmed-up serving loop, which has seen
# each of its prefill buckets once, would capture them in its timed run. 0 turns the lending off.
LEND_LARGER_DECODE_STEPS = 1024
# The largest batch a decode step is lent: up to it a step's GEMMs stay bound by reading the weights
# (at 16 bits, and 4-bit weights near the limit), so the padding rows cost little beyond the launch.
LEND_LARGER_MAX_BATCH = 64


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, is_cuda: bool, prefill: bool = False,
                 max_prefill_graphs: int = 16, tall_query_len: int | None = None,
                 max_tokens: int | None = None) -> None:
        """max_tokens: the most tokens (padding included) a captured step may hold; larger steps
        run eagerly (None: no limit but the buckets'). prefill: also replay prefill and mixed steps from graphs (at most `max_prefill_graphs`
        buckets; a later step of a new bucket replays a larger captured one that holds it, or runs
        eagerly). tall_query_len: prefill/mixed steps whose longest
        query has at least this many tokens get buckets of their own. The Triton attention takes
        taller tiles for them (kernels/attention_launch.tile_shape), and a graph keeps the tile of the
        step it was captured on: without the split, a bucket first captured on short chunks would
        replay its long ones at half speed, and one first captured on long chunks its decodes."""
        self.runner = runner
        self.max_batch = pow2(max_batch)
        self.max_tokens = max_tokens
        self.prefill = prefill
        self.tall_query_len = tall_query_len
        self.max_prefill_graphs = max_prefill_graphs
        self.num_prefill_graphs = 0
        self.pool = torch.cuda.graph_pool_handle() if is_cuda else None
        self.stream = torch.cuda.Stream() if is_cuda else None  # every capture (and its warm-up) runs here
        self._graphs: dict[GraphKey, CapturedGraph] = {}
        self.failed: set[GraphKey] = set()  # buckets whose capture failed: their steps run eagerly
        self.num_replays = 0
        self.num_padded_up = 0  # steps replayed in a larger captured bucket than their own (at the cap)
        self.capture_seconds: list[float] = []  # wall time of each capture, warm-up included
        self.warm_threads: set[int] = set()  # threads that captured after a warm-up (WARM_UP_EVERY_CAPTURE)
        self.num_warm_up_retries = 0  # captures without a warm-up that failed and succeeded with one
        self.context: tuple | None = None  # the arithmetic they were captured in (keep_for)
        self.storages: tuple | None = None  # where the weights were when they were captured (keep_over)
        self.num_lent = 0  # greedy steps that replayed their bucket's sampled graph (LEND_SAMPLED_STEPS)
        self._lent: dict[GraphKey, int] = {}
        # Steps that ran eagerly, by why: embeddings, row_options (user processors, kept scores, unseeded
        # draws), too_large (over the graphs' rows or tokens), no_prefill_graphs, prefill_cap (every prefill
        # bucket taken and none captured holds the step), capture_failed.
        self.eager: collections.Counter[str] = collections.Counter()
        self.eager_buckets: collections.Counter[GraphKey] = collections.Counter()  # prefill_cap steps' own buckets
        self.evict_after = PREFILL_EVICT_AFTER_MISSES  # (0: a captured prefill bucket keeps its place)
        self.num_evicted = 0
        self._misses: collections.Counter[GraphKey] = collections.Counter()  # eager steps since a bucket's last place
        self._replays: collections.Counter[GraphKey] = collections.Counter()  # replays of each captured prefill bucket
        self.num_lent_larger = 0  # decode steps that replayed a larger captured bucket (LEND_LARGER_DECODE_STEPS)
        self._lent_larger: dict[GraphKey, int] = {}

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def key_for(self, plan: StepPlan) -> GraphKey | None:
        """The bucket of a step without user logits processors, kept scores, unseeded sampling or
        prompt embeddings (a decode step, or with `prefill` any step), whose capture has not failed;
        else None.

        A prefill/mixed bucket pads the batch with requests that write to the trash page: each needs
        a token, so the token bucket leaves room for them."""
        chunks = plan.chunks
        if plan.embedded:
            return self._eager("embeddings")  # inputs_embeds: an eager forward
        decode = plan.sizes.count(1) == len(chunks) and plan.all_sample  # one token each, all sampling
        sampled = False
        penalised = []
        blocked = 0
        if not plan.plain:  # else no row has anything that shapes a bucket, or keeps it from one
            for c in chunks:
                r = c.request
                if r.logits_processor is not None or r.keep_scores:
                    return self._eager("row_options")
                p = r.params
                if p.plain or not c.samples:
                    continue
                if p.do_sample:
                    if p.seed is None:
                        return self._eager("row_options")
                    sampled = True
                if p.reads_history:
                    penalised.append(r)
                if p.blocks_tokens:
                    blocked += len(r.blocked_tokens)
        penalty = None
        if penalised:
            penalty = (any(r.params.repetition_penalty > 1 for r in penalised),
                       any(r.params.repetition_penalty < 1 for r in penalised), prefix_bucket(penalised),
                       max(r.params.no_repeat_ngram_size for r in penalised), *sequence_shapes(penalised))
        if decode:
            if len(chunks) > self.max_batch or (self.max_tokens is not None and pow2(len(chunks)) > self.max_tokens):
                return self._eager("too_large")
            key = GraphKey(pow2(len(chunks)), max(graph_keys.MIN_CONTEXT_BUCKET, pow2(max(plan.starts) + 1)),
                           sampled=sampled, penalty=penalty, blocked=blocked and block_bucket(blocked))
        else:
            if not self.prefill or plan.num_tokens > graph_keys.PREFILL_GRAPH_MAX_TOKENS:
                return self._eager("too_large" if self.prefill else "no_prefill_graphs")
            size, tokens = len(chunks), plan.num_tokens
            batch = self._prefill_batch(size)
            bucket = token_bucket(tokens)
            if bucket > tokens and batch == size:
                batch = self._prefill_batch(size + 1)  # the padding tokens need a padding request
            bucket = token_bucket(max(bucket, tokens + batch - size))
            padding = bucket - tokens - (batch - size - 1)  # tokens of the last padding request
            context = max(max(map(add, plan.starts, plan.sizes)), padding if batch > size else 0)
            reach = min(graph_keys.PREFILL_CONTEXT_REACH, max(c.request.max_total_tokens for c in chunks))
            tall = self.tall_query_len is not None and max(plan.sizes) >= self.tall_query_len
            if self.max_tokens is not None and bucket > self.max_tokens:
                return self._eager("too_large")
            key = GraphKey(batch, prefill_context_bucket(max(context, reach)), bucket, sampled, penalty,
                           blocked and block_bucket(blocked), tall)
            if key not in self._graphs and self.num_prefill_graphs >= self.max_prefill_graphs:
                padded = self._padded_into_captured(key, plan)
                self.num_padded_up += padded is not None
                if padded is None:
                    self.eager_buckets[key] += 1
                    if self._took_a_place(key):
                        return key
                return padded or self._eager("prefill_cap")
        if not key.sampled and key not in self._graphs:
            key = self._lent_sampled(key)
        if key not in self._graphs and not key.tokens:
            key = self._lent_larger_decode(key)
        return self._eager("capture_failed") if key in self.failed else key

    def _took_a_place(self, key: GraphKey) -> bool:
        """Whether prefill bucket `key`, not captured and with every place taken, now takes the place of
        the captured prefill bucket replayed least (PREFILL_EVICT_AFTER_MISSES): that one is dropped."""
        if not self.evict_after or self.max_prefill_graphs == 0:
            return False
        self._misses[key] += 1
        misses = self._misses[key]
        if misses < self.evict_after:
            return False
        victim = min((k for k in self._graphs if k.tokens), key=lambda k: self._replays[k], default=None)
        if victim is None or self._replays[victim] >= misses:
            return False
        if self.stream is not None:  # its queued replays done (on the engine's device) before its graph and memory go
            torch.cuda.synchronize(self.stream.device)
        del self._graphs[victim]
        del self._replays[victim]
        self._misses[key] = 0
        self.num_prefill_graphs -= 1
        self.num_evicted += 1
        logger.info("hf_async_cb: prefill graph bucket %s gives its place to %s (%d eager steps)", victim, key, misses)
        return True

    def _eager(self, why: str) -> None:
        """Count a step that runs eagerly, by why (the serving benchmark reports them)."""
        self.eager[why] += 1

    def _lent_larger_decode(self, key: GraphKey) -> GraphKey:
        """A larger captured decode bucket for a decode step whose own is not captured, while its bucket
        has been lent fewer than LEND_LARGER_DECODE_STEPS times; else the step's own key."""
        times = self._lent_larger.get(key, 0)
        larger = self._larger_decode(key) if times < LEND_LARGER_DECODE_STEPS else None
        if larger is None:
            return key
        self._lent_larger[key] = times + 1
        self.num_lent_larger += 1
        return larger

    def _larger_decode(self, key: GraphKey) -> GraphKey | None:
        """The smallest captured decode bucket that holds a decode step of bucket `key` (as many rows
        or more, up to LEND_LARGER_MAX_BATCH; as long a context or longer; the same options; a greedy
        step may take a sampled graph, whose draw picks greedily for it), or None. Its padding rows
        write to the trash page and read one key each."""
        best = None
        for k in self._graphs:
            if (k.tokens or k.shared or not key.batch <= k.batch <= LEND_LARGER_MAX_BATCH or k.context < key.context
                    or (k.penalty, k.blocked) != (key.penalty, key.blocked) or (key.sampled and not k.sampled)):
                continue
            rank = (k.batch, k.context, k.sampled != key.sampled)
            if best is None or rank < best[0]:
                best = (rank, k)
        return best and best[1]

    def _lent_sampled(self, key: GraphKey) -> GraphKey:
        """The sampled graph of a greedy step's bucket, where only that one is captured (and it has
        been lent fewer than LEND_SAMPLED_STEPS times); else the step's own key. The batch then
        uploads every row's sampling parameters, greedy (BatchBuilder.build's `sampled`)."""
        lent = dataclasses.replace(key, sampled=True)
        times = self._lent.get(key, 0)
        if lent not in self._graphs or times >= LEND_SAMPLED_STEPS:
            return key
        self._lent[key] = times + 1
        self.num_lent += 1
        return lent

    def _prefill_batch(self, size: int) -> int:
        """A prefill/mixed bucket's request count: a power of 4 (within the graphs' row limit, else of
        2). Serving steps mix a drifting number of decodes with a few prefill chunks: powers of two
        spread them over so many buckets that the capped captures missed most of them (with prefix
        caching, 24-28 buckets for 71 steps on the CPU's replay of a serving load). A padding request
        costs a token and a logits row, little beside an eager step."""
        batch = pow4(size)
        return batch if batch <= 2 * self.max_batch else pow2(size)

    def _padded_into_captured(self, key: GraphKey, plan: StepPlan) -> GraphKey | None:
        """Once the prefill buckets are all taken, a step of a bucket not captured replays the
        smallest captured one it fits in (more padding requests, more tokens, a wider block table)
        rather than running eagerly: with prefix caching a serving load's steps (a few own tokens over
        long cached contexts, beside decodes) spread over more buckets than are captured. The
        Triton attention's launch of a prefill/mixed step depends only on its token and request
        counts, so any bucket that holds the step computes it; the extra tokens are bounded
        (PADDED_BUCKET_MAX_TOKENS or twice the step's own bucket) so that the padding costs less
        than the launches it saves. A greedy step may take a sampled bucket (its draw picks greedily),
        where no greedy one is as small. None when no captured bucket fits."""
        size, tokens = len(plan.chunks), plan.num_tokens
        context = max(map(add, plan.starts, plan.sizes))
        limit = max(graph_keys.PADDED_BUCKET_MAX_TOKENS, 2 * key.tokens)
        best = None
        for k in self._graphs:
            if (not k.tokens or k.tokens > limit or k.batch < size or k.tall != key.tall
                    or (k.penalty, k.blocked) != (key.penalty, key.blocked) or (key.sampled and not k.sampled)):
                continue
            pads = k.batch - size
            if pads == 0:
                fits = k.tokens == tokens and k.context >= context
            else:  # each padding request takes a token, the last all those left
                last = k.tokens - tokens - (pads - 1)
                fits = last >= 1 and k.context >= max(context, last)
            if fits and (best is None or (k.tokens, k.batch, k.context, k.sampled) < (
                    best.tokens, best.batch, best.context, best.sampled)):
                best = k
        return best

    def step(self, key: GraphKey, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> torch.Tensor:
        """Run a padded decode step through its graph (captured now if it is the bucket's first).

        A capture that fails (an operation of the model that cannot be captured) is not fatal:
        the bucket is marked failed, warned about once, and the step runs eagerly, as do later
        steps of that bucket."""
        graph = self._graphs.get(key)
        if graph is None:
            started = time.perf_counter()
            try:
                graph = self._capture(key, inputs, previous_tokens)
            except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError
                if not self.failed:
                    logger.warning("CUDA graph capture failed (%s: %s); steps of that shape run eagerly",
                                   type(e).__name__, str(e).splitlines()[0])
                self.failed.add(key)
                self._after_failed_capture()
                return self.runner.step(inputs, previous_tokens)
            self._graphs[key] = graph
            self.num_prefill_graphs += key.tokens > 0
            self.capture_seconds.append(time.perf_counter() - started)
            logger.info("captured a graph for batch %d, context %d, tokens %d in %.0f ms", key.batch, key.context,
                        key.tokens, 1e3 * self.capture_seconds[-1])
        else:
            graph.load(inputs, previous_tokens)
        self.num_replays += 1
        if key.tokens:
            self._replays[key] += 1
        return graph.replay()

    def _capture(self, key: GraphKey, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> CapturedGraph:
        """A new graph for `key`, warmed up first where this thread has not captured one after a
        warm-up yet (or WARM_UP_EVERY_CAPTURE); a capture without it that fails is tried once with it."""
        thread = threading.get_ident()
        warm_up = WARM_UP_EVERY_CAPTURE or thread not in self.warm_threads
        # A prefill bucket's batch may be one power of two above max_batch: so may its tokens.
        def capture(warm_up: bool) -> CapturedGraph:  # (into the pool of now: a failed capture renews it)
            return CapturedGraph(self.runner, inputs, previous_tokens, 2 * self.max_batch, self.pool, self.stream,
                          decode=key.tokens == 0, warm_up=warm_up)

        if not warm_up:
            try:
                return capture(warm_up=False)
            except RuntimeError as e:
                logger.debug("a capture without a warm-up failed (%s); again with one", e)
                self._after_failed_capture()
                self.num_warm_up_retries += 1
        graph = capture(warm_up=True)
        self.warm_threads.add(thread)
        return graph

    def _after_failed_capture(self) -> None:
        """After a capture that raised: the CUDA generators released (release_generators_after_failed_capture),
        and later captures given a pool of their own. Where the capture's end raised (an invalidated
        capture), torch (2.11 on the H100) left the caching allocator recording to the pool even after
        _end_allocating_to, and every later capture into it failed ("beginAllocateToPool: already
        recording to mempool_id"): the engine's steps ran eagerly for good. The graphs captured before
        keep their pool; the new one is shared by those captured after."""
        release_generators_after_failed_capture()
        if self.pool is not None:
            self.pool = torch.cuda.graph_pool_handle()

    def keep_for(self, context: tuple) -> None:
        """Before a call (or a serving admission) in arithmetic `context` (model/numeric_context.py):
        a graph replays the kernels, and so the precision, of the step it captured, so graphs of
        another context (an earlier call under autocast, another matmul precision) are dropped."""
        if context == self.context:
            return
        self._drop("this call's autocast or matmul precision differs from theirs")
        self.context = context

    def keep_over(self, storages: tuple) -> None:
        """Before a call, under the model's guard, with where the model's weights are now
        (prepared.weight_storages): a graph reads them where they were when it was captured, so a
        weight given new storage since (by another preparation of the model fusing it, or giving it
        its own storage back, which this engine takes for no change: fusion.moved_from) drops the
        graphs, to be captured again."""
        if storages == self.storages:
            return
        if self.storages is not None:
            self._drop("the model's weights were moved by another preparation of it (a fusion, or its undoing)")
        self.storages = storages

    def _drop(self, why: str) -> None:
        if self._graphs:
            logger.info("hf_async_cb: %d CUDA graphs dropped: %s", len(self._graphs), why)
        self._graphs.clear()
        self.failed.clear()
        self.num_prefill_graphs = 0
        self._replays.clear()
        self._misses.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: GraphKey) -> bool:
        """Whether `key`'s graph is captured (a step of it replays rather than captures)."""
        return key in self._graphs
