"""The engine's per-request tokens back in stock generate's output format."""

from __future__ import annotations

import torch

from hf_async_cb.engine.requests import Request
from hf_async_cb.generate.arguments import GenerateCall


def stock_output(call: GenerateCall, input_ids: torch.Tensor, requests: list[Request]):
    """`[batch, prompt + generated]` with finished rows padded, or a GenerateDecoderOnlyOutput when
    return_dict_in_generate asks for one (scores / logits per step, if asked)."""
    gc, pad = call.gc, call.pad
    sequences = pad_outputs(input_ids, [r.output_token_ids for r in requests], pad)
    if gc.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        steps = sequences.shape[1] - input_ids.shape[1]
        device = input_ids.device  # stock's scores live beside its sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=_per_step([r.output_scores for r in requests], steps, device) if gc.output_scores else None,
            logits=_per_step([r.output_logits for r in requests], steps, device) if gc.output_logits else None,
        )
    return sequences


def _per_step(rows: list[list[torch.Tensor]], steps: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-request lists of [V] tensors (kept on the host) -> stock's tuple of [batch, V] per step,
    on `device`. Steps after a row finished hold NaN (stock computes values there from pad inputs;
    nobody should read them), in the dtype of the step's other rows: float32, or the one a logits
    processor returned (stock's scores keep it), which a float32 filler would promote away."""
    vocab = next(len(r[0]) for r in rows if r)
    out = []
    for t in range(steps):
        present = [r[t] for r in rows if t < len(r)]
        filler = torch.full((vocab,), float("nan"), dtype=present[0].dtype)
        out.append(torch.stack([r[t] if t < len(r) else filler for r in rows]).to(device))
    return tuple(out)


def pad_outputs(input_ids: torch.Tensor, generated: list[list[int]], pad: int | None) -> torch.Tensor:
    width = max(len(g) for g in generated)
    if pad is None and any(len(g) < width for g in generated):
        raise RuntimeError("rows finished at different lengths but there is no pad_token_id to fill them")
    rows = [g + [pad] * (width - len(g)) for g in generated]
    # int64 whatever the prompt's integer dtype: stock's sampled tokens are int64 and promote it.
    new = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
    return torch.cat([input_ids.long(), new], dim=1)
