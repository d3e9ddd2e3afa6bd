"""The parity check: a model family runs on the engine only if its logits match its own forward.

Rather than a list of tested families, an engine checks the model it is given, once per model
class, config, dtype and device in a process: two short prompts (one spanning several pages) run
through the engine's whole path (fused projections, element-wise kernels, paged attention, the
cache) for a few greedy steps, keeping each step's logits; the model's own forward, on the same
tokens, gives the reference. The largest difference, relative to the reference's largest logit,
must stay under a tolerance set by the dtype (TOLERANCE). Otherwise, or if the probe fails (the
modeling code or the cache layout cannot take the engine's inputs), the engine refuses the model
with a ValueError naming the family and the reason, before any of the caller's work.

Verdicts are cached per (class, config, dtype, device type) and whatever else changes how the model
computes without changing those (tensor-subclass weights and their layout, quantized module classes
and their settings, PEFT adapters and which are active, merged or disabled, compiled wrappers:
model/numerics_key.py) and the engine's own path (fusions, attention backend), so the check costs
nothing after the first engine and a verdict is never borrowed from a model that computes otherwise;
BatchingConfig(trust_untested_model=True) skips it. A pass is also kept on disk for later processes
(engine/parity_store.py). The probe runs in eval mode (a
model left in train mode would fail on its dropout); a model with forward hooks is checked with
them, per engine, its verdict kept for no other model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from hf_async_cb.engine import parity_store
from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.model.attention import own_configs
from hf_async_cb.model.compiled import compiled_wrappers, uncompiled
from hf_async_cb.model.code_identity import code_identity
from hf_async_cb.model.eval_mode import as_in_eval
from hf_async_cb.model.fusion import has_hooks
from hf_async_cb.model.kv_fingerprint import runs_user_code
from hf_async_cb.model.numerics_key import numerics_key
from hf_async_cb.model.model_guard import model_guard
from hf_async_cb.model.weight_kinds import versions

logger = logging.getLogger(__name__)

# Largest |ours - reference| over the reference's largest |logit| (at least 1): float32 agrees to
# rounding; 16-bit dtypes round every layer's output, so their logits drift by a few percent of the
# largest logit (on an H200, random bf16 weights: 0.018 for the Llama-3.2-1B shape, 0.059 for the
# 8B one), while a family the engine gets wrong (an ignored attention sink, positions read from the
# cache, a missing bias) is off by the order of the logits themselves. Deeper 16-bit models drift
# more: their bound leaves room for that, and float32 (the tests) holds the check tight.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 0.1, torch.bfloat16: 0.25}
PROBE_LENGTHS = (37, 11)
PROBE_NEW_TOKENS = 4

_VERDICTS: dict[tuple, str | None] = {}  # key -> None (passed) or the reason for refusing


def probe_pages(page_size: int) -> int:
    """KV pages the probe needs: a pool sized for a call must hold at least these."""
    return sum(-(-(n + PROBE_NEW_TOKENS) // page_size) for n in PROBE_LENGTHS)


def _key(engine) -> tuple:
    """What a verdict holds for: the family (class, config), dtype and device type, whatever else
    changes the model's numerics (quantized weights and modules, adapters, compiled wrappers:
    model/numerics_key.py) and the engine's own path (which fusions it runs, its attention backend)."""
    model, prepared = engine.model, engine.prepared_model
    path = (prepared.fusion is not None and prepared.fusion.num_groups > 0, prepared.elementwise is not None,
            prepared.decode_gemms is not None, engine.attention_backend)
    try:
        numerics = numerics_key(model)
    except Exception as error:  # noqa: BLE001 - an attribute it cannot read: checked afresh, never shared
        logger.debug("hf_async_cb: no numerics key for %s (%s); its verdict is its own", type(model).__name__, error)
        numerics = object()
    return (type(model), model.config.to_json_string(use_diff=False), engine.dtype, engine.device.type, numerics, path)


def check_parity(engine) -> None:
    """Raise ValueError if `engine`'s model does not reproduce its own forward on the engine."""
    model = engine.model
    # In this process a verdict is kept for the code it was measured on too (model/code_identity.py: a
    # class's forward patched since); on disk, parity_store hashes that code into the file's name.
    key = (_key(engine), code_identity(list(model.modules())))
    hooked = sum(map(has_hooks, model.modules()))  # this instance's own: its verdict is not the family's
    # Modules on configs of their own (a layer deep-copied in) make the instance its own case too.
    own = hooked or bool(own_configs(model, model.config))
    # Not kept across processes: a model running the user's code (hooks, a patched instance forward),
    # which may change between processes under the same names.
    stored = None if own or key in _VERDICTS or runs_user_code(model) else \
        parity_store.path_for(key[0], model, engine.device)
    if key in _VERDICTS and not own:
        reason = _VERDICTS[key]
    elif parity_store.passed_before(stored):
        reason = _VERDICTS[key] = None
        logger.info("hf_async_cb: %s passed the parity check in an earlier process (%s; kept in %s)",
                    type(model).__name__, engine.dtype, parity_store.folder())
    else:
        before = versions(model.parameters())
        # The family is judged in fp32 arithmetic of its own dtype, without dropout: whatever mode the
        # model is in, and outside any autocast region the first call happens to run in.
        with as_in_eval(model, warn=False), torch.autocast(engine.device.type, enabled=False):
            reason, whole = _probe(engine, model, hooks_raise=bool(hooked))
        if versions(model.parameters()) != before:  # trained in place meanwhile (another thread): no verdict
            if reason is not None:
                reason += (" (its weights changed in place while the check ran, a training step in another "
                           "thread?, so it compared two different models; call again once they are still)")
        elif (reason is not None or whole) and not own:  # a pass on shortened prompts is this engine's only
            _VERDICTS[key] = reason
            if reason is None:
                parity_store.keep_pass(stored, model)
        if reason is None:
            logger.info("hf_async_cb: %s passed the parity check (%s)", type(model).__name__, engine.dtype)
    if reason is not None:
        family = getattr(model.config, "model_type", None) or type(model).__name__
        if hooked:
            reason += (f" (with the forward hooks of {hooked} module{'s' * (hooked > 1)}: the engine runs every request "
                       "packed into one [1, tokens] row, so a hook that reads or changes outputs by batch row or "
                       "sequence position sees other shapes than in stock generate)")
        raise ValueError(f"{type(model).__name__} (model_type {family!r}) cannot run on hf_async_cb: {reason}. "
                         "BatchingConfig(trust_untested_model=True) skips this check, at your own risk.")


def _reference_logits(model: torch.nn.Module, sequences: list[list[int]], device, batched: bool) -> list[torch.Tensor]:
    """The model's own forward's logits over each sequence, [len, V] in fp32. `batched`: in one
    left-padded batch (positions from the mask, as stock generate gives them), as a hooked model's
    hooks see a batch in stock generate: a hook that treats rows apart (steering one row, a vector
    per row) then differs from the engine, where every request shares one packed row."""
    if not batched:
        out = []
        for sequence in sequences:
            ids = torch.tensor([sequence], device=device)
            out.append(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float())
        return out
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence):] = torch.tensor(sequence, device=device)
        mask[row, width - len(sequence):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    return [logits[row, width - len(sequence):] for row, sequence in enumerate(sequences)]


@contextlib.contextmanager
def _uncompiled_held(model: torch.nn.Module):
    """The model under its guard (nested in the engine's build), its compiled wrappers set aside
    (none: as it is): another thread's call has its own modules swapped in while it holds the model,
    and a reference forward run meanwhile would compare the engine with that call's modules."""
    with model_guard(model).held("the parity check", kind="build"), \
            (uncompiled(model) if compiled_wrappers(model) else contextlib.nullcontext()):
        yield


def _lengths(limit: int | None) -> list[int]:
    """The probe's prompt lengths: PROBE_LENGTHS, at most half the model's positions (`limit`)."""
    return [n if limit is None else max(1, min(n, limit // 2)) for n in PROBE_LENGTHS]


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    low = min(3, vocab - 1)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _probe(engine, model: torch.nn.Module, hooks_raise: bool = False) -> tuple[str | None, bool]:
    """(None if the engine's logits match the model's own, else why not; whether the probe ran its
    whole prompts). A pool too small for them (num_pages set small) takes shorter ones: an engine
    never runs unchecked. hooks_raise: the model has forward hooks, so an error inside the model may
    be a hook's own; it reaches the caller as it would from stock generate."""
    room = engine.scheduler.allocator.num_pages * engine.scheduler.page_size - PROBE_NEW_TOKENS
    if room < 1:  # this engine's pool, not the family: no verdict to keep
        raise ValueError(f"{type(model).__name__}: the KV pool ({room + PROBE_NEW_TOKENS} tokens) is too small for "
                         f"the parity check's {PROBE_NEW_TOKENS + 1} tokens; raise BatchingConfig.num_pages.")
    reach = engine.prompt_limits.reach  # (Llama 4: positions within which its attention is plain causal)
    limits = [engine.max_positions, engine.rope_switch and engine.rope_switch[0], reach and reach[0]]
    lengths = _lengths(min((n for n in limits if n), default=None))
    whole = max(lengths) <= room  # else shortened to what the pool holds beside the new tokens
    prompts = _prompts(engine.vocab_size, [min(n, room) for n in lengths])
    config = engine.config
    engine.config = dataclasses.replace(config, progress=False, profile=False)
    try:
        probe = SamplingParams(max_new_tokens=PROBE_NEW_TOKENS, eos_token_ids=())  # every token compared, EOS or not
        requests = [engine.make_request(p, probe) for p in prompts]
        for r in requests:
            r.keep_scores = True  # each step's raw logits, on the host
        engine.run(requests, "sync")
    except ValueError as error:
        return f"the parity check could not run it ({error})", whole
    except Exception as error:  # noqa: BLE001 - a crash inside the model or the cache is the verdict
        if hooks_raise:
            raise
        first = str(error).splitlines()[0] if str(error) else ""
        return f"the parity check failed inside the model ({type(error).__name__}: {first})", whole
    finally:
        engine.config = config
    worst = 0.0
    sequences = [r.prompt_token_ids + r.output_token_ids[:-1] for r in requests]
    with _uncompiled_held(model):  # the model's own forward, without dynamo (model/compiled.py)
        references = _reference_logits(model, sequences, engine.device, batched=hooks_raise)
    for request, reference in zip(requests, references):
        ours = torch.stack([t.float().cpu() for t in request.output_logits])
        reference = reference[len(request.prompt_token_ids) - 1:].cpu()
        scale = max(1.0, float(reference.abs().max()))
        worst = max(worst, float((ours - reference).abs().max()) / scale)
    tolerance = TOLERANCE.get(engine.dtype, 0.1)
    logger.info("hf_async_cb: parity of %s: %.3g of the largest logit (tolerance %g)", type(model).__name__, worst,
                tolerance)
    if not worst <= tolerance:  # NaN fails too
        return (f"its logits on the engine differ from its own forward by {worst:.3g} of the largest logit "
                f"(tolerance {tolerance:g} in {str(engine.dtype).removeprefix('torch.')})"), whole
    return None, whole
