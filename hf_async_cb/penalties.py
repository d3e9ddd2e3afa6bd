"""Logits processors the engine runs on the device, for every request of a step at once:
the repetition penalty, and blocked tokens (EOS held back by min_new_tokens, suppress_tokens,
begin_suppress_tokens).

Stock's RepetitionPenaltyLogitsProcessor divides (or, for negative logits, multiplies) the logit of
every token that occurs in the row's history, padding included, by the penalty. Here the step's
histories travel as one packed list (token, sampled row) built on the host; a request's last token
may still be on its way from the step in flight, so, like the forward's input ids, it is a
placeholder resolved on the device from the previous step's sampled tokens. Rows without a penalty
have 1.0, which changes nothing, so greedy and sampled rows, penalised or not, share one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RepetitionPenalty:
    penalty: torch.Tensor  # [S] float32, 1.0 = none
    tokens: torch.Tensor  # [N] int64 history tokens of the penalised rows (placeholders where carried)
    rows: torch.Tensor  # [N] int64 sampled row of each history token
    carry: torch.Tensor  # [N] int64 row of the previous step's sampled tokens, -1 = known

    @staticmethod
    def host_parts(num_rows: int, entries: list[tuple[int, float, list[int], int]]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """entries: (sampled row, penalty, known history, carry row of its pending token or -1);
        returns (ints, floats) to upload, empty when no row is penalised."""
        if not entries:
            return [], []
        penalty = torch.ones(num_rows)
        tokens, rows, carry = [], [], []
        for row, value, history, pending in entries:
            penalty[row] = value
            tokens.append(np.array(history + [0] if pending >= 0 else history, dtype=np.int64))
            n = len(tokens[-1])
            rows.append(np.full(n, row, dtype=np.int64))
            carry.append(np.full(n, -1, dtype=np.int64))
            if pending >= 0:
                carry[-1][-1] = pending  # the placeholder: the token still in flight
        return [torch.from_numpy(np.concatenate(a)) for a in (tokens, rows, carry)], [penalty]

    @classmethod
    def from_device(cls, ints: list[torch.Tensor], floats: list[torch.Tensor]) -> "RepetitionPenalty | None":
        if not ints:
            return None
        (tokens, rows, carry), (penalty,) = ints, floats
        return cls(penalty=penalty, tokens=tokens, rows=rows, carry=carry)

    def apply(self, logits: torch.Tensor, previous_tokens: torch.Tensor | None) -> None:
        """Penalise `logits` [S, V] in place (stock's formula; repeated tokens are penalised once)."""
        tokens = self.tokens
        if previous_tokens is not None:
            tokens = torch.where(self.carry >= 0, previous_tokens[self.carry.clamp(min=0)], tokens)
        score = logits[self.rows, tokens]
        penalty = self.penalty[self.rows]
        logits[self.rows, tokens] = torch.where(score < 0, score * penalty, score / penalty)


@dataclass
class TokenBlock:
    """Tokens a row may not sample this step, their logits set to -inf: EOS while the request is
    short of min_new_tokens (the host knows its count, tokens in flight included), suppress_tokens
    always, begin_suppress_tokens for its first token. The host sends the (row, token) pairs."""

    rows: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64

    @staticmethod
    def host_parts(entries: list[tuple[int, tuple[int, ...]]]) -> list[torch.Tensor]:
        """entries: (sampled row, the tokens it may not sample)."""
        if not entries:
            return []
        rows = [row for row, eos in entries for _ in eos]
        tokens = [t for _, eos in entries for t in eos]
        return [torch.tensor(rows), torch.tensor(tokens)]

    @classmethod
    def from_device(cls, ints: list[torch.Tensor]) -> "TokenBlock | None":
        return cls(*ints) if ints else None

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows, self.tokens] = float("-inf")
