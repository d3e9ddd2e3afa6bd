"""StepMetadata: what every attention layer of one step needs to know about the packed batch."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepMetadata:
    """One packed step: B requests, T new tokens in total, all index tensors already on the device.

    Request i owns query tokens [query_start[i], query_start[i + 1]) of the packed stream; after
    this step its cache holds context_lens[i] tokens, the last of which are this step's. Its
    context lives in the pages block_table[i, :] (token t at slot page * page_size + t % page_size).

    This is what the paged kernels read directly. The pure-torch reference instead needs a padded
    view ([B, max_query_len] queries x [B, max_context] keys); `padded_view()` derives it on the
    device, once per forward, so that the host uploads only the compact block table. A step whose
    queries differ in length is first split into groups of alike requests (`padded_groups()`).
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_table: torch.Tensor  # [B, W] pages of each request (padding repeats a valid page)
    query_start: torch.Tensor  # [B + 1] cumulative query lengths
    context_lens: torch.Tensor  # [B] context length after this step
    page_size: int
    max_query_len: int  # host: the longest query of the step
    max_context: int  # host: a bound on every context length (a bucket: shapes change rarely)
    backend: str = "reference"  # the attention kernel: "reference" or "triton" (attention.resolve_backend)
    # [T] each token's bidirectional block, [visible_from, visible] key positions it sees whatever
    # the window, when some tokens see past themselves (an image's tokens: engine/prompt_embeds.py);
    # None: causal. Such a step runs the reference attention.
    visible: torch.Tensor | None = None
    visible_from: torch.Tensor | None = None
    # Eager steps only: the rows of the stream whose K/V are given instead of computed, and what
    # (model/prefix_kv.py: StepPrefixKV, applied by PagedKVCache.update); None: every row computes its own.
    prefix_kv: object = None
    # Decode steps whose rows share their first full pages (a prompt repeated, a common prefix):
    # group_rows [B] (the rows in the groups' order), group_start [B + 1] (group i: the rows at
    # group_start[i] .. group_start[i + 1] - 1 of that order, groups past the last empty) and shared_len
    # [B] (each row's shared keys, 0 alone). The Triton kernels then read a group's prefix once
    # (kernels/shared_prefix_attention.py); None: every row reads its own.
    group_start: torch.Tensor | None = None
    group_rows: torch.Tensor | None = None
    shared_len: torch.Tensor | None = None
    # The pool's slots: a CUDA-graph bucket's padding rows write past them (the trash page); 0: unknown.
    pool_slots: int = 0
    attention_calls: int = 0
    kv_gathered: bool = False  # the layer being run got gathered contexts from the cache, not its pools
    # Decode steps on the Triton kernels: each layer's new K/V, which PagedKVCache.update leaves to the
    # attention kernel to store (one kernel fewer per layer), by the key pool's address.
    pending_kv: dict = field(default_factory=dict, repr=False)
    _derived: dict = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return self.block_table.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every request has exactly one query token."""
        return self.max_query_len == 1

    @property
    def attention_stores_kv(self) -> bool:
        """Whether the attention kernel stores this step's new K/V itself: decode steps (one token
        per request) on the Triton kernels."""
        return self.backend == "triton" and self.is_decode and self.slot_mapping.shape[0] == self.num_requests

    def begin_forward(self) -> None:
        """Forget per-forward state: a static (CUDA-graph) metadata is reused with new values."""
        self.attention_calls = 0
        self.pending_kv.clear()
        self._derived.clear()

    def real_tokens(self) -> torch.Tensor | None:
        """[T] int8 on the device: 1 for the step's own tokens, 0 for a CUDA-graph bucket's padding
        (their slots lie past the pool), computed once per forward; None where the pool is unknown.
        What a projection needs whose rows depend on each other (LLM.int8()'s outlier columns)."""
        if not self.pool_slots:
            return None
        if "real_tokens" not in self._derived:
            self._derived["real_tokens"] = (self.slot_mapping < self.pool_slots).to(torch.int8)
        return self._derived["real_tokens"]

    def padded_view(self) -> dict[str, torch.Tensor]:
        """Index tensors of the padded batch, computed on the device (no host sync):

        q_index [B, max_q]: packed row of each query (padding repeats the last real row);
        q_pos [B, max_q]: its absolute position; q_valid [B, max_q]: real rows;
        kv_index [B, max_ctx]: cache slot of each context token (padding repeats the last);
        out_index [T]: flat position in [B * max_q] of each packed row.
        """
        if "view" not in self._derived:
            dev = self.block_table.device
            starts, ends = self.query_start[:-1], self.query_start[1:]
            ql = (ends - starts)[:, None]
            ctx = self.context_lens[:, None]
            j = torch.arange(self.max_query_len, device=dev)[None, :]
            k = torch.minimum(torch.arange(self.max_context, device=dev)[None, :], ctx - 1)
            page = self.page_size
            t = torch.arange(self.slot_mapping.shape[0], device=dev)
            owner = torch.searchsorted(ends, t, right=True)
            self._derived["view"] = {
                "q_index": starts[:, None] + torch.minimum(j, ql - 1),
                "q_pos": ctx - ql + j,
                "q_valid": j < ql,
                "kv_index": self.block_table.gather(1, k // page) * page + k % page,
                "out_index": owner * self.max_query_len + (t - starts[owner]),
            }
        return self._derived["view"]

    def padded_groups(self) -> list[tuple[torch.Tensor, StepMetadata]]:
        """The step split into groups of requests whose query lengths and context lengths fall in
        the same power-of-two classes: (token_rows, group) each, token_rows [T_g] the group's rows of
        the packed stream and `group` those requests as a step of their own, whose bounds are the
        group's longest query and context.

        The reference attention pads each group rather than the whole step: one padded view costs
        requests x longest query x longest context, so that in a mixed step every one-token decode
        would be padded to the length of the prefill chunk. Within a group, a request's padded work
        is at most 4x its query length x context length. Requests without tokens are left out.
        Reads the lengths on the host (one device sync per forward, none on the CPU)."""
        if "groups" not in self._derived:
            starts, contexts = self.query_start.tolist(), self.context_lens.tolist()
            members: dict[tuple[int, int], list[int]] = {}
            for i, context in enumerate(contexts):
                query_len = starts[i + 1] - starts[i]
                if query_len:
                    members.setdefault(((query_len - 1).bit_length(), (context - 1).bit_length()), []).append(i)
            dev = self.block_table.device
            groups = []
            for key in sorted(members):
                rows = members[key]
                query_lens = [starts[i + 1] - starts[i] for i in rows]
                tokens = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i + 1]) for i in rows])).to(dev)
                longest = max(contexts[i] for i in rows)
                requests = torch.tensor(rows, device=dev)
                group = dataclasses.replace(
                    self, slot_mapping=self.slot_mapping[tokens],
                    block_table=self.block_table[requests, : -(-longest // self.page_size)],
                    query_start=torch.tensor([0, *itertools.accumulate(query_lens)], device=dev),
                    context_lens=self.context_lens[requests], max_query_len=max(query_lens), max_context=longest,
                    visible=None if self.visible is None else self.visible[tokens],
                    visible_from=None if self.visible_from is None else self.visible_from[tokens],
                    attention_calls=0, kv_gathered=False, _derived={})
                groups.append((tokens, group))
            self._derived["groups"] = groups
        return self._derived["groups"]

    def gathered_view(self) -> dict:
        """For layers that receive their contexts gathered (PagedKVCache.update): `index` [B * max_ctx],
        the cache slot of each context position of each request (padding repeats the request's last
        token), and `meta`, this step as seen by attention over the gathered tensor: request i's
        context at rows i * max_ctx onwards, one-token pages."""
        if "gathered" not in self._derived:
            batch, width = self.num_requests, self.max_context
            table = torch.arange(batch * width, device=self.block_table.device).view(batch, width)
            meta = dataclasses.replace(self, block_table=table, page_size=1, attention_calls=0, kv_gathered=False,
                                       _derived={})
            self._derived["gathered"] = {"index": self.padded_view()["kv_index"].reshape(-1), "meta": meta}
        return self._derived["gathered"]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Bool [B, 1, max_q, max_ctx] of the padded view: query at position p sees key k when
        k <= p (and p - k < window), or k in its bidirectional block [visible_from, visible].
        Padding query rows see key 0 only, so that no row is fully masked (no NaN anywhere)."""
        name = ("mask", sliding_window)
        if name not in self._derived:
            view = self.padded_view()
            k = torch.arange(self.max_context, device=self.block_table.device)[None, None, :]
            p = view["q_pos"][:, :, None]
            allowed = k <= p
            if sliding_window is not None:
                allowed &= (p - k) < sliding_window
            if self.visible is not None:
                rows = view["q_index"]
                allowed |= (k >= self.visible_from[rows][:, :, None]) & (k <= self.visible[rows][:, :, None])
            self._derived[name] = torch.where(view["q_valid"][:, :, None], allowed, k == 0)[:, None]
        return self._derived[name]


def block_table(page_lists: list[list[int]], context_lens: list[int], page_size: int, width: int) -> np.ndarray:
    """[requests, width] int64: each request's pages that hold its context, padded by repeating the
    last one. Built with one flat gather in numpy: the per-request Python work is one length."""
    used = np.fromiter(((c + page_size - 1) // page_size for c in context_lens), dtype=np.int64,
                       count=len(context_lens))
    sizes = np.fromiter((len(p) for p in page_lists), dtype=np.int64, count=len(page_lists))
    flat = np.fromiter(itertools.chain.from_iterable(page_lists), dtype=np.int64, count=int(sizes.sum()))
    starts = np.cumsum(sizes) - sizes
    return flat[starts[:, None] + np.minimum(np.arange(width)[None, :], used[:, None] - 1)]
