"""Requests, their sampling/stopping parameters, their status and their outputs."""

from __future__ import annotations

import enum
import itertools
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks and stops its tokens (the subset of GenerationConfig we run).

    top_k=0, top_p=1.0 and min_p=0.0 switch those filters off; repetition_penalty (stock's, on the
    request's whole history, greedy rows too) is off at 1.0; no_repeat_ngram_size (0 = off) bans
    every token that would repeat an n-gram of the history; bad_words_ids are token sequences never
    completed (a one-token one is never sampled); sequence_bias maps token sequences to a bias added
    to the sequence's last token when the history ends with the rest of it (a dict, or stock's list
    of [tokens, bias]); min_new_tokens holds the EOS ids back until that many tokens were generated;
    suppress_tokens are never sampled, begin_suppress_tokens not as the first token; eos_token_ids
    may be empty. seed: this request's own random stream, so that its samples do not depend on the
    other requests in its batches (the engine derives one from BatchingConfig.seed when it is None).
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    min_new_tokens: int = 0
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Derived once, read every step by the batch builder and the graph buckets:
    reads_history: bool = field(init=False, repr=False, compare=False)  # a processor reads the history
    blocks_tokens: bool = field(init=False, repr=False, compare=False)  # some tokens may get blocked
    plain: bool = field(init=False, repr=False, compare=False)  # greedy, nothing to apply to the logits
    # This request's row of the sampler's upload, as packed bytes (a step joins them; numpy over
    # tuples cost ~10x more): int64 (top_k, seed or -1), float32 (do_sample, temperature, top_p, min_p).
    sampler_ints: bytes = field(init=False, repr=False, compare=False)
    sampler_floats: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}.")
        if self.max_new_tokens <= 0:
            raise ValueError(
                f"max_new_tokens must be >= 1, got {self.max_new_tokens}: ask for at least one new token "
                "(with max_length, make it larger than the prompt length)."
            )
        if self.do_sample:
            if not self.temperature > 0.0:
                raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature}.")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0, got {self.top_k}.")
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
            if not 0.0 <= self.min_p <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer below 2**63, got {self.seed!r}.")
        for name in ("eos_token_ids", "suppress_tokens", "begin_suppress_tokens"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))
        n = self.no_repeat_ngram_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"no_repeat_ngram_size must be a non-negative integer, got {n!r}.")
        words = tuple(dict.fromkeys(_token_sequence("bad_words_ids", w) for w in self.bad_words_ids))
        object.__setattr__(self, "bad_words_ids", words)
        bias = self.sequence_bias
        items = bias.items() if isinstance(bias, dict) else bias
        merged: dict[tuple[int, ...], float] = {}
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2) or isinstance(item[1], bool) \
                    or not isinstance(item[1], (int, float)):
                raise ValueError(f"sequence_bias entries must be (token ids, bias), got {item!r}.")
            merged[_token_sequence("sequence_bias", item[0])] = float(item[1])
        object.__setattr__(self, "sequence_bias", tuple(merged.items()))
        reads = (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or bool(self.bad_words_ids)
                 or bool(self.sequence_bias))
        blocks = bool(self.min_new_tokens or self.suppress_tokens or self.begin_suppress_tokens)
        object.__setattr__(self, "reads_history", reads)
        object.__setattr__(self, "blocks_tokens", blocks)
        object.__setattr__(self, "plain", not (reads or blocks or self.do_sample))
        object.__setattr__(self, "sampler_ints", struct.pack("<2q", min(self.top_k, 2**62),  # above any vocabulary: off
                                                             -1 if self.seed is None else self.seed))
        # Greedy rows never use their temperature; 1.0 keeps them finite next to sampled rows.
        object.__setattr__(self, "sampler_floats", struct.pack("<4f", float(self.do_sample),
                                                               self.temperature if self.do_sample else 1.0,
                                                               self.top_p, self.min_p))


def _token_sequence(name: str, tokens) -> tuple[int, ...]:
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"{name} holds sequences of token ids, got {tokens!r}.")
    ids = tuple(tokens)
    if not ids or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 for t in ids):
        raise ValueError(f"{name} holds non-empty sequences of non-negative token ids, got {tokens!r}.")
    return tuple(int(t) for t in ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV pages, scheduled in steps
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"  # a stopping criterion (stop string, max_time, user criterion)
    ABORTED = "aborted"


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One sequence being generated. The scheduler works on counts, never on token values.

    num_computed: tokens whose K/V is in the cache (or will be, once the queued steps ran). The next
    step feeds tokens [num_computed, num_computed + n) to the model.
    num_pending: tokens sampled by a queued step whose values the CPU has not seen yet (at most one
    in the async loop); they count in num_tokens, and the device fills them in (carry-over).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_pending: int = 0
    # The slow path: a transformers LogitsProcessorList / StoppingCriteriaList applied to this
    # request's own history (history_prefix + prompt + output, the carried-over token included).
    logits_processor: Any = None
    stopping_criteria: Any = None
    # Read before the prompt by the slow path and the device's history processors (sampling/device_processors.py):
    # stock generate's left padding of the row, which its processors see as part of the row.
    history_prefix: list[int] = field(default_factory=list)
    # The repetition penalty reads the history (prefix included) from this index on (newer
    # transformers skip the padding).
    penalty_start: int = 0
    # Called as on_token(request, token) for every token the request emits, after its status is updated;
    # never for a dropped speculative token.
    on_token: Any = None
    # A copy of another request's prompt (num_return_sequences): it starts from that request's
    # cached prompt pages when they are still there.
    share_from: "Request | None" = None
    # Slow path: keep each step's raw logits and processed scores (generate's output_logits/scores).
    keep_scores: bool = False
    output_scores: list = field(default_factory=list)  # CPU [V] float32 per output token
    output_logits: list = field(default_factory=list)
    # What this request's own logits processor, stopping criterion or token callback raised (it
    # then ended ABORTED); None otherwise.
    error: BaseException | None = None

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, those still in flight included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def blocked_tokens(self) -> tuple[int, ...]:
        """Tokens the next sampled token may not be (see SamplingParams)."""
        p = self.params
        if not p.blocks_tokens:
            return ()
        generated = self.num_sampled
        tokens = p.suppress_tokens
        if generated < p.min_new_tokens:
            tokens = tokens + p.eos_token_ids
        if generated == 0:
            tokens = tokens + p.begin_suppress_tokens
        return tokens

    @property
    def wants_more_tokens(self) -> bool:
        """False once the tokens sampled so far (pending included) reach max_new_tokens."""
        return self.num_sampled < self.params.max_new_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def max_total_tokens(self) -> int:
        """Most tokens this request can ever hold in the cache (the last sampled one is never fed)."""
        return len(self.prompt_token_ids) + self.params.max_new_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def history(self) -> list[int]:
        """What logits processors and stopping criteria see: the row as stock generate holds it."""
        return self.history_prefix + self.prompt_token_ids + self.output_token_ids

    def append_token(self, token: int, logprob: float = float("nan")) -> bool:
        """Record a sampled token; return True when it ends the request (EOS, length or a criterion)."""
        self.output_token_ids.append(token)
        self.output_logprobs.append(logprob)
        if token in self.params.eos_token_ids:
            self.finish_reason = FinishReason.EOS
        elif len(self.output_token_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.stopping_criteria is not None and bool(
                self.stopping_criteria(torch.tensor([self.history()]), None).any()):
            self.finish_reason = FinishReason.STOP
        else:
            return False
        return True

    def to_output(self) -> "RequestOutput":
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            output_token_ids=list(self.output_token_ids),
            logprobs=list(self.output_logprobs),
            finish_reason=self.finish_reason,
            num_preemptions=self.num_preemptions,
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: FinishReason | None
    num_preemptions: int = 0
    logprobs: list[float] = field(default_factory=list)  # of each output token, under the distribution it was drawn from

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def as_token_lists(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validate a batch of prompts given as token-id sequences."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError("prompts must be a list of token-id lists.")
    if len(prompts) == 0:
        raise ValueError("The batch is empty: pass at least one prompt.")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompt {i} is a string; tokenize it first (a list of token ids is expected).")
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token.")
        out.append(ids)
    return out
