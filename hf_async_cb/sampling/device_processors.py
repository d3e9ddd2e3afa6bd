"""Logits processors the engine runs on the device, for every request of a step at once.

History-based ones read each row's history from the device token pool (token_history.py), as stock
generate holds the row: its left padding (`Request.history_prefix`), prompt and output, the token
carried over from the step in flight included (carry-over resolves it before the pool is written).
The host sends only per-row values and the short prefixes, never the histories. In stock's order:

    sequence_bias         SequenceBiasLogitsProcessor: add a key's bias to its last token when the
                          history ends with the rest of the key (one-token keys: always)
    repetition_penalty    RepetitionPenaltyLogitsProcessor: every distinct token of the history
                          (from `Request.penalty_start`) once; score < 0 multiplies, else divides
    no_repeat_ngram_size  NoRepeatNGramLogitsProcessor: ban each token that would complete an
                          n-gram already in the history
    bad_words_ids         NoBadWordsLogitsProcessor: a sequence bias of -inf
    TokenBlock            EOS held back by min_new_tokens, suppress_tokens, begin_suppress_tokens

Writes go through one flat view of the logits. A ban or a penalty never needs a value per
(row, token) built on the host: each history cell proposes a new value and `scatter_reduce`
keeps the smaller (bans, penalties > 1) or the larger (penalties < 1), so a token seen many times
is changed once and cells that change nothing propose +-inf. Biases add, as stock does, one
pre-summed value per (row, token). Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from hf_async_cb.sampling.token_history import RowHistories, TokenHistory
from hf_async_cb.engine.graph_keys import pow2

_INF = float("inf")


@functools.lru_cache(maxsize=None)
def whole_key_in_history() -> bool:
    """Whether the installed transformers' SequenceBiasLogitsProcessor skips a multi-token key
    longer than the history (5.17) rather than only one whose prefix is longer (newer): asked
    of stock itself, on a history of one token."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    scores = SequenceBiasLogitsProcessor({(0, 1): 1.0})(torch.tensor([[0]]), torch.zeros(1, 2))
    return bool(scores[0, 1] == 0.0)


@dataclass(frozen=True)
class SequenceBlock:
    """One request's keys, host side, in stock's order (one-token keys, then longer keys grouped by
    length); built once per distinct set of keys."""

    prefix: np.ndarray  # [E, K] the key without its last token, -1 padded
    length: np.ndarray  # [E] the key's length - 1
    min_history: np.ndarray  # [E] shortest history on which stock applies the key
    target: np.ndarray  # [E] index of the key's last token in `tokens`
    value: np.ndarray  # [E] float32 bias
    tokens: np.ndarray  # [U] distinct last tokens

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(keys: tuple[tuple[tuple[int, ...], float], ...]) -> "SequenceBlock":
        ordered = [kv for kv in keys if len(kv[0]) == 1]
        for length in dict.fromkeys(len(k) for k, _ in keys if len(k) > 1):
            ordered += [kv for kv in keys if len(kv[0]) == length]
        width = max(len(k) for k, _ in ordered) - 1
        prefix = np.full((len(ordered), width), -1, dtype=np.int64)
        for i, (key, _) in enumerate(ordered):
            prefix[i, : len(key) - 1] = key[:-1]
        tokens = list(dict.fromkeys(k[-1] for k, _ in ordered))
        length = np.array([len(k) - 1 for k, _ in ordered], dtype=np.int64)
        extra = int(whole_key_in_history())
        return SequenceBlock(
            prefix=prefix, length=length, min_history=np.where(length > 0, length + extra, 0),
            target=np.array([tokens.index(k[-1]) for k, _ in ordered], dtype=np.int64),
            value=np.array([v for _, v in ordered], dtype=np.float32), tokens=np.array(tokens, dtype=np.int64))


@dataclass
class SequenceBias:
    """Keys of several rows at once: E entries, U distinct (row, last token) targets."""

    rows: torch.Tensor  # [E] history row of each key
    prefix: torch.Tensor  # [E, K]
    length: torch.Tensor  # [E]
    min_history: torch.Tensor  # [E]
    target: torch.Tensor  # [E] in [0, U)
    target_rows: torch.Tensor  # [U] history row
    target_tokens: torch.Tensor  # [U]
    value: torch.Tensor  # [E] float32

    INTS = 7
    FIELDS = ("rows", "prefix", "length", "min_history", "target", "target_rows", "target_tokens", "value")

    @staticmethod
    def host_parts(blocks: list[tuple[int, SequenceBlock]], padded: bool = False
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """blocks: (history row, its keys) -> (ints, floats) to upload. padded (a CUDA-graph
        bucket): to `sequence_shape(blocks)`, with keys that never match and targets that get 0."""
        num = [len(b.length) for _, b in blocks]
        width = max(b.prefix.shape[1] for _, b in blocks)
        if padded:
            entries, width, targets = sequence_shape([b for _, b in blocks])
            blocks = blocks + [(0, _NO_KEY)] * (entries - sum(num))
            num += [1] * (entries - sum(num))
            blocks += [(0, _NO_TARGET)] * (targets - sum(len(b.tokens) for _, b in blocks))
            num += [0] * (len(blocks) - len(num))
        prefix = np.full((sum(num), width), -1, dtype=np.int64)
        start = 0
        for n, (_, b) in zip(num, blocks):
            prefix[start : start + n, : b.prefix.shape[1]] = b.prefix
            start += n
        distinct = np.array([len(b.tokens) for _, b in blocks])
        offsets = np.repeat(np.cumsum(distinct) - distinct, num)
        rows = np.array([r for r, _ in blocks], dtype=np.int64)
        ints = [np.repeat(rows, num), prefix, np.concatenate([b.length for _, b in blocks]),
                np.concatenate([b.min_history for _, b in blocks]),
                np.concatenate([b.target for _, b in blocks]) + offsets, np.repeat(rows, distinct),
                np.concatenate([b.tokens for _, b in blocks])]
        return [torch.from_numpy(a) for a in ints], [torch.from_numpy(np.concatenate([b.value for _, b in blocks]))]

    def apply(self, logits: torch.Tensor, sample_rows: torch.Tensor, hist: RowHistories) -> None:
        width = hist.width
        offsets = torch.arange(self.prefix.shape[1], device=logits.device)
        cells = ((width - self.length)[:, None] + offsets).clamp(0, width - 1)
        tail = hist.tokens[self.rows[:, None], cells]  # the history's last `length` tokens, then filler
        matches = ((tail == self.prefix) | (offsets >= self.length[:, None])).all(dim=1)
        matches &= hist.length[self.rows] >= self.min_history
        bias = torch.zeros(self.target_rows.shape[0], device=logits.device)
        bias.index_add_(0, self.target, torch.where(matches, self.value, 0.0))
        vocab = logits.shape[1]
        logits.view(-1).index_add_(0, sample_rows[self.target_rows] * vocab + self.target_tokens, bias)


def sequence_shape(blocks: list[SequenceBlock]) -> tuple[int, int, int]:
    """(keys, prefix width, targets) of a padded step's SequenceBias: powers of two (at least 8 keys
    and targets; the width 0 when every key is one token long)."""
    keys = sum(len(b.length) for b in blocks)
    width = max(b.prefix.shape[1] for b in blocks)
    targets = sum(len(b.tokens) for b in blocks)
    return pow2(max(8, keys)), width and pow2(width), pow2(max(8, targets + 1))  # >= 1 padding target


# Padding of a SequenceBias: a key no history reaches (bias 0), aimed at the first padding target
# (it has no target of its own, so its offset is the real targets' count), and a target with no key.
_NO_KEY = SequenceBlock(prefix=np.zeros((1, 0), dtype=np.int64), length=np.zeros(1, dtype=np.int64),
                        min_history=np.full(1, 1 << 62, dtype=np.int64), target=np.zeros(1, dtype=np.int64),
                        value=np.zeros(1, dtype=np.float32), tokens=np.zeros(0, dtype=np.int64))
_NO_TARGET = SequenceBlock(prefix=np.zeros((0, 0), dtype=np.int64), length=np.zeros(0, dtype=np.int64),
                           min_history=np.zeros(0, dtype=np.int64), target=np.zeros(0, dtype=np.int64),
                           value=np.zeros(0, dtype=np.float32), tokens=np.zeros(1, dtype=np.int64))


def _reduce(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, how: str) -> None:
    """logits[rows, tokens] = how(logits[rows, tokens], values) over broadcast [R, N] cells."""
    index = rows[:, None] * logits.shape[1] + tokens
    logits.view(-1).scatter_reduce_(0, index.reshape(-1), values.reshape(-1), reduce=how)


@dataclass
class HistoryProcessors:
    """The rows of a step that read their history (R of the S sampled rows), and what they run."""

    sample_rows: torch.Tensor  # [R] row in the step's logits
    batch_rows: torch.Tensor  # [R] request in the step's block table
    prefix: torch.Tensor  # [R, P] history prefix (stock's left padding), -1 padded
    prefix_len: torch.Tensor  # [R]
    penalty_start: torch.Tensor  # [R] first history index the penalty reads
    ngram: torch.Tensor  # [R] no_repeat_ngram_size, 0 = off
    penalty: torch.Tensor  # [R] float32, 1.0 = off
    bias: SequenceBias | None
    bad_words: SequenceBias | None
    host: "HostProcessors"

    @classmethod
    def from_device(cls, host: "HostProcessors | None", ints: list[torch.Tensor],
                    floats: list[torch.Tensor]) -> "HistoryProcessors | None":
        if host is None:
            return None
        (sample_rows, batch_rows, prefix, prefix_len, penalty_start, ngram), ints = ints[:6], ints[6:]
        (penalty,), floats = floats[:1], floats[1:]
        sequences = []
        for present in (host.has_bias, host.has_bad_words):
            if present:
                sequences.append(SequenceBias(*ints[: SequenceBias.INTS], value=floats[0]))
                ints, floats = ints[SequenceBias.INTS:], floats[1:]
            else:
                sequences.append(None)
        return cls(sample_rows, batch_rows, prefix, prefix_len, penalty_start, ngram, penalty, *sequences, host)

    def apply(self, logits: torch.Tensor, history: TokenHistory, meta) -> None:
        """Process `logits` [S, V] (contiguous) in place, in stock's order."""
        hist = history.rows(meta, self.batch_rows, self.prefix, self.prefix_len)
        rows, vocab = self.sample_rows, logits.shape[1]
        if self.bias is not None:
            self.bias.apply(logits, rows, hist)
        if self.host.penalty_above or self.host.penalty_below:
            tokens = hist.tokens
            used = (hist.index >= self.penalty_start[:, None]) & (tokens < vocab)
            tokens = tokens.clamp(0, vocab - 1)
            score = logits[rows[:, None], tokens]
            penalty = self.penalty[:, None]
            penalised = torch.where(score < 0, score * penalty, score / penalty)
            # A penalty above 1 only lowers a score, one below 1 only raises it.
            if self.host.penalty_above:
                _reduce(logits, rows, tokens, torch.where(used & (penalty > 1), penalised, _INF), "amin")
            if self.host.penalty_below:
                _reduce(logits, rows, tokens, torch.where(used & (penalty < 1), penalised, -_INF), "amax")
        if self.host.max_ngram:
            self._ban_repeated_ngrams(logits, hist)
        if self.bad_words is not None:
            self.bad_words.apply(logits, rows, hist)

    def _ban_repeated_ngrams(self, logits: torch.Tensor, hist: RowHistories) -> None:
        """Window w (cells w .. w + n - 1) bans its last token when its first n - 1 tokens are the
        history's last n - 1 (the window ending at the history's end cannot be the suffix's own)."""
        longest, width, vocab = self.host.max_ngram, hist.width, logits.shape[1]
        tokens, n = hist.tokens, self.ngram
        padded = torch.cat([tokens, tokens.new_full((tokens.shape[0], longest), -1)], dim=1)
        windows = padded.unfold(1, longest, 1)[:, :width]  # [R, width, longest]
        offsets = torch.arange(longest - 1, device=tokens.device)
        before = (n - 1).clamp(min=0)
        # (clamped from below too: with n - 1 past the history's width nothing is banned, see `inside`)
        suffix = tokens.gather(1, ((width - before)[:, None] + offsets).clamp(0, width - 1))
        compared = offsets[None, :] < before[:, None]
        matches = ((windows[..., : longest - 1] == suffix[:, None, :]) | ~compared[:, None, :]).all(dim=-1)
        columns = torch.arange(width, device=tokens.device)
        inside = (hist.index >= 0) & (columns[None, :] + before[:, None] < width) & (n[:, None] > 0)
        banned = windows.gather(2, before[:, None, None].expand(-1, width, 1)).squeeze(2)
        ban = matches & inside & (banned < vocab)
        _reduce(logits, self.sample_rows, banned.clamp(0, vocab - 1), torch.where(ban, -_INF, _INF), "amin")


@dataclass
class HostProcessors:
    """What the host knows of a step's history processors: the tensors to upload and which
    processors run (so that the device does no work for options nobody asked for)."""

    ints: list[torch.Tensor]
    floats: list[torch.Tensor]
    penalty_above: bool
    penalty_below: bool
    max_ngram: int
    has_bias: bool
    has_bad_words: bool

    @classmethod
    def build(cls, rows: list[tuple[int, int, object]], pad_rows: int | None = None) -> "HostProcessors | None":
        """rows: (sampled row, batch row, Request) of every row with a history option.

        pad_rows (a CUDA-graph bucket): one entry per logits row, those without an option neutral
        (penalty 1.0, n-gram size 0, no keys), the prefix `prefix_bucket` wide and the key lists
        padded to `sequence_shape`, so that the shapes depend on the bucket only."""
        if not rows:
            return None
        requests = [req for _, _, req in rows]
        if pad_rows is not None:
            rows, requests = _padded_rows(rows, pad_rows)
        params = [req.params for req in requests]
        prefixes = [req.history_prefix for req in requests]
        width = max(map(len, prefixes)) if pad_rows is None else prefix_bucket(requests)
        prefix = np.full((len(rows), width), -1, dtype=np.int64)
        for i, p in enumerate(prefixes):
            if p:  # most requests have none (only a left-padded generate call gives them one)
                prefix[i, : len(p)] = p
        ints = [torch.from_numpy(np.array(a, dtype=np.int64)) for a in (
            [s for s, _, _ in rows], [b for _, b, _ in rows], prefix, [len(p) for p in prefixes],
            [req.penalty_start for req in requests], [p.no_repeat_ngram_size for p in params])]
        floats = [np.array([p.repetition_penalty for p in params], dtype=np.float32)]
        keys = [_keys(req) if req.params.sequence_bias or req.params.bad_words_ids else _NO_KEYS for req in requests]
        biased = [(i, bias) for i, (bias, _) in enumerate(keys) if bias is not None]
        banned = [(i, bad) for i, (_, bad) in enumerate(keys) if bad is not None]
        for blocks in (biased, banned):
            if blocks:
                more_ints, more_floats = SequenceBias.host_parts(blocks, padded=pad_rows is not None)
                ints += more_ints
                floats += more_floats
        return cls(ints, floats, penalty_above=any(p.repetition_penalty > 1 for p in params),
                   penalty_below=any(p.repetition_penalty < 1 for p in params),
                   max_ngram=max(p.no_repeat_ngram_size for p in params),
                   has_bias=bool(biased), has_bad_words=bool(banned))


@functools.lru_cache(maxsize=1)
def _neutral():
    """A request without history options: the filler of a padded (CUDA-graph) step's rows."""
    from hf_async_cb.engine.requests import Request, SamplingParams

    return Request([0], SamplingParams(), request_id="padding")


def _padded_rows(rows, num_rows: int):
    if len(rows) == num_rows and all(row[0] == s for s, row in enumerate(rows)):
        return rows, [req for _, _, req in rows]  # every row reads its history already
    neutral = (0, _neutral())
    by_row = {s: (b, req) for s, b, req in rows}
    padded = [(s, *by_row.get(s, neutral)) for s in range(num_rows)]
    return padded, [req for _, _, req in padded]


def sequence_shapes(requests) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None]:
    """The padded shapes of a step's (sequence_bias, bad_words_ids) lists, None where no row has any."""
    keys = [_keys(r) for r in requests]
    bias, bad = [b for b, _ in keys if b is not None], [d for _, d in keys if d is not None]
    return sequence_shape(bias) if bias else None, sequence_shape(bad) if bad else None


def prefix_bucket(requests) -> int:
    """Width of the history prefix of a padded step: a power of two (0 when no row has one)."""
    longest = max((len(r.history_prefix) for r in requests if r.params.reads_history), default=0)
    return 0 if longest == 0 else 1 << (longest - 1).bit_length()


_NO_KEYS = (None, None)


def _keys(request) -> tuple[SequenceBlock | None, SequenceBlock | None]:
    """The request's (sequence_bias, bad_words_ids) blocks, kept on the request while its
    parameters are the same object (hashing the keys every step would cost as much as packing)."""
    cached = request.__dict__.get("_sequence_blocks")
    params = request.params
    if cached is None or cached[0] is not params:
        bias = SequenceBlock.of(params.sequence_bias) if params.sequence_bias else None
        bad = SequenceBlock.of(tuple((w, -_INF) for w in params.bad_words_ids)) if params.bad_words_ids else None
        cached = request.__dict__["_sequence_blocks"] = (params, bias, bad)
    return cached[1:]


def block_bucket(num_pairs: int) -> int:
    """Pairs of a padded (CUDA-graph) step's TokenBlock: a power of two, at least 16."""
    return max(16, 1 << max(0, num_pairs - 1).bit_length())


@dataclass
class TokenBlock:
    """Tokens a row may not sample this step, their logits set to -inf: EOS while the request is
    short of min_new_tokens (the host knows its count, tokens in flight included), suppress_tokens
    always, begin_suppress_tokens for its first token. The host sends the (row, token) pairs; a
    padded step adds (0, -1) pairs, which change nothing."""

    rows: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64, -1 = padding

    @staticmethod
    def host_parts(entries: list[tuple[int, tuple[int, ...]]], padded: bool = False) -> list[torch.Tensor]:
        """entries: (sampled row, the tokens it may not sample); padded: to block_bucket pairs."""
        if not entries:
            return []
        rows = [row for row, eos in entries for _ in eos]
        tokens = [t for _, eos in entries for t in eos]
        if padded:
            extra = block_bucket(len(rows)) - len(rows)
            rows, tokens = rows + [0] * extra, tokens + [-1] * extra
        return [torch.tensor(rows), torch.tensor(tokens)]

    @classmethod
    def from_device(cls, ints: list[torch.Tensor]) -> "TokenBlock | None":
        return cls(*ints) if ints else None

    def apply(self, logits: torch.Tensor) -> None:
        # min(-inf, x) blocks; min(+inf, x) (a padding pair) leaves the logit as it was.
        index = self.rows * logits.shape[1] + self.tokens.clamp(min=0)
        values = torch.where(self.tokens >= 0, -_INF, _INF).to(logits.dtype)
        logits.view(-1).scatter_reduce_(0, index, values, reduce="amin")
