"""One family of the sweep against stock greedy generate: exact, refused, differs or crash.

Shared by tests/test_model_sweep.py (which asserts the default verdicts) and
benchmarks/model_sweep.py (which tabulates them for the whole mapping, in docs/models.md).
Verdicts are by what a user would see: a ValueError that hf_async_cb raises (its support checks,
the parity check) is a refusal; any other exception, or a ValueError raised by torch or the
modeling code while the engine runs, is an internal crash; tokens that differ from stock's
without an error are silently wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
import zlib

import torch
from model_configs import VOCAB, first_line, tiny_model
from models import left_pad, random_prompts

import hf_async_cb

MODES = ("sync", "async")
OUTCOMES = ("exact", "refused", "differs", "crash", "not built")
# Greedy, a fixed length (no EOS), left padding with 0: the engine must give stock's tensor exactly.
GENERATE = dict(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)


@dataclasses.dataclass
class Outcome:
    kind: str  # one of OUTCOMES
    reason: str = ""
    tokens: torch.Tensor | None = None
    # differs from stock generate, but is stock with use_cache=False, which stock itself is not
    stock_cache_disagrees: bool = False


def prompts_for(model_type: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three random prompts of 5..20 tokens (ids >= 3, clear of pad/bos/eos), left-padded."""
    return left_pad(random_prompts(3, 5, 20, seed=zlib.crc32(model_type.encode()), vocab=vocab))


def _inputs(model_type: str, model) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        vocab = min(VOCAB, model.get_input_embeddings().num_embeddings)
    except Exception:  # noqa: BLE001 - a model without the accessor: the config's vocabulary
        vocab = VOCAB
    return prompts_for(model_type, vocab)


def generate(model, model_type: str, batching: str | None, config=None) -> Outcome:
    """One generate call, as an Outcome: "exact" here only means it returned (compare the tokens);
    a ValueError raised by hf_async_cb itself (or by generate's argument validation) is a refusal,
    any other exception a crash. batching=None leaves the argument out."""
    ids, mask = _inputs(model_type, model)
    kwargs = dict(GENERATE) if batching is None else dict(GENERATE, batching=batching)
    if config is not None:
        kwargs["batching_config"] = config
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            return Outcome("exact", tokens=model.generate(ids, attention_mask=mask, **kwargs))
    except ValueError as error:
        if batching not in ("off", None) and (raised_by_hf_async_cb(error) or _validating_arguments(error)):
            return Outcome("refused", str(error).strip().splitlines()[0] if str(error).strip() else "")
        return Outcome("crash", first_line(error) + _where(error))
    except Exception as error:  # noqa: BLE001 - the sweep records it
        return Outcome("crash", first_line(error) + _where(error))
    finally:
        if batching not in ("off", None):
            hf_async_cb.release(model)


def raised_by_hf_async_cb(error: BaseException) -> bool:
    """Whether the innermost frame is hf_async_cb's own code: its checks refuse with a ValueError,
    but a ValueError from torch or the modeling code inside the engine is a crash."""
    return f"{os.sep}hf_async_cb{os.sep}" in _innermost(error)[0]


def _validating_arguments(error: BaseException) -> bool:
    """A ValueError from generate's own argument checks (a model that overrides generate() never
    reaches hf_async_cb's hook, and stock rejects `batching` as an unused argument): before any work."""
    path, function = _innermost(error)
    return f"generation{os.sep}utils.py" in path and function.startswith("_validate")


def _innermost(error: BaseException) -> tuple[str, str]:
    """(file, function) of the frame that raised `error`."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name) if tb is not None else ("", "")


def _where(error: BaseException) -> str:
    """ " (in transformers/models/x/modeling_x.py)": where the error was raised, package-relative."""
    path = _innermost(error)[0]
    for marker, prefix in (("site-packages" + os.sep, ""), (f"{os.sep}hf_async_cb{os.sep}", "hf_async_cb/")):
        if marker in path:
            return f" (in {prefix}{path.split(marker, 1)[1]})"
    return ""


@functools.lru_cache(maxsize=None)
def stock(model_type: str) -> Outcome:
    """The oracle: stock greedy generate (batching="off"); "not built" if there is no model or
    stock itself fails on it (then there is nothing to compare with)."""
    model, reason = tiny_model(model_type)
    if model is None:
        return Outcome("not built", reason)
    out = generate(model, model_type, "off")
    if out.kind == "crash" and "['batching']" in out.reason:  # generate() overridden: no hook to take it
        out = generate(model, model_type, None)
    if out.kind != "exact":
        return Outcome("not built", f"stock generate fails on it ({out.reason})")
    return out


@functools.lru_cache(maxsize=None)
def stock_without_cache(model_type: str) -> torch.Tensor | None:
    """Stock greedy generate with use_cache=False: the model's own forward, token after token."""
    model, _ = tiny_model(model_type)
    ids, mask = _inputs(model_type, model)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            return model.generate(ids, attention_mask=mask, batching="off", use_cache=False, **GENERATE)
    except Exception:  # noqa: BLE001 - no second opinion
        return None


def compare(model_type: str, expected: torch.Tensor, got: Outcome) -> Outcome:
    """`got` against stock's tokens; where they differ, the first differing row, and whether
    stock's own cached generate disagrees with its uncached one (then the model's forward
    is on the engine's side)."""
    if got.kind != "exact" or torch.equal(got.tokens, expected):
        return got
    if got.tokens.shape != expected.shape:
        return Outcome("differs", f"shape {tuple(got.tokens.shape)}, stock {tuple(expected.shape)}", got.tokens)
    row = int((got.tokens != expected).any(1).nonzero()[0])
    col = int((got.tokens[row] != expected[row]).nonzero()[0])
    width = expected.shape[1] - GENERATE["max_new_tokens"]
    reason = f"row {row} from new token {col - width}: {got.tokens[row, width:].tolist()} " \
             f"vs stock {expected[row, width:].tolist()}"
    uncached = stock_without_cache(model_type)
    if uncached is not None and torch.equal(got.tokens, uncached):
        return Outcome("differs", reason + "; equals stock with use_cache=False (stock's cached generate disagrees "
                                           "with its own forward)", got.tokens, stock_cache_disagrees=True)
    return Outcome("differs", reason, got.tokens)


def run_family(model_type: str, trusted: bool = False, modes=MODES) -> tuple[Outcome, dict[str, Outcome]]:
    """The family's verdict over `modes` (the worst of: crash, differs, refused, exact), and each
    mode's own outcome."""
    expected = stock(model_type)
    if expected.kind != "exact":
        return expected, {}
    model, _ = tiny_model(model_type)
    config = hf_async_cb.BatchingConfig(trust_untested_model=True) if trusted else None
    per_mode = {mode: compare(model_type, expected.tokens, generate(model, model_type, mode, config))
                for mode in modes}
    for kind in ("crash", "differs", "refused", "exact"):
        hits = [m for m, o in per_mode.items() if o.kind == kind]
        if hits:
            first = per_mode[hits[0]]
            where = "" if len(hits) == len(modes) else f"{'/'.join(hits)} only: "
            return Outcome(kind, where + first.reason), per_mode
    raise AssertionError("no mode ran")
