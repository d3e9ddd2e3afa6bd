"""Requests, their sampling/stopping parameters, their status and their outputs."""

from __future__ import annotations

import enum
import itertools
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from hf_async_cb.engine.eos import MODEL_EOS, ModelEos


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks and stops its tokens (the subset of GenerationConfig we run).

    top_k=0, top_p=1.0 and min_p=0.0 switch those filters off; repetition_penalty (stock's, on the
    request's whole history, greedy rows too) is off at 1.0; no_repeat_ngram_size (0 = off) bans
    every token that would repeat an n-gram of the history; bad_words_ids are token sequences never
    completed (a one-token one is never sampled); sequence_bias maps token sequences to a bias added
    to the sequence's last token when the history ends with the rest of it (a dict, or stock's list
    of [tokens, bias]); min_new_tokens holds the EOS ids back until that many tokens were generated;
    suppress_tokens are never sampled, begin_suppress_tokens not as the first token; eos_token_ids:
    one id or several, by default the model's (MODEL_EOS, filled in by the Engine: engine/eos.py),
    () to run past EOS. seed: this request's own random stream, so that its samples do not depend on the
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
    eos_token_ids: tuple[int, ...] | ModelEos = MODEL_EOS
    seed: int | None = None
    # Derived once, read every step by the batch builder and the graph buckets:
    reads_history: bool = field(init=False, repr=False, compare=False)  # a processor reads the history
    blocks_tokens: bool = field(init=False, repr=False, compare=False)  # some tokens may get blocked
    plain: bool = field(init=False, repr=False, compare=False)  # greedy, nothing to apply to the logits
    # This request's row of the sampler's upload, as packed bytes (a step joins them; numpy over
    # tuples cost ~10x more): int64 (top_k, seed or -1), float32 (do_sample, temperature, top_p, min_p).
    sampler_ints: bytes = field(init=False, repr=False, compare=False)
    sampler_floats: bytes = field(init=False, repr=False, compare=False)

    @property
    def unseeded(self) -> bool:
        """Samples without a seed of its own: the engine gives it one (engine.seed_requests)."""
        return self.do_sample and self.seed is None

    def __post_init__(self) -> None:
        """Check every field's type and range (a ValueError naming the field, not a struct.error or
        a TypeError later) and normalise them: ints, floats, tuples of token ids. Values already in
        that form take the fast checks (dataclasses.replace re-runs this for every seeded request)."""
        set_ = object.__setattr__
        max_new = self.max_new_tokens
        if type(max_new) is not int:
            if isinstance(max_new, (float, np.floating)) and float(max_new).is_integer():
                max_new = int(max_new)  # stock generate runs max_new_tokens=3.0
            elif (max_new := _as_int(max_new)) is None:
                raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}.")
            set_(self, "max_new_tokens", max_new)
        if max_new <= 0:
            raise ValueError(
                f"max_new_tokens must be >= 1, got {max_new}: ask for at least one new token "
                "(with max_length, make it larger than the prompt length)."
            )
        if type(self.do_sample) is not bool:
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}.")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if type(value) is not float:
                set_(self, name, _as_float(name, value))
        for name in ("top_k", "no_repeat_ngram_size", "min_new_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                value = _as_int(value)
                if value is None or value < 0:
                    raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}.")
                set_(self, name, value)
        if self.do_sample:
            if not self.temperature > 0.0:
                raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature}.")
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
            if not 0.0 <= self.min_p <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            seed = _as_int(self.seed)
            if seed is None or not 0 <= seed < 2**63:
                raise ValueError(f"seed must be None or a non-negative integer below 2**63, got {self.seed!r}.")
            set_(self, "seed", seed)
        eos = self.eos_token_ids
        if eos is None:  # stock's eos_token_id=None means no EOS, which here would read as the default
            raise ValueError("eos_token_ids=None is ambiguous: leave it out for the model's EOS ids, or pass () "
                             "to run past EOS.")
        if eos is not MODEL_EOS:
            set_(self, "eos_token_ids", (_token_id("eos_token_ids", eos),) if _as_int(eos) is not None
                 else _token_ids("eos_token_ids", eos))  # one id, as stock's eos_token_id, or several
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            set_(self, name, _token_ids(name, getattr(self, name)))
        words = self.bad_words_ids
        if type(words) is not tuple or words:
            if not _is_iterable(words):
                raise ValueError(f"bad_words_ids must be a sequence of token-id sequences, got {words!r}.")
            set_(self, "bad_words_ids", tuple(dict.fromkeys(_token_sequence("bad_words_ids", w) for w in words)))
        bias = self.sequence_bias
        if type(bias) is not tuple or bias:
            if not (isinstance(bias, dict) or _is_iterable(bias)):
                raise ValueError(f"sequence_bias must be a dict or a sequence of (token ids, bias), got {bias!r}.")
            merged: dict[tuple[int, ...], float] = {}
            for item in (bias.items() if isinstance(bias, dict) else bias):
                if not (isinstance(item, (tuple, list)) and len(item) == 2) or not _is_real(item[1]):
                    raise ValueError(f"sequence_bias entries must be (token ids, bias), got {item!r}.")
                merged[_token_sequence("sequence_bias", item[0])] = float(item[1])
            set_(self, "sequence_bias", tuple(merged.items()))
        reads = (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or bool(self.bad_words_ids)
                 or bool(self.sequence_bias))
        blocks = bool(self.min_new_tokens or self.suppress_tokens or self.begin_suppress_tokens)
        set_(self, "reads_history", reads)
        set_(self, "blocks_tokens", blocks)
        set_(self, "plain", not (reads or blocks or self.do_sample))
        set_(self, "sampler_ints", struct.pack("<2q", min(self.top_k, 2**62),  # above any vocabulary: off
                                               -1 if self.seed is None else self.seed))
        # Greedy rows never use their temperature; 1.0 keeps them finite next to sampled rows.
        set_(self, "sampler_floats", struct.pack("<4f", float(self.do_sample),
                                                 self.temperature if self.do_sample else 1.0, self.top_p, self.min_p))


def _as_int(value: Any) -> int | None:
    """`value` as an int when it is an integer (numpy / 0-d torch integers too); None for anything
    else, bools and floats included: a float token id or count would be silently truncated."""
    if type(value) is int:
        return value
    if isinstance(value, np.integer) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point \
            and not value.dtype.is_complex and value.dtype != torch.bool:
        return int(value)
    return None


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _as_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    return float(value)


def _is_iterable(value: Any) -> bool:
    return hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict))


def _token_id(name: str, value: Any) -> int:
    token = _as_int(value)
    if token is None or token < 0:
        raise ValueError(f"{name} holds non-negative integer token ids, got {value!r}.")
    return token


def _token_ids(name: str, values: Any) -> tuple[int, ...]:
    if type(values) is tuple and all(type(t) is int and t >= 0 for t in values):
        return values
    if not _is_iterable(values):
        raise ValueError(f"{name} must be a sequence of token ids, got {values!r}.")
    return tuple(_token_id(name, t) for t in values)


def _token_sequence(name: str, tokens) -> tuple[int, ...]:
    if not _is_iterable(tokens):
        raise ValueError(f"{name} holds sequences of token ids, got {tokens!r}.")
    ids = tuple(tokens)
    if not ids or any(_as_int(t) is None or t < 0 for t in ids):
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
    # Embeddings fed at some prompt positions instead of their tokens', and the prompt's own rotary
    # positions (engine/prompt_embeds.py); None: token ids only.
    embeds: Any = None
    # Slow path: keep each step's raw logits and processed scores (generate's output_logits/scores).
    keep_scores: bool = False
    output_scores: list = field(default_factory=list)  # CPU [V] per output token: float32, or its processor's dtype
    # The stopping criterion is handed the scores so far, as stock hands its criteria the scores it
    # returns (return_dict_in_generate and output_scores): a tuple of [1, V], one per output token.
    criteria_read_scores: bool = False
    output_logits: list = field(default_factory=list)
    # What this request's own logits processor, stopping criterion or token callback raised (it
    # then ended ABORTED); None otherwise.
    error: BaseException | None = None
    # When the step that samples its first token was built (time.perf_counter()), where the pipeline
    # stamps them (Pipeline.stamp_first_builds: the serving benchmark's split of TTFT); else None.
    first_build_s: float | None = None
    # history() as an int64 tensor, extended as tokens arrive (history_tensor), and how much of it is filled.
    _history: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _history_filled: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Made without an Engine (which fills in the model's EOS ids: make_request), a request has no
        # model to take them from: MODEL_EOS then stops on none.
        if self.params.eos_token_ids is MODEL_EOS:
            self.params = replace(self.params, eos_token_ids=())

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

    def history_tensor(self, length: int | None = None) -> torch.Tensor:
        """The first `length` tokens of history() (None: all of it), a 1-D int64 CPU tensor: a view of a
        buffer the request keeps and extends by the tokens that arrived since the last call. Built
        anew from the lists, it cost O(length) per token of every row a stopping criterion or logits
        processor reads (720 us at 4K tokens: a step of 64 such rows spent ~46 ms on the host). Each
        view keeps its length; later tokens land past it. Not to be written into."""
        head = len(self.history_prefix) + len(self.prompt_token_ids)
        total = head + len(self.output_token_ids)
        length = total if length is None else length
        if not 0 <= length <= total:
            raise ValueError(f"history_tensor: {length} tokens asked of a history of {total}")
        buffer, filled = self._history, self._history_filled
        if buffer is None or filled < head:  # (the prompt part first, once)
            buffer = torch.empty(max(16, total + self.params.max_new_tokens // 4), dtype=torch.long)
            buffer[:head] = torch.tensor(self.history_prefix + self.prompt_token_ids, dtype=torch.long)
            filled = head
        if total > buffer.numel():  # grown geometrically: O(1) per token, amortised
            grown = torch.empty(max(total, 2 * buffer.numel()), dtype=torch.long)
            grown[:filled] = buffer[:filled]
            buffer = grown
        if filled < total:
            buffer[filled:total] = torch.tensor(self.output_token_ids[filled - head:], dtype=torch.long)
            filled = total
        self._history, self._history_filled = buffer, filled
        return buffer[:length]

    def append_token(self, token: int, logprob: float = float("nan")) -> bool:
        """Record a sampled token; return True when it ends the request (EOS, length or a criterion)."""
        self.output_token_ids.append(token)
        self.output_logprobs.append(logprob)
        if token in self.params.eos_token_ids:
            self.finish_reason = FinishReason.EOS
        elif len(self.output_token_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.stopping_criteria is not None and bool(torch.as_tensor(
                self.stopping_criteria(self.history_tensor()[None], self._criteria_scores())).any()):
            self.finish_reason = FinishReason.STOP
        else:
            return False
        return True

    def _criteria_scores(self) -> tuple | None:
        if not self.criteria_read_scores:
            return None
        return tuple(s[None] for s in self.output_scores)

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
    """Validate a batch of prompts given as token-id sequences (lists, numpy arrays or tensors).
    Token ids are integers: float or bool ones are refused rather than silently truncated."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError("prompts must be a list of token-id lists.")
    if len(prompts) == 0:
        raise ValueError("The batch is empty: pass at least one prompt.")
    return [_prompt_ids(i, p) for i, p in enumerate(prompts)]


def _prompt_ids(i: int, prompt: Any) -> list[int]:
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"prompt {i} is a string; tokenize it first (a list of token ids is expected).")
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        dtype = prompt.dtype
        integral = (not (dtype.is_floating_point or dtype.is_complex) and dtype != torch.bool
                    if isinstance(prompt, torch.Tensor) else dtype.kind in "iu")
        if not integral or prompt.ndim != 1:
            raise ValueError(f"prompt {i} must be a 1-D sequence of integer token ids, got a {prompt.ndim}-D "
                             f"{type(prompt).__name__} of {dtype}.")
        ids = prompt.tolist()
    elif not hasattr(prompt, "__iter__"):
        raise ValueError(f"prompt {i} must be a sequence of integer token ids, got {prompt!r}.")
    else:
        ids = [t if type(t) is int else _as_int(t) for t in prompt]
        if None in ids:
            bad = next(t for t, v in zip(prompt, ids) if v is None)
            raise ValueError(f"prompt {i} holds {bad!r} ({type(bad).__name__}): token ids must be integers.")
    if not ids:
        raise ValueError(f"prompt {i} is empty: every prompt needs at least one token.")
    return ids


def params_per_prompt(prompts: Sequence, params, param_kwargs: dict) -> list:
    """One SamplingParams per prompt, from generate()'s `params` (one for all, one per prompt, or
    None: built from the keyword arguments)."""
    if params is None:
        params = SamplingParams(**param_kwargs)
    elif param_kwargs:
        raise ValueError("pass either params or keyword sampling arguments, not both.")
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if isinstance(params, (dict, str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(f"params must be a SamplingParams or a list of them (one per prompt), got "
                        f"{type(params).__name__}; or pass the options as keywords (max_new_tokens=..., ...).")
    per_prompt = list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts.")
    for i, p in enumerate(per_prompt):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a SamplingParams.")
    return per_prompt


def one_params(params, param_kwargs: dict) -> "SamplingParams":
    """add_request's SamplingParams: `params`, or one built from the keyword arguments (not both)."""
    if params is None:
        return SamplingParams(**param_kwargs)
    if param_kwargs:
        raise ValueError("pass either params or keyword sampling arguments, not both.")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}; or pass the options as "
                        "keywords (max_new_tokens=..., ...).")
    return params


def as_stock_list(given, name: str):
    """A request's `logits_processor` / `stopping_criteria` as stock generate takes them: None, one
    callable (a LogitsProcessorList, a StoppingCriteriaList, or one processor or criterion), or a
    plain list or tuple of callables, which becomes the transformers list (stock wraps it so too).
    Anything else is refused here, in the caller's thread, rather than failing the request later."""
    if given is None or callable(given):  # (transformers' lists are callable lists)
        return given
    if isinstance(given, (list, tuple)) and all(callable(item) for item in given):
        from transformers import LogitsProcessorList, StoppingCriteriaList

        return (LogitsProcessorList if name == "logits_processor" else StoppingCriteriaList)(given)
    kind = "LogitsProcessorList" if name == "logits_processor" else "StoppingCriteriaList"
    raise ValueError(f"{name} takes a transformers {kind}, a list of callables or one callable "
                     f"(input_ids, scores), got {given!r}.")
