"""One step's CUDA graph: static copies of its inputs, their capture and their replay.

Each graph owns static copies of every input tensor of the step; a step copies its freshly
uploaded inputs (and the previous step's tokens, for carry-over) into them on the device, replays
the graph, and clones the sampled tokens out, so that the next replay cannot overwrite tokens
still on their way to the host.

On the CPU there is nothing to capture: a "graph" runs the same function eagerly on its static
tensors, which lets CI test the padding, the static buffers and the carry-over through them.

engine/cuda_graphs.py (DecodeGraphs) decides which graph a step replays and when one is captured.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from hf_async_cb.engine.batch import StepInputs
from hf_async_cb.engine.runner import ModelRunner
from hf_async_cb.model.step_metadata import StepMetadata
from hf_async_cb.sampling.device_processors import SequenceBias, TokenBlock
from hf_async_cb.sampling.sampler import SamplingTensors

logger = logging.getLogger(__name__)

_STATIC = ("input_ids", "carry_src", "position_ids", "logits_indices")
_STATIC_META = ("slot_mapping", "block_table", "query_start", "context_lens")
_SHARED_META = ("group_start", "group_rows", "shared_len")  # a decode step's shared-prefix groups, when it has them
_SAMPLING_INTS = ("top_k", "seed", "token_index")  # uploaded after the tensors above, in the same buffer
_SAMPLING_FLOATS = ("do_sample", "temperature", "top_p", "min_p")  # the slot's float buffer
# A repetition penalty's tensors (penalties.HistoryProcessors), uploaded after the sampling ones.
_PENALTY_INTS = ("sample_rows", "batch_rows", "prefix", "prefix_len", "penalty_start", "ngram")
_PENALTY_FLOATS = ("penalty",)
_BLOCK_INTS = ("rows", "tokens")  # penalties.TokenBlock, uploaded last


def _step_tensors(inputs: StepInputs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The step's uploaded tensors by name, in upload order: (the int64 buffer's, the float32 one's)."""
    ints = {name: getattr(inputs, name) for name in _STATIC}
    ints.update((name, getattr(inputs.meta, name)) for name in _STATIC_META)
    if inputs.meta.group_start is not None:
        ints.update((name, getattr(inputs.meta, name)) for name in _SHARED_META)
    floats = {}
    if inputs.sampling is not None:
        ints.update((name, getattr(inputs.sampling, name)) for name in _SAMPLING_INTS)
        floats.update((name, getattr(inputs.sampling, name)) for name in _SAMPLING_FLOATS)
    if inputs.processors is not None:
        ints.update((name, getattr(inputs.processors, name)) for name in _PENALTY_INTS)
        floats.update((name, getattr(inputs.processors, name)) for name in _PENALTY_FLOATS)
        for kind in ("bias", "bad_words"):
            keys = getattr(inputs.processors, kind)
            if keys is not None:
                ints.update((f"{kind}_{name}", getattr(keys, name)) for name in SequenceBias.FIELDS[:-1])
                floats[f"{kind}_value"] = keys.value
    if inputs.token_block is not None:
        ints.update(("block_" + name, getattr(inputs.token_block, name)) for name in _BLOCK_INTS)
    return ints, floats


class _Static:
    """Static copies of a step's tensors as views of one buffer laid out like the step's packed
    upload (StepInputs.packed), so that loading a step into its graph is one copy."""

    def __init__(self, sources: list[torch.Tensor], packed: torch.Tensor | None) -> None:
        self.flat = None if packed is None else torch.empty_like(packed)
        base = 0 if packed is None else packed.storage_offset()
        self.views = [self.flat[t.storage_offset() - base:][: t.numel()].view(t.shape) for t in sources]

    def load(self, packed: torch.Tensor | None) -> None:
        if self.flat is None:
            return
        if packed.shape != self.flat.shape:
            raise RuntimeError(f"a step's inputs ({packed.numel()} values) do not fit its graph ({self.flat.numel()})")
        self.flat.copy_(packed)


class CapturedGraph:
    def __init__(self, runner: ModelRunner, inputs: StepInputs, previous_tokens: torch.Tensor | None,
                 max_previous: int, pool, stream, decode: bool = True, warm_up: bool = True) -> None:
        """Static tensors start as this step's inputs, so the warm-up and the capture run on real data.
        warm_up: run the step eagerly on the capture stream before recording it.

        The step's inputs arrive packed in one device buffer (slots.IOSlot), and the static tensors
        are views of one buffer laid out the same way, so loading a step is one copy, not eight."""
        device = inputs.input_ids.device
        ints, floats = _step_tensors(inputs)
        self.ints = _Static(list(ints.values()), inputs.packed[0])
        self.floats = _Static(list(floats.values()), inputs.packed[1])
        t = self.tensors = dict(zip(ints, self.ints.views))
        t.update(zip(floats, self.floats.views))
        self.previous = torch.zeros(max_previous, dtype=torch.long, device=device)
        sampling = processors = token_block = None
        if inputs.sampling is not None:  # every sampled row seeded (key_for): no generator draw
            sampling = SamplingTensors(**{name: t[name] for name in _SAMPLING_INTS + _SAMPLING_FLOATS},
                                       unseeded=False)
        if inputs.processors is not None:  # every row and key list padded (penalties.HostProcessors)
            lists = {kind: SequenceBias(**{name: t[f"{kind}_{name}"] for name in SequenceBias.FIELDS})
                     for kind in ("bias", "bad_words") if getattr(inputs.processors, kind) is not None}
            processors = dataclasses.replace(inputs.processors, **lists,
                                             **{name: t[name] for name in _PENALTY_INTS + _PENALTY_FLOATS})
        if inputs.token_block is not None:  # padded to the bucket's pair count
            token_block = TokenBlock(*(t["block_" + name] for name in _BLOCK_INTS))
        meta = StepMetadata(
            **{name: t[name] for name in _STATIC_META + _SHARED_META if name in t}, page_size=inputs.meta.page_size,
            # > 1 for a prefill bucket, whatever its first step: the attention picks decode splits by it.
            max_query_len=inputs.meta.max_query_len if decode else max(2, inputs.meta.max_query_len),
            max_context=inputs.meta.max_context,
            backend=inputs.meta.backend, pool_slots=inputs.meta.pool_slots,
        )
        self.meta = meta
        static = StepInputs(
            input_ids=t["input_ids"], carry_src=t["carry_src"], position_ids=t["position_ids"],
            logits_indices=t["logits_indices"], meta=meta, sampling=sampling, sample_requests=[], processor_rows=[],
            processors=processors, token_block=token_block,
        )
        # No reference back to self (a lambda over self would make a cycle that keeps the runner, and
        # with it the KV pool, alive after Engine.close() until the garbage collector runs).
        self._fn = functools.partial(runner.step, static, self.previous)
        self.out: torch.Tensor | None = None
        self.graph = None
        self.warmed_up = warm_up
        self.load(inputs, previous_tokens)
        if device.type == "cuda":
            self._capture(pool, stream)

    def _capture(self, pool, stream) -> None:
        if self.warmed_up:
            self._warm_up(stream)
        self._record(pool, stream)

    def _warm_up(self, stream) -> None:
        """One eager run on the capture stream itself, so that per-stream state (cuBLAS workspaces, a
        kernel's first load into the process) exists before the capture begins; it writes the same
        K/V as the step itself will, at the same slots, so it changes nothing."""
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self._fn()
        current.wait_stream(stream)

    def _record(self, pool, stream) -> None:
        """The capture, begun and ended on the graph itself rather than through `torch.cuda.graph`,
        whose entry synchronizes the device and empties the caching allocator (and, in older torch,
        collects garbage) to free memory for the graph: in the middle of a call that drains the
        pipeline and makes the next eager steps allocate their memory from the driver again, for
        nothing, since every graph of the engine shares one pool. Its exit only ends the capture."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                out = self._fn()
            except BaseException:
                try:  # leave the stream out of capture mode; the step's own error is the one to see
                    graph.capture_end()
                except RuntimeError:
                    _end_allocating_to(pool)
                raise
            graph.capture_end()
        self.graph, self.out = graph, out

    def load(self, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> None:
        self.ints.load(inputs.packed[0])
        self.floats.load(inputs.packed[1])
        if previous_tokens is not None:
            self.previous[: previous_tokens.numel()].copy_(previous_tokens)
        # Read only when the step runs eagerly (the CPU stand-in): the reference attention's padded view.
        if self.graph is None:
            self.meta.max_query_len = inputs.meta.max_query_len

    def replay(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self._fn()
        return self.out.clone()


def _end_allocating_to(pool) -> None:
    """After a capture whose end failed (an invalidated capture: torch raises at the stream's end of
    capture, before it tells the caching allocator the capture is over), end the allocator's routing
    to the graphs' pool, which would otherwise refuse every later capture ("beginAllocateToPool:
    already recording to mempool_id"). On the H100 with torch 2.11 this did not suffice: the engine
    also captures into a fresh pool after a failure (cuda_graphs.DecodeGraphs._after_failed_capture)."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except (AttributeError, RuntimeError):  # (ended already; or a torch without the binding)
        pass


def release_generators_after_failed_capture() -> None:
    """A capture that raised never reached its end, where torch tells each CUDA generator that the
    capture is over: they stay marked as capturing, and every later random draw of the process
    (a model's init, dropout, sampling) raises "Offset increment outside graph capture". Each
    default generator gets a fresh copy of its own state (same seed and offset, not capturing)."""
    if not torch.cuda.is_available():
        return
    for generator in torch.cuda.default_generators:
        try:
            generator.graphsafe_set_state(generator.clone_state())
        except (AttributeError, RuntimeError) as e:  # an older torch: nothing to repair with
            logger.debug("could not reset a CUDA generator after a failed capture: %s", e)
