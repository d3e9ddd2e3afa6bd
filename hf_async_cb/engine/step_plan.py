"""A step's plan: which tokens of which requests it feeds, what it samples, which requests the
scheduler preempted to make room, and which pages it copies before its forward. Made by
engine/scheduler.py, read by the graph-bucket choice (engine/cuda_graphs.py), the batch builder
(engine/batch.py) and the pipeline (engine/pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hf_async_cb.engine.requests import Request


@dataclass(slots=True)
class ScheduledChunk:
    """Feed tokens [start, start + num_tokens) of `request`; sample after them when `samples`."""

    request: Request
    start: int
    num_tokens: int
    samples: bool


@dataclass
class StepPlan:
    """A step's chunks, and the requests preempted to make room for them.

    The per-chunk columns below are derived once, on first use, and shared by the graph-bucket
    choice and the batch builder, which both read every chunk of every step. A plan is not
    changed after the scheduler made it."""

    chunks: list[ScheduledChunk]
    preempted: list[Request]
    with_embeds: bool = True  # some request may feed prompt embeddings (False: none does, skip the look)
    # (source page, destination page) pairs whose K/V (and token history) the step copies before its
    # forward: a request whose whole known sequence is cached takes its last page as a copy (below).
    page_copies: tuple[tuple[int, int], ...] = ()

    @cached_property
    def requests(self) -> list[Request]:
        return [c.request for c in self.chunks]

    @cached_property
    def starts(self) -> list[int]:
        return [c.start for c in self.chunks]

    @cached_property
    def sizes(self) -> list[int]:
        """Tokens each chunk feeds."""
        return [c.num_tokens for c in self.chunks]

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.sizes)

    @cached_property
    def samples(self) -> list[bool]:
        """Whether each chunk samples a token after its last one."""
        return [c.samples for c in self.chunks]

    @cached_property
    def all_sample(self) -> bool:
        return all(self.samples)

    @cached_property
    def plain(self) -> bool:
        """Every request picks greedily with nothing to apply to its logits (SamplingParams.plain),
        no logits processor of its own and no scores to keep: nothing per row beyond the token."""
        for r in self.requests:
            if r.logits_processor is not None or r.keep_scores or not r.params.plain:
                return False
        return True

    @cached_property
    def embedded(self) -> list[int]:
        """The chunks that feed prompt embeddings or multimodal rotary positions (PromptEmbeds.feeds):
        the step runs eagerly, with `inputs_embeds`."""
        if not self.with_embeds:
            return []
        return [i for i, c in enumerate(self.chunks)
                if c.request.embeds is not None and c.request.embeds.feeds(c.start, c.start + c.num_tokens)]

    @cached_property
    def rotary(self) -> bool:
        """Some request has rotary positions of its own (a multimodal prompt's)."""
        return self.with_embeds and any(r.embeds is not None and r.embeds.rope is not None for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
