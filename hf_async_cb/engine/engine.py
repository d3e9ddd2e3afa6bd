"""Engine: owns the KV pool, the scheduler, the batch builder, the runner and the loops."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from typing import Sequence

import torch

from hf_async_cb.config import BatchingConfig, log_device_defaults, resolve_mode
from hf_async_cb.devices import Streams
from hf_async_cb.engine.batch import BatchBuilder
from hf_async_cb.engine.cuda_graphs import DecodeGraphs
from hf_async_cb.engine.eos import with_model_eos
from hf_async_cb.engine.online import BackgroundLoop
from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.parity import check_parity
from hf_async_cb.engine.pipeline import Pipeline
from hf_async_cb.engine.pool_size import allocate_pool, pool_pages
from hf_async_cb.engine.prefix_cache import PrefixCache, PrefixCacheStats
from hf_async_cb.engine.profiling import StepProfile
from hf_async_cb.engine.prompt_limits import PromptLimits, check_prompt, history_ids, known_suppressed
from hf_async_cb.engine.prompt_embeds import PromptEmbeds, checked_embeds
from hf_async_cb.engine.progress import Progress
from hf_async_cb.engine.requests import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    as_stock_list,
    as_token_lists,
    params_per_prompt,
)
from hf_async_cb.engine.runner import ModelRunner
from hf_async_cb.engine.scheduler import Scheduler
from hf_async_cb.engine.serving_api import ServingAPI
from hf_async_cb.engine.seeding import _random_seed, check_seed_arguments, copy_params, seed_requests  # noqa: F401 (data_parallel's)
from hf_async_cb.engine.stack_chunk import above_a_large_stack_chunk
from hf_async_cb.errors import explain_out_of_memory
from hf_async_cb.kernels.precompile import note_first_use, precompile
from hf_async_cb.kernels.shared_prefix_attention import prefix_tiles_hold
from hf_async_cb.model import attention, stream_probe
from hf_async_cb.model.checks import model_dtype, step_token_cap, text_config_of
from hf_async_cb.model.eval_mode import as_in_eval
from hf_async_cb.model.graph_safety import graph_token_cap, graph_unsafe_weights, holds_off_stream_kernels
from hf_async_cb.engine.distributed import TensorParallel
from hf_async_cb.model.kv_fingerprint import kv_fingerprint, runs_user_code
from hf_async_cb.model.kv_layout import measured_layout
from hf_async_cb.model.numeric_context import numeric_context
from hf_async_cb.model.model_guard import model_guard
from hf_async_cb.model.prepared import PreparedModel
from hf_async_cb.model.vision_feature_cache import TowerOutputCache

logger = logging.getLogger(__name__)


class Engine(ServingAPI):
    """Continuous batching over one transformers model.

    Requests stop at the model's EOS ids (its generation config's eos_token_id, else the
    `tokenizer`'s), as stock generate does, unless their params name others; eos_token_ids=()
    runs past EOS.

    >>> engine = Engine(model, BatchingConfig(mode="sync"))
    >>> outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=8)
    """

    @torch.inference_mode(False)
    def __init__(self, model: torch.nn.Module, config: BatchingConfig | None = None,
                 max_pages_needed: int | None = None, tokenizer=None, *,
                 prepared: PreparedModel | None = None) -> None:
        """`max_pages_needed`: when the workload is known (generate), a pool sized from memory is
        capped at what it can use, so that a small call does not claim half the GPU.
        `prepared`: a model already prepared by a runtime that outlives this engine; the engine
        then holds the model weakly and leaves the preparation to its owner.
        Built outside inference mode even when the caller is in it: the pool, graphs and fused
        weights it keeps are written by later calls, and the model is trained after, possibly."""
        if isinstance(config, dict):  # (as generate's batching_config= takes one)
            config = BatchingConfig(**config)
        if config is not None and not isinstance(config, BatchingConfig):
            raise TypeError(f"Engine takes a BatchingConfig (or a dict of its fields), got {type(config).__name__}.")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Engine takes a transformers model (an nn.Module), got {type(model).__name__}.")
        self.config = config if config is not None else BatchingConfig()
        self.tokenizer = tokenizer  # lets add_request take text
        self._background: BackgroundLoop | None = None
        self._lifecycle = threading.RLock()  # start() against start() and shutdown() from other threads
        self._closed = False
        self.last_profile: StepProfile | None = None  # of the last run, with BatchingConfig(profile=True)
        self.config.validate()
        started = time.perf_counter()
        self._owns_preparation = prepared is None
        # Built under the model's guard (nested in a generate call's own hold), its eval mode inside it:
        # another thread's call swaps its own modules in while it holds the model, which a preparation,
        # a measurement or the parity check's reference forward running meanwhile would take for the model's.
        with model_guard(model).held("Engine(model)", kind="build"), \
                as_in_eval(model, warn=False):  # its checks run the stock forward: without dropout (model/eval_mode.py)
            if prepared is None:
                prepared = PreparedModel(model, self.config.trust_untested_model, self.config.fuse_projections,
                                         self.config.fuse_elementwise, self.config.skinny_gemm,
                                         engine_config=self.config)
            self.prepared_model = prepared
            try:
                self._build_and_check(model, max_pages_needed)
            except BaseException:  # give the model back as it was found
                if getattr(self, "cache", None) is not None:  # (a failed check after the pool was built)
                    self.cache.free()
                if self._owns_preparation:
                    prepared.restore()
                raise
        if self._owns_preparation:
            self.note_first_use(time.perf_counter() - started)

    def _build_and_check(self, model: torch.nn.Module, max_pages_needed: int | None) -> None:
        self._build(model, max_pages_needed)
        for ahead in (self.prepared_model.kernels_ahead, self._precompile):  # loaded before any kernel runs
            if ahead is not None:
                ahead.wait(note=False)  # (said once, by the preparation's owner: note_first_use)
        decode_gemms = self.prepared_model.decode_gemms
        self._build_parts = {}  # (the first use's note names the long ones: note_first_use)
        if self.config.skinny_gemm and decode_gemms is not None:
            started = time.perf_counter()
            measured = decode_gemms.tune(self.config.max_running_requests)
            if measured:
                logger.info("hf_async_cb: measured %d decode GEMM shapes; %s", measured, decode_gemms.summary())
            self._build_parts["measuring the decode GEMMs"] = time.perf_counter() - started
        if not self.config.trust_untested_model:
            started = time.perf_counter()
            check_parity(self)  # once per model class, config, dtype and device (engine/parity.py)
            self._build_parts["the parity check"] = time.perf_counter() - started
            if self.prefix_cache is not None:  # its probe's pages and counts are not the user's
                self.scheduler.clear_prefix_cache()
                self.prefix_cache.stats = PrefixCacheStats()

    def _build(self, model: torch.nn.Module, max_pages_needed: int | None) -> None:
        self.device = self.prepared_model.device
        resolved = self.config.for_device(self.device)
        if resolved is not self.config:
            log_device_defaults(self.config, resolved, self.device)
        text_config = text_config_of(model.config)  # a composite config's (Gemma 3's) language part
        cap = step_token_cap(text_config)  # (Llama 4's temperature tuning counts a step's tokens)
        if cap is not None and resolved.max_batch_tokens > cap:
            resolved = dataclasses.replace(resolved, max_batch_tokens=cap, mixed_prefill_tokens=None if (
                resolved.mixed_prefill_tokens or 0) > cap else resolved.mixed_prefill_tokens)
        self.config = resolved
        self.dtype = model_dtype(model)
        self.layout = measured_layout(model, self.dtype, self.device)  # raises ValueError with the reason
        self._model_config = text_config
        self.prompt_limits = PromptLimits.of(model, text_config)
        self.vocab_size = self.prompt_limits.vocab_size
        self.max_positions = self.prompt_limits.max_positions
        self.rope_switch = self.prompt_limits.rope_switch  # (length, rope type) or None
        page_size = self.config.page_size
        num_pages = pool_pages(self.config, self.layout, self.dtype, self.device, text_config, self.vocab_size)
        if self.config.num_pages is None and max_pages_needed is not None:
            num_pages = max(1, min(num_pages, max_pages_needed))
        self.tensor_parallel = TensorParallel.of(model)
        if self.tensor_parallel is not None:  # every rank's engine must schedule alike
            num_pages = self.tensor_parallel.agree_min(num_pages)
        self.num_pages = num_pages
        self.cache = allocate_pool(self.layout, num_pages, page_size, self.dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(page_size) if self.config.prefix_caching else None
        self.tower_outputs = TowerOutputCache(self.config.image_cache_bytes if self.prefix_cache is not None else 0)
        self._kv_fingerprint: tuple | None = None  # the model's, when the cache was last checked
        self.scheduler = Scheduler(self.allocator, page_size, self.config.max_batch_tokens,
                                   self.config.max_running_requests, self.config.mixed_prefill_tokens,
                                   prefix_cache=self.prefix_cache)
        self.attention_backend = attention.resolve_backend(self.config.attention, self.device)
        # Every kernel variant it can need, compiled in workers meanwhile (less those compiled while it was prepared)
        self._precompile = precompile(self, model, ahead=self.prepared_model.kernels_ahead)
        self.builder = BatchBuilder(page_size, trash_slot=num_pages * page_size, page_table=self.scheduler.page_table,
                                    attention_backend=self.attention_backend,
                                    groups_prefixes=prefix_tiles_hold(self.layout, text_config))
        if self.device.type == "cuda":  # classes not on graph_safety's lists, run once (model/stream_probe.py)
            stream_probe.probe(model, self.dtype)
        off_stream = holds_off_stream_kernels(model) if self.device.type == "cuda" else []
        if off_stream:  # (model/graph_safety.py)
            logger.info("hf_async_cb: %s computes on the default stream: %d modules (e.g. %s) launch kernels there",
                        type(model).__name__, len(off_stream), off_stream[0])
        self.streams = Streams(self.device, compute_on_default=bool(off_stream))
        self._pipelines: dict[str, Pipeline] = {}
        self.runner = ModelRunner(model, self.cache, self.prepared_model, hold_model=self._owns_preparation)
        self._online_seed: int | None = None  # the engine seed of the background loop's requests
        self._submissions = itertools.count()  # requests added online: the index their seed derives from
        use_graphs = self.config.cuda_graphs
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        gemms = self.prepared_model.decode_gemms
        routed = gemms.graph_routed_modules() if gemms else []
        unsafe = graph_unsafe_weights(model, routed) if use_graphs else []
        if unsafe:  # kernels on the legacy stream, which a graph does not record (model/graph_safety.py)
            logger.warning("hf_async_cb: %s runs without CUDA graphs: %d modules (e.g. %s, %s) run kernels a graph "
                           "cannot record", type(model).__name__, len(unsafe), *unsafe[0])
            use_graphs = False
        tall_query_len = None
        if self.attention_backend == "triton":
            from hf_async_cb.kernels.attention_launch import TALL_TILE_QUERY_LEN as tall_query_len
        self.graphs = DecodeGraphs(
            self.runner, self.config.max_running_requests, is_cuda=self.device.type == "cuda",
            prefill=self.config.prefill_graphs and (self.attention_backend == "triton" or self.device.type != "cuda"),
            tall_query_len=tall_query_len,
            max_tokens=graph_token_cap(routed),  # (LLM.int8(), quanto's plain 4-bit: model/graph_safety.py)
        ) if use_graphs else None
        self.runner.graphs = self.graphs
        logger.info("hf_async_cb engine: %d KV pages of %d tokens (%.1f MiB) on %s, %s attention", num_pages,
                    page_size, self.cache.bytes / 2**20, self.device, self.attention_backend)

    def note_first_use(self, seconds: float) -> None:
        """Say once per process, if it took over a second, how long the model's preparation, this engine's
        build and check took and what of it went to the kernels (one line for every precompile)."""
        prepared = self.prepared_model
        note_first_use(f"{type(self.model).__name__} on {self.device}", seconds,
                       [prepared.checks_ahead, prepared.kernels_ahead, self._precompile],
                       getattr(self, "_build_parts", None))

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    # -- requests ----------------------------------------------------------------------------
    def make_request(self, prompt: Sequence[int], params: SamplingParams, *, logits_processor=None,
                     stopping_criteria=None, history_prefix: Sequence[int] = (), on_token=None,
                     embeds: PromptEmbeds | None = None) -> Request:
        """Validate one prompt against the model and the pool; raise ValueError if it cannot run.

        logits_processor / stopping_criteria: transformers LogitsProcessorList / StoppingCriteriaList
        (or callables of the same signature) applied to this request alone, on its full history
        `history_prefix + prompt + output` (the slow path: one call per request per step). The
        device's history options (repetition penalty, n-grams, bad words, sequence bias) read the
        same history. params.eos_token_ids left at its default (MODEL_EOS) become the model's EOS ids
        (its generation config's, else the tokenizer's: engine/eos.py), as stock generate stops.
        `embeds`: embeddings fed at some prompt positions instead of their tokens' (engine/prompt_embeds.py).
        """
        (ids,) = as_token_lists([prompt])
        return self.make_request_from_ids(ids, params, logits_processor=logits_processor,
                                          stopping_criteria=stopping_criteria, history_prefix=history_prefix,
                                          on_token=on_token, embeds=embeds)

    def make_request_from_ids(self, ids: list[int], params: SamplingParams, *, checked: bool = False,
                              logits_processor=None, stopping_criteria=None, history_prefix: Sequence[int] = (),
                              on_token=None, embeds: PromptEmbeds | None = None) -> Request:
        """make_request() for a prompt already read as a list of ints (as_token_lists; generate()'s
        rows), which it keeps as it is: no second pass over its tokens. `checked`: the caller has run
        check_prompt on these ids and params already (generate() does, before the engine is taken)."""
        self._check_open()  # (its pool and scheduler are gone)
        params = known_suppressed(with_model_eos(params, self.model, self.tokenizer), self.prompt_limits.vocab_size)
        if not checked:
            check_prompt(ids, params, self.prompt_limits)
        if embeds is not None:
            embeds = checked_embeds(embeds, len(ids), self.model.get_input_embeddings(),
                                    self.prepared_model.embeddings_refusal(), self.cache)
        # (generate() passes the rows' left padding, checked with its prompts: `checked`)
        history = [int(t) for t in history_prefix] if checked else \
            history_ids(history_prefix, self.prompt_limits.vocab_size)
        request = Request(ids, params, logits_processor=as_stock_list(logits_processor, "logits_processor"),
                          stopping_criteria=as_stock_list(stopping_criteria, "stopping_criteria"),
                          history_prefix=history, on_token=on_token, embeds=embeds)
        self.scheduler.check_fits(request)
        return request

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        mode: str | None = None,
        logits_processor=None,
        stopping_criteria=None,
        num_return_sequences: int = 1,
        seed_indices: Sequence[int] | None = None,
        engine_seed: int | None = None,
        **param_kwargs,
    ) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); outputs come back in prompt order.

        `params` is one SamplingParams for all, one per prompt, or built from keyword arguments
        (max_new_tokens=..., do_sample=..., eos_token_ids=...); eos_token_ids defaults to the model's
        EOS ids (see the class docstring), () ignores EOS. `logits_processor` and
        `stopping_criteria` (transformers lists) apply to every request, each on its own history.
        `num_return_sequences` copies of each prompt come back next to each other (as stock orders
        them); the copies share the first copy's cached prompt pages instead of recomputing them.
        `seed_indices` and `engine_seed` (DataParallel's): each prompt's index in a larger call and
        that call's engine seed, so that sampled requests without a seed of their own get the seeds
        one Engine gives the whole call (request i of it: derive_seed(engine seed, i)).
        """
        prompts = as_token_lists(prompts)
        per_prompt = params_per_prompt(prompts, params, param_kwargs)
        if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) \
                or num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be a positive integer, got {num_return_sequences!r}.")
        check_seed_arguments(len(prompts), seed_indices, engine_seed)
        if engine_seed is not None and seed_indices is None:  # this call is the whole call
            seed_indices = range(len(prompts))
        n = num_return_sequences
        if seed_indices is not None and engine_seed is None and any(sp.unseeded for sp in per_prompt):
            engine_seed = self.config.seed if self.config.seed is not None else self._draw_seed()
        requests = []
        for k, (p, sp) in enumerate(zip(prompts, per_prompt)):
            leader = None
            for copy in range(n):
                req = self.make_request_from_ids(p, copy_params(sp, copy), logits_processor=logits_processor,
                                                 stopping_criteria=stopping_criteria)
                if seed_indices is not None:  # its index in the whole call
                    seed_requests([req], engine_seed, first_index=seed_indices[k] * n + copy)
                req.share_from = leader
                leader = leader or req
                requests.append(req)
        self.run(requests, mode)
        return [r.to_output() for r in requests]

    def run(self, requests: list[Request], mode: str | None = None, *, caches_checked: bool = False) -> None:
        """Drive the loop until every request in `requests` has finished. `caches_checked`: the caller
        ran check_caches() for this call already (generate(), before its images' merge)."""
        self._check_open()
        if self._background is not None:
            raise RuntimeError("the engine's background loop is running: use add_request(), or shutdown() first.")
        loop = self.pipeline(self._mode(mode))
        if self.config.profile:
            loop.profile = self.last_profile = StepProfile(self.streams)
        seed_requests(requests, self.config.seed, draw=self._draw_seed)
        if not caches_checked:
            self.check_caches()
        cache_before = self.prefix_cache_stats()
        remaining = {id(r) for r in requests}
        with self.runner.prepared("Engine.run"):
            try:
                for r in requests:
                    self.scheduler.add(r)
                with Progress(requests, self.config.progress) as progress:
                    above_a_large_stack_chunk(_step_until_done, loop, remaining, progress)
                loop.drain()
                if self.config.profile and cache_before is not None:  # this run's share of the counters
                    loop.profile.prefix_cache = self._cache_share(cache_before)
            except BaseException as error:
                loop.abandon()
                self.scheduler.clear_prefix_cache()  # the failed step may not have written what it registered
                for r in requests:
                    if not r.is_finished:
                        self.scheduler.finish(r, RequestStatus.ABORTED)
                        r.finish_reason = FinishReason.ABORTED
                    r.num_pending = 0
                explained = explain_out_of_memory(error, self.config)
                if explained is not error:
                    raise explained from error
                raise

    # -- what is kept across calls -----------------------------------------------------------
    def check_caches(self) -> None:
        """Once per call, before any request is admitted: drop the CUDA graphs if the call's arithmetic
        (model/numeric_context.py: autocast, matmul precisions) is not the one they were captured in,
        and empty the prefix cache and the tower outputs if the model may compute other K/V (or
        image features) than when they were filled (model/kv_fingerprint.py, which reads that
        context too; one reading of the weights serves both). Graphs replay no Python: a model
        running the user's hooks or patched forwards, which may read a setting changed since, has
        its graphs captured afresh in each call."""
        gemms = self.prepared_model.decode_gemms
        if gemms is not None and gemms.copies:  # weights read through copies: the copies of changed ones rebuilt
            rebuilt = gemms.refresh_copies()
            if rebuilt:
                logger.info("hf_async_cb: %d HQQ 3-bit projections changed since the last call; their 4-bit "
                            "copies were rebuilt", rebuilt)
        fingerprint = kv_fingerprint(self.model, content=True) if self.prefix_cache is not None else None
        if self.prefix_cache is not None:
            self.tower_outputs.check(self.model, fingerprint=fingerprint)
        if self.graphs is not None:  # (a fingerprint of None: the user's code runs, or no cache reads it)
            context = numeric_context(self.device.type)
            user_code = fingerprint is None and runs_user_code(self.model)
            self.graphs.keep_for((context, object()) if user_code else context)
        if self.prefix_cache is None:
            return
        changed = fingerprint is None or fingerprint != self._kv_fingerprint
        if self.tensor_parallel is not None:  # every rank clears if any must: their schedules stay alike
            changed = self.tensor_parallel.agree_min(0 if changed else 1) == 0
        if changed:
            if len(self.prefix_cache):
                logger.info("hf_async_cb: the model changed since the last call; its prefix cache is emptied")
                self.scheduler.clear_prefix_cache()
            self._kv_fingerprint = fingerprint

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after writing the weights through `.data`, which no
        version counter sees). Requests running now keep their pages. While a background loop
        serves, the loop empties them between its steps and this waits for it (the scheduler's
        tables are the loop's)."""
        background = self._background
        if background is not None and background.clear_caches():
            return
        if self.prefix_cache is not None:
            self.scheduler.clear_prefix_cache()
        self.tower_outputs.clear()

    def prefix_cache_stats(self) -> dict | None:
        """Cached tokens hit, tokens prefilled, evictions, deferrals, clears, hit rate, pages held, decode
        steps that read shared prefixes once per group and the keys per layer that saved, and the
        towers' images kept, taken and encoded (cumulative). None with prefix caching off."""
        if self.prefix_cache is None:
            return None
        towers = self.tower_outputs
        return dict(self.prefix_cache.stats.as_dict(), cached_pages=len(self.prefix_cache),
                    grouped_decode_steps=self.builder.grouped_steps, keys_read_once=self.builder.keys_read_once,
                    cached_images=len(towers), image_hits=towers.hits, image_misses=towers.misses)

    def _mode(self, mode: str | None) -> str:
        """The loop a call runs: its `mode`, else the config's. An Engine always runs one of its
        loops: "off" (stock generate) is a model.generate(batching="off") matter, refused here."""
        if mode is None:
            return self.config.mode
        resolved = resolve_mode(mode)
        if resolved is None:
            raise ValueError(f"an Engine runs mode 'sync' or 'async', got {mode!r} (stock generate is "
                             "model.generate(..., batching='off')).")
        return resolved

    # -- online API ---------------------------------------------------------------------------
    def _draw_seed(self) -> int:
        """An engine seed from torch's generator; rank 0's on a tensor-parallel model."""
        seed = _random_seed()
        return seed if self.tensor_parallel is None else self.tensor_parallel.agree_seed(seed)

    def _cache_share(self, before: dict) -> dict:
        """The prefix cache's counters since `before` (a run's or a serving loop's share)."""
        after = self.prefix_cache_stats()
        return {k: after[k] - before[k] for k in ("hit_tokens", "prefilled_tokens", "evictions", "deferrals")}

    def largest_pool_pages(self) -> int:
        """The most pages a pool of this engine's config could get: this pool's memory counted free
        (it would be dropped first), the activations' reserve kept (engine/pool_size.py)."""
        return pool_pages(self.config, self.layout, self.dtype, self.device, self._model_config, self.vocab_size,
                          freed_bytes=self.cache.bytes)

    def close(self) -> None:
        """Stop the background loop (cancelling what it still holds), drop the CUDA graphs and give
        the model back as it was (each weight in its own storage again, unless a runtime owns the
        preparation). Idempotent; the engine is unusable afterwards. A start() under way on another
        thread (waiting for the model) finishes first, and its loop is then stopped."""
        with self._lifecycle:
            self._close()

    def _close(self) -> None:
        if self._background is not None:
            if self._background.on_loop_thread:  # the loop would go on with the model given back
                raise RuntimeError("close() cannot run on the engine's loop thread (a callback): call "
                                   "shutdown() there, and close() from another thread.")
            self.shutdown(cancel=True)
        model = self.runner._model()
        # Under the model's guard: a run of this engine on another thread finishes first (its pool
        # freed under it failed inside a step); from inside a run on this thread it is refused.
        with model_guard(model).held("Engine.close") if model is not None else contextlib.nullcontext():
            self._closed = True
            self.graphs = self.runner.graphs = None
            self._pipelines.clear()
            self.cache.free()  # before the weights get their own storage back: that copies them
            if self._owns_preparation:
                self.prepared_model.restore()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was closed (its graphs dropped, the model given back): build a new one.")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @torch.inference_mode(False)  # its I/O slots outlive the call (see __init__; steps: runner.prepared)
    def pipeline(self, mode: str) -> Pipeline:
        """The loop of `mode` ("sync": no overlap, "async": overlap), built once per engine."""
        if mode not in self._pipelines:
            self._pipelines[mode] = Pipeline(self.scheduler, self.builder, self.runner, self.streams,
                                             overlap=(mode == "async"), graphs=self.graphs)
        return self._pipelines[mode]


def _step_until_done(loop, remaining: set[int], progress: Progress) -> None:
    """Step `loop` until no request of `remaining` (ids) is left (Engine.run, above a large chunk of
    the frame stack: engine/stack_chunk.py)."""
    while remaining:
        done = [r for r in loop.step() if id(r) in remaining]
        for r in done:
            remaining.discard(id(r))
        progress.update(done)
