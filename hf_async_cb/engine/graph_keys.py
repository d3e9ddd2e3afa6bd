"""The buckets a step is padded to, and the key of the graph that replays it.

A decode step is padded to a bucket: the batch to a power of two (padding rows write to a trash
slot outside the page pool and are never read back), the context to a power of two >= 64. With
the Triton attention, whose launch depends only on token and request counts, prefill and mixed
steps get graphs too (bucketed by their token count as well): on a slow host an eager prefill
step of a small model costs more CPU time than its GPU work. Sampled rows share graphs with greedy
ones: every request the engine samples for has a seed, and a seeded draw is a pure function of
device tensors (sampling/sampler.py), so it replays like the forward; padding rows sample greedily. So
do the engine's logits processors (sampling/device_processors.py): each logits row gets an entry, neutral where no
option applies; the history prefix a power-of-two width; key lists (bad words, sequence biases)
are padded to powers of two with keys no history reaches, blocked (row, token) pairs with pairs
that change nothing; all those shapes are part of the bucket. User processors (the slow path)
and kept scores run eagerly.

engine/cuda_graphs.py (DecodeGraphs.key_for) picks a step's bucket by these rules.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CONTEXT_BUCKET = 64
# Prefill and mixed steps of more tokens than this run eagerly: their GPU time dwarfs the launch
# cost a graph saves, while each capture holds its activations in the graph pool and costs its
# warm-up. Measured on an H200 (docs/benchmarks.md, 2026-12-01): 8B, 32 x 7K -> 1K with 8192-token
# prefill steps took 21.9 s with prefill graphs and 21.6 s without, and 29.0 s of warm-up against 21.9.
PREFILL_GRAPH_MAX_TOKENS = 2048
# A prefill/mixed bucket's context (keys per request: its block table's width) grows by this many
# powers of two from MIN_CONTEXT_BUCKET (64, 256, 1024, 4096, ... with 2). The Triton prefill and
# mixed attention reads each request's own length and launches by token and request counts only, so
# a wider table costs an upload of a few more page numbers, while every context bucket of a (batch,
# tokens) pair took a capture of its own, and a serving load's steps (new prompts beside decodes of
# every length) spread over so many of them that the buckets captured in a warm-up missed many
# later steps, which ran eagerly (docs/benchmarks.md). Decode buckets keep powers of two: their
# split count depends on the context.
PREFILL_CONTEXT_STEP = 2
# ... and holds, up to this many keys, the most that any of the step's requests may yet reach (its
# prompt and new tokens), not only what it holds now: requests grow into longer contexts while they
# decode, and a bucket captured for a step of short contexts was missed by the same (batch, tokens)
# steps of that load later on (8B serving, 32-64 req/s on an H100: most eager steps were of a bucket
# captured at context 1024 needing 4096). Past this, a row of the table costs more to gather and upload
# than a later capture saves.
PREFILL_CONTEXT_REACH = 4096
# A step whose own bucket is not captured (all prefill buckets taken) may replay a captured bucket of
# up to this many tokens (or twice its own): at that size a small model's padded replay still costs
# less GPU time than an eager step's launches cost the host.
PADDED_BUCKET_MAX_TOKENS = 256


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pow4(n: int) -> int:
    return 1 << 2 * -(-max(0, n - 1).bit_length() // 2)


def prefill_context_bucket(context: int, step: int | None = None) -> int:
    """The context bucket of a prefill/mixed step whose longest request holds `context` keys."""
    step = PREFILL_CONTEXT_STEP if step is None else step
    doublings = max(0, context - 1) // MIN_CONTEXT_BUCKET
    doublings = doublings.bit_length()  # MIN_CONTEXT_BUCKET << doublings holds it
    return MIN_CONTEXT_BUCKET << step * -(-doublings // step)


def token_bucket(n: int) -> int:
    """Token count of a prefill/mixed bucket: a power of two up to 512, then a multiple of 512."""
    return pow2(n) if n <= 512 else -(-n // 512) * 512


@dataclass(frozen=True)
class GraphKey:
    """A step's shape, as far as its graph depends on it: batch: requests (padding rows included);
    context: keys per request; tokens: the token stream, 0 for a decode step (one per request)."""

    batch: int
    context: int
    tokens: int = 0
    sampled: bool = False  # some row samples (the graph takes the sampling parameters)
    # Some row reads its history: (a penalty above 1, one below 1, prefix width, largest n-gram size,
    # the padded shapes of the sequence-bias and bad-words key lists or None).
    penalty: tuple | None = None
    blocked: int = 0  # (row, token) pairs the step blocks, padded (penalties.block_bucket); 0 = none
    tall: bool = False  # a prefill/mixed step whose longest query takes the attention's tall tiles
    shared: bool = False  # a decode step whose rows share prefixes (StepMetadata.group_start): other kernels

