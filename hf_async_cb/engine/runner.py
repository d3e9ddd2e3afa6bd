"""Device work of one step: carry-over, the token pool, the model's forward over the packed batch,
logits processors, sampling."""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from hf_async_cb.engine.batch import StepInputs
from hf_async_cb.model import attention, vision
from hf_async_cb.model.callback_forwards import user_code
from hf_async_cb.model.kv_cache import PagedKVCache, cache_keyword
from hf_async_cb.model.kv_layout import layer_indices_mismatch
from hf_async_cb.model.prefix_kv import StepPrefixKV
from hf_async_cb.model.prepared import PreparedModel, weight_storages
from hf_async_cb.sampling.sampler import SamplingTensors, pack, processed_scores, sample
from hf_async_cb.sampling.token_history import TokenHistory

_NO_FEATURES = contextlib.nullcontext()  # a step without deepstack features: nothing to hand the language model

_BYPASSES = "its architecture bypasses the attention interface and is not supported."


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, prepared: PreparedModel,
                 hold_model: bool = True) -> None:
        """hold_model=False: keep only a weak reference (a runtime cached on the model must not keep
        it alive)."""
        self._model = (lambda: model) if hold_model else weakref.ref(model)
        self._owns_preparation = hold_model  # a held Engine's; a generate() runtime checks its own (fits())
        self.prepared_model = prepared
        self.graphs = None  # the engine's CUDA graphs (engine/cuda_graphs.py): dropped when the weights move
        self.cache = cache
        self.num_layers = cache.layout.num_layers
        self._cache_kw = cache_keyword(model)
        # Every token fed to the model, at its K/V slot: what history-based processors read.
        self.history = TokenHistory(cache.num_pages * cache.page_size, cache.keys[0].device)

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the engine's model has been garbage collected.")
        return model

    @contextlib.contextmanager
    def prepared(self, what: str = "generate", serving: bool = False) -> Iterator[None]:
        """The model's fused modules and the paged attention for one call (under the model's
        guard: one engine call at a time; the model checked unchanged once it is held); the model
        is stock again afterwards. Outside inference mode even when the caller is in it: what the
        call allocates and keeps (pool growth, graph buffers, I/O slots) must stay writable by later
        calls made outside it."""
        try:
            with torch.inference_mode(False), self.prepared_model.using(self.model, what=what, serving=serving,
                                                                         check=self.check_model_unchanged):
                yield
        finally:
            self.cache.step = None

    def check_model_unchanged(self) -> None:
        """A held Engine runs the model as it was built on: its fused weights, K/V pools of its dtype
        and CUDA graphs over its storages, around its modules and hooks. A weight given new storage
        since then (`p.data = ...`), a dtype or device move, a module replaced, a hook added or removed,
        a config change or a patch of the code its classes run would run stale weights or code, skip
        the hooks or fail inside a step: refused.
        (Updates in place, as optimizers and load_state_dict make, keep the storages: they run.) A weight
        moved by another preparation of the model (fused by another Engine or a generate() call, or
        given its own storage back: fusion.moved_from) is no change; the CUDA graphs, which read where
        it was, are captured again."""
        model = self.model
        if self._owns_preparation and not self.prepared_model.matches(model):
            raise RuntimeError(
                "the model changed since this Engine was built (a weight given new storage, e.g. `p.data = ...`, "
                "a dtype or device move, a module replaced, a forward hook added or removed, a config change, or "
                "a class's forward or a modeling file's function patched): "
                "close() this engine and build a new one. Updates in place (optimizer steps, load_state_dict, "
                "copy_) need no rebuild; model.generate(batching=...) rebuilds on its own.")
        graphs = self.graphs
        if graphs is not None:  # (another preparation of the model may have fused its weights since, or undone that)
            graphs.keep_over(weight_storages(model))

    @torch.no_grad()
    def copy_pages(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole pages' K/V and tokens (source, destination), on the current stream, before the
        step that reads them (a request taking its last cached page as its own: engine/scheduler.py)."""
        size = self.cache.page_size
        pages = torch.tensor(copies, dtype=torch.int64)  # [C, 2]
        slots = (pages.T[:, :, None] * size + torch.arange(size)).reshape(2, -1)
        device = self.history.tokens.device
        if device.type == "cuda":  # pinned, so the upload does not wait for the queued steps
            slots = slots.pin_memory().to(device, non_blocking=True)
        source, destination = slots[0], slots[1]
        self.cache.copy_slots(source, destination)
        self.history.copy_slots(source, destination)

    @torch.no_grad()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Run the forward; return the logits at the sampled rows [S, V], in the model's dtype."""
        meta = inputs.meta
        meta.begin_forward()
        self.cache.step = meta
        model = self.model
        feed, positions = {"input_ids": inputs.input_ids}, inputs.position_ids
        if (inputs.embeds is not None or inputs.rotary is not None or inputs.visible is not None
                or inputs.prefix_kv is not None or inputs.deepstack is not None):
            feed, positions = self._embedded_step(model, inputs)
        features = _NO_FEATURES if inputs.deepstack is None else vision.deepstack_inputs(model, inputs.deepstack,
                                                                                          inputs.input_ids)
        with attention.current_step(meta), features:
            out = model(
                **feed,
                # Never read (causality comes from the step metadata), but its presence keeps models
                # from probing input_ids for padding, a host sync (GPT-2's warn_if_padding_and_no_attention_mask).
                attention_mask=torch.ones_like(inputs.input_ids),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=inputs.logits_indices,
                **{self._cache_kw: self.cache, attention.METADATA_KWARG: meta},
            )
        self.cache.store_pending()  # new K/V no attention call took (none, when every layer attends)
        if meta.attention_calls != self.num_layers:
            raise RuntimeError(f"the model ran the paged attention in {meta.attention_calls} of its {self.num_layers} "
                               f"layers: {layer_indices_mismatch(model, self.num_layers) or _BYPASSES}")
        return out.logits[0]

    @staticmethod
    def _embedded_step(model: torch.nn.Module, inputs: StepInputs) -> tuple[dict, torch.Tensor]:
        """The forward's inputs for a step that feeds prompt embeddings, rotary positions of their
        own, bidirectional blocks or given K/V (engine/prompt_embeds.py), put on the device here,
        on the step's stream, after what the default stream queued (the embeddings were made there)."""
        device = inputs.input_ids.device
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))
        feed, positions = {"input_ids": inputs.input_ids}, inputs.position_ids
        if inputs.embeds is not None:  # the model's own embedding of the other tokens
            where, values = inputs.embeds
            embedded = model.get_input_embeddings()(inputs.input_ids)
            embedded[0, torch.from_numpy(where).to(device)] = torch.cat(values).to(embedded.dtype)
            feed = {"inputs_embeds": embedded}
        if inputs.rotary is not None:
            positions = torch.from_numpy(inputs.rotary).to(device)[:, None]
        if inputs.visible is not None:
            inputs.meta.visible_from, inputs.meta.visible = torch.from_numpy(inputs.visible).to(device)
        if inputs.prefix_kv is not None:  # K/V given for some positions (model/prefix_kv.py)
            where, pieces = inputs.prefix_kv
            inputs.meta.prefix_kv = StepPrefixKV(torch.from_numpy(where).to(device), pieces)
        return feed, positions

    @torch.no_grad()
    def step(self, inputs: StepInputs, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Carry-over, forward and sampling, all on the device; returns the packed [2, S] tokens and
        log-probabilities (sampling.pack).

        Tokens the CPU did not know when it built the step are gathered first from the sampled
        tokens of the previous step (`previous_tokens`), which the device already has; then the
        step's input ids, all real now, go to the token pool at their cache slots. A carried
        INVALID_TOKEN (a row with no distribution, which the host refuses once it reads it) goes in as
        token 0: the request fails anyway, and the embedding and history gathers never see -1.
        """
        if inputs.carry_src is not None and previous_tokens is not None:
            carried = previous_tokens[inputs.carry_src.clamp(min=0)].clamp_(min=0)
            inputs.input_ids[0] = torch.where(inputs.carry_src >= 0, carried, inputs.input_ids[0])
        self.history.record(inputs.meta.slot_mapping, inputs.input_ids[0])
        logits = self.forward_logits(inputs)
        # Kernels for the draw where Triton runs (the torch sampler sorts and hashes all of [S, V]).
        kernels = inputs.meta.backend == "triton" and (inputs.sampling is None or not inputs.sampling.unseeded)
        if (kernels and inputs.processors is None and inputs.token_block is None and not inputs.processor_rows
                and not inputs.keep_rows):  # nothing to apply: the kernels read the model's logits as they are
            return _draw_packed(logits, inputs.sampling)
        logits = logits.float()  # processors and samplers work in float32, as stock generate does
        raw = logits[inputs.keep_rows].clone() if inputs.keep_rows else None
        if inputs.processors is not None:
            inputs.processors.apply(logits, self.history, inputs.meta)
        if inputs.token_block is not None:
            inputs.token_block.apply(logits)
        own: dict[int, torch.Tensor] = {}  # row -> the scores its processor returned, in their own dtype
        if inputs.processor_rows:
            with user_code():  # (a processor may run the model: model/callback_forwards.py)
                self._apply_processor_rows(inputs, logits, previous_tokens, own)
        if inputs.keep_rows:
            # The slow path: output_scores / output_logits (rows kept on the device, read after the step).
            rows = inputs.keep_rows
            sampling = inputs.sampling
            if sampling is not None:
                sampling = sampling.rows(rows)
            inputs.kept = (raw, processed_scores(logits[rows], sampling), _own_dtype_scores(rows, own, sampling))
        packed = _draw_packed(logits, inputs.sampling) if kernels else pack(*sample(logits, inputs.sampling))
        if own:
            _draw_wide_rows(packed, own, logits.dtype, inputs.sampling)
        return packed

    @staticmethod
    def _apply_processor_rows(inputs: StepInputs, logits: torch.Tensor, previous_tokens: torch.Tensor | None,
                              own: dict[int, torch.Tensor]) -> None:
        """The slow path: each request's transformers LogitsProcessorList on its full history. Processors
        batched across rows (`batched_by`: generate/guidance.py) first get the step's rows at once."""
        rows = []
        for row, processor, history, pending_row in inputs.processor_rows:
            history = history.to(logits.device)
            if pending_row >= 0:
                history = torch.cat([history, previous_tokens[pending_row : pending_row + 1].clamp(min=0)])
            rows.append((row, processor, history))
        _before_step(rows)
        for row, processor, history in rows:
            try:
                scores = _one_row(processor(history[None], logits[row : row + 1]), logits.shape[1])
                logits[row] = scores
                if scores.dtype != logits.dtype and scores.is_floating_point():
                    own[row] = scores  # e.g. `scores.half()`: see _own_dtype_scores
            except BaseException as error:  # noqa: BLE001 - this request's own code: the pipeline fails it alone
                if inputs.faults is None:
                    inputs.faults = {}
                inputs.faults[row] = error
                logits[row] = 0.0  # a valid draw whatever the processor left; the token is dropped


def _before_step(rows: list) -> None:
    """Hand each owner of batched processors the step's rows it serves ((processor, history [1, n]));
    an owner that fails leaves its rows to compute alone (their own calls then fail their requests)."""
    owners: dict[int, tuple] = {}
    for _, processor, history in rows:
        for p in processor if isinstance(processor, list) else (processor,):  # (one callable, or a list)
            owner = getattr(p, "batched_by", None)
            if owner is not None:
                owners.setdefault(id(owner), (owner, []))[1].append((p, history[None]))
    for owner, entries in owners.values():
        try:
            owner.before_step(entries)
        except Exception:  # noqa: BLE001 - each row's own call raises it again, failing that request alone
            for p, _ in entries:
                p.logits = None


def _one_row(scores, vocab: int) -> torch.Tensor:
    """A logits processor's result for its batch of one row, as that row's [vocab] scores: [1, vocab], as
    stock's processors return, or [vocab], which stock's batch of one reads alike. Anything else (a
    scalar, several rows, another width) is refused: written into the row it would be broadcast,
    and every score of the row equal."""
    if isinstance(scores, torch.Tensor) and tuple(scores.shape) in ((1, vocab), (vocab,)):
        return scores.reshape(vocab)
    shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
    raise ValueError(f"a logits processor returned {shape} for a batch of one row of {vocab} scores; "
                     f"expected a tensor [1, {vocab}] (one row per row of the batch it was given).")


def _own_dtype_scores(rows: list[int], own: dict[int, torch.Tensor],
                      sampling: SamplingTensors | None) -> dict[int, torch.Tensor]:
    """Kept row index -> its processed scores in the dtype its logits processor returned, for the
    kept `rows` whose processor returned another dtype than float32. Stock generate stores what its
    processor list returns as `scores` (fp16 after a caller's `scores.half()`, float64 after a
    `.double()`; its warpers, in the list, keep that dtype), so the engine reports those values in
    that dtype too, from the processor's own tensor (float32 would round float64 values). Its
    `logits` stay float32, as stock's (it casts the model's logits to float32 whatever their dtype).
    `sampling`: the parameters of `rows` (SamplingTensors.rows), or None."""
    return {i: processed_scores(own[row][None], sampling.rows([i]) if sampling is not None else None)[0]
            .to(own[row].dtype) for i, row in enumerate(rows) if row in own}


def _draw_wide_rows(packed: torch.Tensor, own: dict[int, torch.Tensor], dtype: torch.dtype,
                    sampling: SamplingTensors | None) -> None:
    """Redraw, in `packed`, the rows whose logits processor returned a dtype wider than `dtype`
    (float64), from those values: their float32 copy may round two different scores to one, where
    argmax then takes the lower id while stock's argmax over the returned float64 values takes the
    higher. (A narrower dtype, fp16 or bf16, converts to float32 exactly: its ties are the same.)"""
    wide = [row for row, scores in own.items() if torch.promote_types(scores.dtype, dtype) != dtype]
    if wide:
        scores = torch.stack([own[row].to(packed.device) for row in wide])
        packed[:, wide] = pack(*sample(scores, sampling.rows(wide) if sampling is not None else None))


def _draw_packed(logits: torch.Tensor, sampling: SamplingTensors | None) -> torch.Tensor:
    """sampling.pack(*sampling.sample(logits, sampling)) in Triton kernels (seeded rows only)."""
    if sampling is None:
        from hf_async_cb.kernels.draw_greedy import greedy_packed

        return greedy_packed(logits)  # all greedy: one pass over the logits
    from hf_async_cb.kernels.draw_sampled import sampled_packed

    return sampled_packed(logits, sampling)
