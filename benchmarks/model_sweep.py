"""Every causal-LM family of the installed transformers, on the engine against stock generate.

Each model type of transformers' causal-LM auto mapping, as a tiny random fp32 CPU model
(tests/model_configs.py), runs greedy generate with batching="sync" and "async", by default (the
engine's own checks decide) and with BatchingConfig(trust_untested_model=True) (they are
skipped), and is compared with stock generate token for token. Writes docs/models.md: one row per
family, default and trusted each one of exact / refused / differs / crash / not built, with the
refusal or error message. The default column is what tests/test_model_sweep.py asserts (never
differs, never crash); the trusted one shows what the checks protect users from.

    python benchmarks/model_sweep.py                  # the whole mapping -> docs/models.md
    python benchmarks/model_sweep.py --types llama,gpt2 --out /tmp/models.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_async_cb  # noqa: E402
from family_sweep import OUTCOMES, Outcome, run_family  # noqa: E402
from model_configs import MODEL_TYPES, tiny_model  # noqa: E402


class _TimedOut(Exception):
    pass


def _alarm(signum, frame):
    raise _TimedOut


def sweep_one(model_type: str, trusted: bool, timeout_s: int) -> Outcome:
    """run_family, but a family that hangs or breaks the harness is a crash, not the end of the sweep."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout_s)
    try:
        return run_family(model_type, trusted=trusted)[0]
    except _TimedOut:
        return Outcome("crash", f"timed out after {timeout_s} s")
    except Exception as error:  # noqa: BLE001 - recorded in the table
        return Outcome("crash", f"the sweep itself failed: {type(error).__name__}: {error}".splitlines()[0])
    finally:
        signal.alarm(0)
        model, _ = tiny_model(model_type)
        if model is not None:  # whatever happened, the next family starts without this one's runtime
            hf_async_cb.release(model)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _reason(default: Outcome, trusted: Outcome) -> str:
    if default.reason == trusted.reason or not trusted.reason:
        return default.reason
    if not default.reason:
        return f"trusted: {trusted.reason}"
    return f"{default.reason}<br>trusted: {trusted.reason}"


def render(rows: list[tuple[str, Outcome, Outcome]], command: str, seconds: float) -> str:
    counts = {label: collections.Counter(r.kind for r in col)
              for label, col in (("default", [r[1] for r in rows]), ("trusted", [r[2] for r in rows]))}
    lines = [
        "# Model families on hf_async_cb",
        "",
        ("Every model type of the installed transformers' causal-LM auto mapping "
         "(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), each as a tiny random model built from its config class's "
         "defaults (tests/model_configs.py: width 64, 2 layers, vocabulary 256, weights x4), fp32 on the CPU: "
         "three left-padded random prompts of 5 to 20 tokens, 8 greedy new tokens, `batching=\"sync\"` and "
         "`\"async\"` against stock `generate` (`batching=\"off\"`), token for token."),
        "",
        ("- **default**: as users get it, the engine's checks on. It must be *exact* or *refused* "
         "(a `ValueError` from hf_async_cb before any generation); tests/test_model_sweep.py asserts it."),
        "- **trusted**: `BatchingConfig(trust_untested_model=True)`, the checks skipped: what they protect from.",
        ("- *exact*: both modes gave stock's tokens; *refused*: hf_async_cb raised a `ValueError`; *differs*: "
         "other tokens, no error (\"equals stock with use_cache=False\": stock's own cached generate disagrees "
         "with its uncached one, and the engine gives the uncached tokens); *crash*: any other exception (or a "
         "`ValueError` from torch or the modeling code); *not built*: no tiny model of the family could be "
         "built, or stock generate itself fails on it (no oracle)."),
        "",
        (f"Generated {datetime.date.today().isoformat()} by `{command}` in {seconds / 60:.1f} min "
         f"(transformers {transformers.__version__}, torch {torch.__version__}, "
         f"hf_async_cb {hf_async_cb.__version__}, {len(rows)} model types)."),
        "",
        "| | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    for label, c in counts.items():
        lines.append(f"| {label} | " + " | ".join(str(c.get(k, 0)) for k in OUTCOMES) + " |")
    lines += ["", "| model type | default | trusted | reason |", "|---|---|---|---|"]
    for model_type, default, trusted in rows:
        lines.append(f"| {model_type} | {default.kind} | {trusted.kind} | {_cell(_reason(default, trusted))} |")
    return "\n".join(lines) + "\n"


# Sections of the file written by hand (from tests/test_model_stack.py), kept when the sweep rewrites it.
KEPT_FROM = "\n## Model stack"


def _kept_sections(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start = text.find(KEPT_FROM)
    return "" if start < 0 else text[start:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: the whole mapping)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "models.md"))
    parser.add_argument("--timeout", type=int, default=180, help="seconds per family and setting")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    types = args.types.split(",") if args.types else list(MODEL_TYPES)
    start, rows = time.time(), []
    for i, model_type in enumerate(types):
        t = time.time()
        default = sweep_one(model_type, False, args.timeout)
        trusted = sweep_one(model_type, True, args.timeout)
        rows.append((model_type, default, trusted))
        print(f"[{i + 1}/{len(types)}] {model_type}: {default.kind} / {trusted.kind} ({time.time() - t:.1f} s)"
              f"{'  ' + _reason(default, trusted)[:160] if default.reason or trusted.reason else ''}", flush=True)
    command = "python benchmarks/model_sweep.py" + (f" --types {args.types}" if args.types else "")
    kept = _kept_sections(args.out)
    with open(args.out, "w") as f:
        f.write(render(rows, command, time.time() - start) + kept)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
