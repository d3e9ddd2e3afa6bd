"""The model families on the GPU fast path (Triton attention, CUDA graphs, fused kernels).

Each family of FAMILIES runs as the CPU sweep's tiny random model (tests/model_configs.py), moved
to CUDA, through model.generate(batching="sync" / "async") against stock greedy generate:

- fp32: the kernels' IEEE path; the tokens must equal stock's exactly;
- bf16: the parity check must pass (the engine refuses what it gets wrong); tokens are compared
  and the share that matches is reported (16-bit rounding may flip a near tie).

For each it reports whether decode steps ran in CUDA graphs (graphs captured, captures failed),
as one JSON line per family and dtype, and exits non-zero if an fp32 run differs or a family
is refused or crashes.

    PYTHONPATH=.:tests python benchmarks/gpu_families.py [--types gemma2,gpt_oss]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
from family_sweep import GENERATE, prompts_for  # noqa: E402
from model_configs import tiny_model  # noqa: E402

import hf_async_cb  # noqa: E402
from hf_async_cb.generate.runtime import _RUNTIMES  # noqa: E402

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
            "gemma3_text", "phi3", "phimoe", "olmo2", "olmoe", "gpt_neox", "falcon", "stablelm", "granite",
            "cohere2", "smollm3", "deepseek_v3", "gpt_oss", "starcoder2", "gptj", "gemma4_text", "gpt_bigcode",
            "nemotron", "minicpm3")


def run(model_type: str, dtype: torch.dtype) -> dict:
    model, reason = tiny_model(model_type)
    if model is None:
        return {"family": model_type, "dtype": str(dtype), "error": reason}
    model = model.to("cuda", dtype)
    ids, mask = prompts_for(model_type, min(256, model.get_input_embeddings().num_embeddings))
    ids, mask = ids.cuda(), mask.cuda()
    row = {"family": model_type, "dtype": str(dtype).removeprefix("torch.")}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, attention_mask=mask, batching="off", **GENERATE)
        for mode in ("sync", "async"):
            try:
                got = model.generate(ids, attention_mask=mask, batching=mode, **GENERATE)
            except Exception as error:  # noqa: BLE001 - reported
                row[mode] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                continue
            new = GENERATE["max_new_tokens"]
            same = (got[:, -new:] == expected[:, -new:]).float().mean().item() if got.shape == expected.shape else 0.0
            row[mode] = "exact" if torch.equal(got, expected) else f"{same:.0%} of tokens equal"
            runtime = _RUNTIMES.get(model)
            engine = runtime.engine if runtime is not None else None
            if engine is not None and engine.graphs is not None:
                row["graphs"] = engine.graphs.num_captured
                row["graph_failures"] = len(engine.graphs.failed)
            row["attention"] = getattr(engine, "attention_backend", None)
    hf_async_cb.release(model)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(FAMILIES))
    args = parser.parse_args()
    bad = 0
    for model_type in args.types.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            row = run(model_type, dtype)
            print(json.dumps(row), flush=True)
            modes = [row.get(m, "") for m in ("sync", "async")]
            if dtype == torch.float32 and any(m != "exact" for m in modes):
                bad += 1
            elif any(m.split(":")[0].endswith(("Error", "Exception")) for m in modes):
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
