"""What a stopping criterion costs per token on the host: one request with a criterion (as stop_strings
installs one), 300 tokens appended, per token, at several prompt lengths; each figure beside the same
run with the row rebuilt as a tensor every token (as before the request kept its history tensor).

    PYTHONPATH=. python benchmarks/criterion_cost.py
"""

import time

import torch

from hf_async_cb.engine.requests import Request, SamplingParams


class NeverStops:
    def __call__(self, ids, scores):
        return torch.zeros(1, dtype=torch.bool)


def per_token_us(prompt_len: int, rebuilt: bool) -> float:
    """Microseconds per appended token."""
    req = Request(list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=400), stopping_criteria=NeverStops())
    if rebuilt:
        req.history_tensor = lambda length=None: torch.tensor(req.history())
    started = time.perf_counter()
    for token in range(300):
        req.append_token(token)
    return (time.perf_counter() - started) / 300 * 1e6


if __name__ == "__main__":
    for n in (512, 4096, 16384):
        print(f"{n} prompt tokens: rebuilt {min(per_token_us(n, True) for _ in range(3)):.0f} us, "
              f"kept {min(per_token_us(n, False) for _ in range(3)):.0f} us per token")
