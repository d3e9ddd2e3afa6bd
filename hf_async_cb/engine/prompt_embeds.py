"""What a prompt feeds besides its token ids: embeddings at some positions, and rotary positions
of its own.

A request's prompt is still a list of token ids (the scheduler, the prefix cache and the history
processors count and key on them), but some positions may feed an embedding instead of their
token's: a user's `inputs_embeds`, PEFT prompt tuning's virtual tokens, or image features merged
in by a vision-language model (the token id there is the model's image placeholder). Prefill
chunks that cover such positions run eagerly with `inputs_embeds` (engine/runner.py); every other
step, decode included, feeds token ids as before and keeps its CUDA graph.

Multimodal rotary positions (Qwen2-VL and its kin) give image tokens a [t, h, w] position each,
and shift every later position by a per-prompt delta: `rope` holds the prompt's positions as the
model computed them, and the tokens after the prompt take `position + rope_delta`.

`kv` gives keys and values per layer for the prompt's first positions instead of computing them
(PEFT prefix tuning: model/prefix_kv.py); the chunks that cover them run eagerly too.

`deepstack` holds features the language model adds to the hidden states after its first layers at
some prompt positions (Qwen3-VL's deepstack: one [D, hidden] tensor per such layer, at
`deepstack_positions`, a subset of the embedded positions); the chunks that cover them run eagerly
and hand them to the language model (engine/runner.py).

`key` names the embeddings' content for the prefix cache: pages that hold embedded positions are
cached under it (the placeholder ids alone would let two different images share pages). None:
such pages are shared only by the requests holding this same object (num_return_sequences copies,
identical rows of one call), under a number of its own (the cache never holds the embeddings).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_async_cb.model.prefix_kv import PrefixKV


_SALTS = itertools.count()


def block_starts(visible: np.ndarray) -> np.ndarray:
    """For each position, the first position that sees as far (`visible`: the last position each
    sees): the start of its bidirectional block, or itself."""
    _, first, inverse = np.unique(visible, return_index=True, return_inverse=True)
    return first[inverse]


@dataclass(eq=False)
class PromptEmbeds:
    values: torch.Tensor  # [P, hidden], on the model's device, in its dtype
    positions: np.ndarray  # [P] int64, increasing: the prompt positions they replace
    key: bytes | None = None
    rope: np.ndarray | None = None  # [K, prompt length] int64 rotary positions, K >= 1; None: the plain ones
    rope_delta: int = 0  # added to the positions of generated tokens when `rope` is set
    # [prompt length] the last position each prompt token may see (>= its own), where some see past
    # themselves: a bidirectional block over an image (Gemma 3), over the prompt (PaliGemma). Each
    # token sees every key of its block (from the first position that sees as far: `visible_from`),
    # whatever the layer's window, and the causal keys within it. None: causal.
    visible: np.ndarray | None = None
    kv: PrefixKV | None = None  # keys and values given for positions [0, kv.count) (model/prefix_kv.py)
    deepstack: list[torch.Tensor] | None = None  # per layer [D, hidden], added after it at deepstack_positions
    deepstack_positions: np.ndarray | None = None  # [D] increasing prompt positions, among `positions`
    first: int = field(init=False)  # positions[0] (0 when P == 0)
    end: int = field(init=False)  # positions[-1] + 1
    rope_first: int = field(init=False)  # the span of the prompt whose K rotary rows differ
    rope_end: int = field(init=False)
    _salt: int = field(init=False, repr=False)  # the key of pages holding them when `key` is None

    def __post_init__(self) -> None:
        self.positions = np.asarray(self.positions, dtype=np.int64)
        if self.values.dim() != 2 or self.values.shape[0] != len(self.positions):
            raise ValueError(f"prompt embeddings must be [positions, hidden], got {tuple(self.values.shape)} for "
                             f"{len(self.positions)} positions.")
        if len(self.positions) and np.any(np.diff(self.positions) <= 0):
            raise ValueError("prompt embedding positions must be strictly increasing.")
        self.first = int(self.positions[0]) if len(self.positions) else 0
        self.end = int(self.positions[-1]) + 1 if len(self.positions) else 0
        self.rope_first = self.rope_end = 0
        self.deepstack_span = (0, 0)
        if self.deepstack is not None:
            self.deepstack_positions = np.asarray(self.deepstack_positions, dtype=np.int64)
            d = len(self.deepstack_positions)
            where = self.deepstack_positions
            if any(t.dim() != 2 or t.shape[0] != d for t in self.deepstack) or \
                    not np.isin(where, self.positions).all() or np.any(np.diff(where) <= 0):
                raise ValueError("deepstack features must be [positions, hidden] per layer, at increasing positions "
                                 "among the embedded ones.")
            if d:
                self.deepstack_span = (int(self.deepstack_positions[0]), int(self.deepstack_positions[-1]) + 1)
        self.kv_end = self.kv.count if self.kv is not None else 0
        self._salt = next(_SALTS)
        self._rope_digest = None
        self._rope_from = 0  # the first position whose rotary rows are not the plain position
        self.sees_ahead = (0, 0)  # the span of prompt positions in blocks (seeing past themselves, or seen)
        self.visible_from: np.ndarray | None = None
        self._cuts: np.ndarray | None = None  # chunk ends that leave no token seeing past them
        if self.visible is not None:
            self.visible = np.asarray(self.visible, dtype=np.int64)
            here = np.arange(len(self.visible))
            if (self.visible > here).any():
                self.visible_from = block_starts(self.visible)
                blocks = np.flatnonzero((self.visible > here) | (self.visible_from < here))
                self.sees_ahead = (int(blocks[0]), int(blocks[-1]) + 1)
                seen = np.maximum.accumulate(self.visible)  # seen[i]: the furthest any token <= i sees
                self._cuts = np.flatnonzero(seen < here + 1) + 1  # ends e with seen[e-1] < e
            else:
                self.visible = None
        if self.rope is not None:
            self.rope = np.asarray(self.rope, dtype=np.int64)
            if self.rope.ndim != 2:
                raise ValueError(f"rotary positions must be [rows, prompt length], got {self.rope.shape}.")
            differ = np.flatnonzero((self.rope != self.rope[:1]).any(axis=0))
            if len(differ):
                self.rope_first, self.rope_end = int(differ[0]), int(differ[-1]) + 1
            departs = np.flatnonzero((self.rope != np.arange(self.rope.shape[1])).any(axis=0))
            if len(departs) or self.rope_delta:
                self._rope_from = int(departs[0]) if len(departs) else self.rope.shape[1]
                self._rope_digest = ("rope", hashlib.blake2b(self.rope.tobytes() + str(self.rope_delta).encode(),
                                                             digest_size=16).digest())

    def feeds(self, start: int, stop: int) -> bool:
        """Whether tokens [start, stop) feed an embedding, need all rotary rows or see past
        themselves (an eager step)."""
        return ((start < self.end and stop > self.first) or (start < self.rope_end and stop > self.rope_first)
                or (start < self.sees_ahead[1] and stop > self.sees_ahead[0]) or start < self.kv_end
                or (start < self.deepstack_span[1] and stop > self.deepstack_span[0]))

    def chunk_end(self, start: int, stop: int) -> int:
        """Where a prefill chunk from `start` that would end at `stop` may end: never inside a block
        whose tokens see past it (they would attend to keys not computed yet). The nearest such end
        before `stop`, else the first after it (a chunk over the budget beats a wrong one)."""
        cuts = self._cuts
        if cuts is None or stop >= len(self.visible) or stop <= self.sees_ahead[0]:
            return stop
        i = int(np.searchsorted(cuts, stop, side="right"))  # cuts[i - 1] <= stop < cuts[i]
        if i and cuts[i - 1] == stop:
            return stop
        if i and cuts[i - 1] > start:
            return int(cuts[i - 1])
        return int(cuts[i]) if i < len(cuts) else len(self.visible)

    def ends_cleanly(self, length: int) -> bool:
        """Whether the prompt's first `length` tokens hold whole blocks only: none of them sees past
        them, so their K/V do not depend on later tokens (a cached prefix may end there)."""
        cuts = self._cuts
        if cuts is None or length <= self.sees_ahead[0] or length >= len(self.visible):
            return True
        i = int(np.searchsorted(cuts, length))
        return i < len(cuts) and int(cuts[i]) == length

    def slice(self, start: int, stop: int) -> tuple[np.ndarray, torch.Tensor]:
        """The embedded positions in [start, stop) (relative to `start`) and their embeddings."""
        a, b = np.searchsorted(self.positions, (start, stop))
        return self.positions[a:b] - start, self.values[a:b]

    def deepstack_slice(self, start: int, stop: int) -> tuple[np.ndarray, list[torch.Tensor]] | None:
        """The deepstack positions in [start, stop) (relative to `start`) and each layer's features
        there, or None when the span holds none."""
        if self.deepstack is None:
            return None
        a, b = np.searchsorted(self.deepstack_positions, (start, stop))
        if a == b:
            return None
        return self.deepstack_positions[a:b] - start, [t[a:b] for t in self.deepstack]

    def rope_positions(self, start: int, stop: int, prompt_length: int) -> np.ndarray:
        """[K, stop - start] rotary positions of tokens [start, stop) (generated ones past the prompt)."""
        rope = self.rope
        head = rope[:, start:min(stop, prompt_length)]
        if stop <= prompt_length:
            return head
        tail = np.arange(max(start, prompt_length), stop, dtype=np.int64) + self.rope_delta
        return np.concatenate([head, np.broadcast_to(tail, (rope.shape[0], len(tail)))], axis=1)

    def page_salt(self, start: int, stop: int) -> object:
        """What a prefix-cache page of tokens [start, stop) adds to its key: the embeddings' key (or
        this object's own number) when it holds an embedded position, the given K/V's key when it
        holds one of their positions, and the rotary positions' digest once they depart from the
        plain ones; None when none."""
        salt = (self.kv.key,) if start < self.kv_end else ()
        if len(self.positions) and stop > self.first and start < self.end:
            a, b = np.searchsorted(self.positions, (start, stop))
            if a < b:
                salt = (*salt, self.key if self.key is not None else ("embeds", self._salt))
        if self._rope_digest is not None and stop > self._rope_from:
            salt = (*salt, self._rope_digest)
        return salt or None


def checked_embeds(embeds: PromptEmbeds, prompt_length: int, embedding: torch.nn.Module,
                   refusal: str | None, cache=None) -> PromptEmbeds:
    """`embeds` for a prompt of `prompt_length` tokens, moved to the embedding's device and dtype
    (given K/V to the pool's); a ValueError for anything that cannot run (`refusal`: why the model
    cannot take embeddings at all; `cache`: the engine's PagedKVCache, whose layout K/V must fit)."""
    if not isinstance(embeds, PromptEmbeds):
        raise TypeError(f"embeds must be a PromptEmbeds, got {type(embeds).__name__}.")
    if embeds.kv is not None:
        if cache is None:
            raise ValueError(f"{embeds.kv.name} needs the engine's KV cache to check against.")
        if embeds.kv_end > prompt_length:
            raise ValueError(f"{embeds.kv.name} covers {embeds.kv_end} positions of a prompt of {prompt_length}.")
        embeds.kv = embeds.kv.checked(cache.layout, cache.keys[0].dtype, cache.keys[0].device)
    if refusal is not None and len(embeds.positions):  # (given K/V alone feed no embedding)
        raise ValueError(f"prompt embeddings cannot run on this model: {refusal}.")
    weight = embedding.weight
    hidden = weight.shape[1]
    if len(embeds.positions) and embeds.values.shape[1] != hidden:
        raise ValueError(f"prompt embeddings have width {embeds.values.shape[1]}; the model's embeddings have "
                         f"{hidden}.")
    if len(embeds.positions) and not (embeds.positions[0] >= 0 and embeds.end <= prompt_length):
        raise ValueError(f"prompt embedding positions must lie in [0, {prompt_length}), the prompt's length.")
    if not embeds.values.dtype.is_floating_point:
        raise ValueError(f"prompt embeddings must be floating point, got {embeds.values.dtype}.")
    if embeds.rope is not None and embeds.rope.shape[1] != prompt_length:
        raise ValueError(f"rotary positions cover {embeds.rope.shape[1]} tokens for a prompt of {prompt_length}.")
    dtype = weight.dtype if weight.dtype.is_floating_point else embeds.values.dtype
    embeds.values = embeds.values.detach().to(weight.device, dtype)
    if embeds.deepstack is not None:
        embeds.deepstack = [t.detach().to(weight.device, dtype) for t in embeds.deepstack]
    return embeds


_KEY_WORDS = 2  # two independent 64-bit sums: a 128-bit key
_CHUNK = 1024


def _multipliers(kind: str, count: int, device: torch.device) -> torch.Tensor:
    """[_KEY_WORDS, >= count] random 64-bit multipliers, the same at each index whatever `count`:
    drawn in chunks of _CHUNK, each from a generator seeded by its kind and index."""
    return _multiplier_chunks(kind, -(-count // _CHUNK), str(device))


@functools.lru_cache(maxsize=64)
def _multiplier_chunks(kind: str, chunks: int, device: str) -> torch.Tensor:
    return torch.cat([_chunk(kind, index, device) for index in range(chunks)], dim=1)


def _chunk(kind: str, index: int, device: str) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(f"{kind}:{index}".encode(), digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**62, 2**62, (_KEY_WORDS, _CHUNK), generator=g).to(device)


def content_keys(rows: list[torch.Tensor]) -> list[bytes]:
    """A key per [P, hidden] embeddings tensor (or any 2-D tensor: a vision tower's images,
    model/vision_dedupe.py) naming its content, computed on its device with one
    transfer for all: two sums over the values' bits (as integers) times random 64-bit multipliers
    per column and per position, wrapping modulo 2**64. Two tensors of other contents share a key
    only if both sums of their difference vanish: for multipliers drawn at random, about one chance
    in 2**64 each. Shapes and dtypes are part of the key. A tensor's key does not depend on the
    others it is named with, so the same image keeps its key from call to call."""
    if not rows:
        return []
    device = rows[0].device
    columns = _multipliers("columns", max(r.shape[1] for r in rows), device)
    positions = _multipliers("positions", max(r.shape[0] for r in rows), device)
    sums = []
    for r in rows:
        bits = r.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[r.element_size()])
        bits = bits.long()
        per_position = torch.stack([(bits * columns[w, :r.shape[1]]).sum(1) for w in range(_KEY_WORDS)])
        sums.append((per_position * positions[:, :r.shape[0]]).sum(1))
    words = torch.stack(sums).cpu().numpy()  # one transfer
    return [b"embeds:" + str((tuple(r.shape), r.dtype)).encode() + w.tobytes() for r, w in zip(rows, words)]
