"""The requests of a serving run: when each arrives, how long its prompt and output are, its tokens.

Arrivals all at once or a Poisson process; lengths "fixed", "uniform" or ShareGPT-like (LENGTHS);
prompt tokens random ids. Arrivals, lengths and tokens come from separate seeded streams, so that
changing the rate keeps the requests (tools/serving.py runs them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# ShareGPT-like lengths without the data set: lognormal prompt and output lengths (tokens), drawn
# again when outside [lo, hi] (vLLM's ShareGPT sampler drops such requests: prompts over 1024
# tokens, prompt + output over 2048, under 4 tokens). The medians are set so that the means after
# the cut are about those the vLLM paper gives for ShareGPT (161 prompt and 338 output tokens):
# ~161 and ~341. The spreads (sigma of the log) are chosen, not fitted: 1.0 for prompts (a heavy
# tail of long pasted contexts: p10 ~30, p90 ~370 tokens), 0.7 for outputs (p10 ~120, p90 ~650).
SHAREGPT = {"prompt": dict(median=108, sigma=1.0, lo=4, hi=1024),
            "output": dict(median=300, sigma=0.7, lo=4, hi=1024)}
LENGTHS = ("fixed", "uniform", "sharegpt")
# What the CLI runs when no --lengths is given: ShareGPT-like on CUDA; on the CPU, where nothing is
# measured anyway, the short fixed lengths of bench's CPU workload.
DEFAULT_LENGTHS = {"cuda": "sharegpt", "cpu": "fixed"}


def default_lengths(device: torch.device) -> str:
    return DEFAULT_LENGTHS["cuda" if device.type == "cuda" else "cpu"]


@dataclass(frozen=True)
class Workload:
    """The requests of one run: prompt token ids, output lengths and arrival times (seconds after
    the run's start, non-decreasing). `rate` None: all at once."""

    prompts: list[list[int]]
    new: list[int]
    arrivals: list[float]
    rate: float | None
    lengths: str
    description: str
    system_prompt: int = 0  # tokens every prompt starts with (the same ones: a shared system prompt)

    def __len__(self) -> int:
        return len(self.prompts)


def arrival_times(requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests/s: exponential gaps of mean 1/rate,
    the first request at 0 (as vLLM sends its first request at once). rate inf: all at 0."""
    if not rate > 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(requests - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def _lognormal(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """`n` rounded lognormal draws in [lo, hi]: the ones outside are drawn again (a truncated lognormal)."""
    out = np.empty(0, dtype=np.int64)
    while len(out) < n:
        x = np.rint(np.exp(rng.normal(math.log(median), sigma, 2 * (n - len(out)) + 8))).astype(np.int64)
        out = np.concatenate([out, x[(x >= lo) & (x <= hi)]])
    return out[:n]


def draw_lengths(requests: int, lengths: str, prompt: int, new: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and output lengths per request. "fixed": `prompt` and `new` each; "uniform": integers
    drawn uniformly from [prompt // 2, prompt * 3 // 2] and [new // 2, new * 3 // 2] (at least 1),
    centred on the fixed lengths with the same mean; "sharegpt": SHAREGPT's truncated lognormals
    (`prompt` and `new` unused)."""
    if lengths == "fixed":
        return [prompt] * requests, [new] * requests
    rng = np.random.default_rng(seed)
    if lengths == "uniform":
        def uniform(n: int) -> list[int]:
            return rng.integers(max(1, n // 2), max(1, n * 3 // 2) + 1, requests).tolist()

        return uniform(prompt), uniform(new)
    if lengths == "sharegpt":
        return (_lognormal(rng, requests, **SHAREGPT["prompt"]).tolist(),
                _lognormal(rng, requests, **SHAREGPT["output"]).tolist())
    raise ValueError(f"unknown length distribution {lengths!r}: choose from {', '.join(LENGTHS)}")


def describe_lengths(lengths: str, prompt: int, new: int) -> str:
    if lengths == "fixed":
        return f"fixed: prompt {prompt} x {new} new"
    if lengths == "uniform":
        return (f"uniform: prompt {max(1, prompt // 2)}..{max(1, prompt * 3 // 2)} x "
                f"{max(1, new // 2)}..{max(1, new * 3 // 2)} new")
    p, o = SHAREGPT["prompt"], SHAREGPT["output"]
    return (f"sharegpt-like: lognormal prompt (median {p['median']}, sigma {p['sigma']}, {p['lo']}..{p['hi']}) x "
            f"new (median {o['median']}, sigma {o['sigma']}, {o['lo']}..{o['hi']})")


def make_workload(requests: int, vocab: int, rate: float = math.inf, lengths: str = "fixed", prompt: int = 128,
                  new: int = 256, seed: int = 0, system_prompt: int = 0) -> Workload:
    """N requests: arrivals, lengths and prompt token ids (in [3, vocab): clear of the special ids
    build_model gives) from three streams of `seed`. `system_prompt` tokens, the same for every
    request, come before each drawn prompt (what a chat service sends: a prefix cache's case)."""
    arrivals_seed, lengths_seed, tokens_seed = np.random.SeedSequence(seed).spawn(3)
    prompt_lens, new_lens = draw_lengths(requests, lengths, prompt, new, lengths_seed)
    arrivals = arrival_times(requests, rate, arrivals_seed)
    rng = np.random.default_rng(tokens_seed)
    shared = rng.integers(3, vocab, system_prompt).tolist()
    prompts = [shared + rng.integers(3, vocab, n).tolist() for n in prompt_lens]
    description = describe_lengths(lengths, prompt, new)
    if system_prompt:
        description = f"a shared {system_prompt}-token system prompt, then " + description
    return Workload(prompts, new_lens, arrivals, None if math.isinf(rate) else float(rate), lengths,
                    description, system_prompt)
