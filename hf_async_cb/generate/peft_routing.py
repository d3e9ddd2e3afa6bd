"""PEFT's per-row routing, refused by name.

PEFT's generate can send each row of a batch through its own adapter or task: `adapter_names=`
(LoRA, GLoRA, RoAd), Poly's `task_ids=`, activated LoRA's `alora_offsets=`, X-LoRA's scalings. It
does so with forward pre-hooks, registered for the call, that hand each adapted layer the call's
per-row values, indexed by batch row. The engine packs every request into one row, so those hooks
would see another batch (a crash inside the layer, or rows mixed up): such a call is refused before
any work.
"""

from __future__ import annotations

import torch


def check_no_row_routing(model: torch.nn.Module, mode: str) -> None:
    """A ValueError when PEFT routes this call's rows through per-row forward pre-hooks."""
    kinds: set[str] = set()
    hooked = 0
    for module in model.modules():
        found = {_tuner(hook) for hook in module._forward_pre_hooks.values()} - {None}
        if found:
            kinds |= found
            hooked += 1
    if hooked:
        raise ValueError(
            f"generate(batching={mode!r}): PEFT routes each row of this call through its own adapter, task or "
            "offsets (generate(adapter_names=...), task_ids=..., alora_offsets=..., X-LoRA: forward pre-hooks of "
            f"PEFT's {', '.join(sorted(kinds))} on {hooked} modules that index the batch's rows); the engine packs "
            "every request into one row, so it cannot. Use batching='off' for this call.")


def _tuner(hook) -> str | None:
    """The PEFT tuner whose model code registered `hook` (peft.tuners.<name>.model), or None."""
    module = getattr(getattr(hook, "func", hook), "__module__", None) or ""
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["peft", "tuners"] and parts[3] == "model":
        return parts[2]
    return None
