"""What a serving path runs before its timed run (WARMUPS): the timed workload again on other
tokens ("replay"), the decode steps of every graph bucket it can meet, or a few short requests
("short"); tools/serving.py's docstring says why.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from hf_async_cb.tools.serving_workload import Workload, make_workload

WARMUPS = ("replay", "short")
SHORT_WARMUP = dict(requests=4, prompt=16, new=4)  # the "short" warm-up: all at once


def fresh_prompts(workload: Workload, vocab: int, seed: int = 1) -> Workload:
    """`workload` with other prompt tokens (the same lengths and arrivals): it meets the same step
    shapes, and leaves nothing in a prefix cache that the timed prompts could hit."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(workload)]))
    shared = rng.integers(3, vocab, workload.system_prompt).tolist()  # shared as the timed one's, other tokens
    return replace(workload, prompts=[shared + rng.integers(3, vocab, len(p) - workload.system_prompt).tolist()
                                      for p in workload.prompts])


def decode_buckets(workload: Workload, max_running: int) -> tuple[list[int], list[int]]:
    """The batch and context buckets of the decode steps `workload` can meet (engine/graph_keys.py): batches
    of up to min(max_running, its requests) rows, contexts up to its longest prompt + output."""
    from hf_async_cb.engine.graph_keys import MIN_CONTEXT_BUCKET, pow2

    batches = pow2(min(max_running, len(workload)))
    contexts = max(MIN_CONTEXT_BUCKET, pow2(max(len(p) + n for p, n in zip(workload.prompts, workload.new))))
    return ([1 << i for i in range(batches.bit_length())],
            [MIN_CONTEXT_BUCKET << i for i in range((contexts // MIN_CONTEXT_BUCKET).bit_length())])


def decode_grid(workload: Workload, max_running: int, step_tokens: int, vocab: int, seed: int = 2) -> list[Workload]:
    """Workloads (all at once, run one after the other) whose decode steps meet every bucket of
    `decode_buckets`: for batch b and context c, min(b, max_running) requests decode together, one
    of them with a c/2-token prompt (a decode step's context bucket is that of its longest
    request), the others with 4 tokens. They decode for as many steps as their prompts take to
    prefill at `step_tokens` a step, plus two: so all of them decode together at least once."""
    batches, contexts = decode_buckets(workload, max_running)
    rng = np.random.default_rng(seed)
    grid = []
    for c in contexts:
        for b in batches:
            n = min(b, max_running)
            lengths = [c // 2] + [4] * (n - 1)
            new = -(-(sum(lengths) + n) // step_tokens) + 2
            grid.append(Workload([rng.integers(3, vocab, k).tolist() for k in lengths], [new] * n, [0.0] * n, None,
                                 "fixed", f"decode bucket batch {b}, context {c}"))
    return grid


def short_warmup(vocab: int, seed: int = 0) -> Workload:
    n = SHORT_WARMUP
    return make_workload(n["requests"], vocab, math.inf, "fixed", n["prompt"], n["new"], seed + 1)
