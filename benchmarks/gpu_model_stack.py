#!/usr/bin/env python
"""What users load on top of a model, on the GPU: each quantized form, adapters, compiled forwards.

The GPU twin of tests/test_model_stack.py: a tiny random Llama in fp32 (tests/models.py), loaded
through each quantization library that is installed (bitsandbytes int8 / fp4 / nf4, quanto int8 /
int4, HQQ 4-bit, torchao int8 / int4 / float8 / intx forms), a LoRA adapter, prefix tuning, a
compiled forward. Each runs greedy generate with batching="off" (the oracle), "sync" and "async"
on the CUDA defaults (fused projections, element-wise kernels, skinny GEMM, CUDA graphs) and again
with fusion off, and is reported as

    exact          every run gave stock's tokens
    refused        hf_async_cb raised a ValueError (its message is printed)
    DIFFERS        other tokens without an error: a silent difference, a failure
    REBUILT        stock's tokens, but a second call with the same config rebuilt the runtime (something a
                   forward leaves behind read as a changed model: every call pays a first call's cost), a failure
    CRASH          any other exception inside hf_async_cb: a failure
    stock fails    the library's own forward fails here (no oracle; not ours)
    not installed  the library is absent

and exits with status 1 on any DIFFERS, REBUILT or CRASH. For a compiled model it also checks that the
engine's calls run no dynamo frame. Writes the rows as JSON to --out (default $OUT when set).

    python benchmarks/gpu_model_stack.py                       # every form whose library is installed
    python benchmarks/gpu_model_stack.py --forms torchao-int8-weight-only,lora
    python benchmarks/gpu_model_stack.py --device cpu          # the same on the CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402
from models import COMMON, hqq_in_place, left_pad, random_prompts, scaled  # noqa: E402

import hf_async_cb  # noqa: E402
from hf_async_cb import BatchingConfig  # noqa: E402
from hf_async_cb.generate import runtime as runtime_module  # noqa: E402


class NotInstalled(Exception):
    pass


class StockFails(Exception):
    pass


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise NotInstalled(f"{module}: {error}") from None


def _plain(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return scaled(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()).to(device)


def _bnb(path, device, **settings):
    _need("bitsandbytes")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.BitsAndBytesConfig(**settings), device_map=device, dtype=torch.float32)


def _quanto(path, device, weights):
    _need("optimum.quanto")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.QuantoConfig(weights=weights), device_map=device, dtype=torch.float32)


def _hqq(path, device):
    quantize = _need("hqq.core.quantize")
    return hqq_in_place(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device), quantize)


def _torchao(path, device, config_name, dtype=torch.float32, **settings):
    quantization = _need("torchao.quantization")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    quantization.quantize_(model, getattr(quantization, config_name)(**settings))
    return model


def _lora(path, device):
    peft = _need("peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _prefix_tuning(path, device):
    """Runs on the engine (exact in tests/test_prefix_tuning.py). The oracle here is stock PEFT generate,
    which feeds the prefix where the model's cache keyword is `past_key_values` (transformers <= 5.23);
    on 5.24 stock drops it for generate's `cache` and this form reads DIFFERS against stock's own error
    (docs/models.md, PEFT prefix tuning's oracle)."""
    peft = _need("peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


def _compiled(path, device):
    """Compiled by check() once stock's tokens are taken from the eager model (the oracle would
    otherwise spend its time in dynamo's recompiles)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


FORMS = {
    "plain": lambda path, device: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(
        device),
    "bitsandbytes-int8": lambda path, device: _bnb(path, device, load_in_8bit=True),
    "bitsandbytes-fp4": lambda path, device: _bnb(path, device, load_in_4bit=True,
                                                  bnb_4bit_compute_dtype=torch.float32),
    "bitsandbytes-nf4": lambda path, device: _bnb(path, device, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_compute_dtype=torch.float32),
    "quanto-int8": lambda path, device: _quanto(path, device, "int8"),
    "quanto-int4": lambda path, device: _quanto(path, device, "int4"),
    "hqq-4bit": _hqq,
    "torchao-int8-weight-only": lambda path, device: _torchao(path, device, "Int8WeightOnlyConfig"),
    "torchao-int8-dynamic-activation": lambda path, device: _torchao(path, device,
                                                                     "Int8DynamicActivationInt8WeightConfig"),
    "torchao-float8-weight-only": lambda path, device: _torchao(path, device, "Float8WeightOnlyConfig"),
    "torchao-float8-dynamic-activation": lambda path, device: _torchao(  # PerTensor: refused
        path, device, "Float8DynamicActivationFloat8WeightConfig", dtype=torch.bfloat16),
    "torchao-float8-dynamic-activation-per-row": lambda path, device: _torchao(
        path, device, "Float8DynamicActivationFloat8WeightConfig",
        granularity=_need("torchao.quantization.granularity").PerRow()),
    "torchao-int4-weight-only": lambda path, device: _torchao(path, device, "Int4WeightOnlyConfig",
                                                              dtype=torch.bfloat16, group_size=32),
    "torchao-intx-weight-only": lambda path, device: _torchao(path, device, "IntxWeightOnlyConfig"),
    "lora": _lora,
    "prefix-tuning": _prefix_tuning,
    "compiled": _compiled,
}


def _greedy(model, batching, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(random_prompts(4, 5, 20, seed=7))
    device = next(p.device for p in model.parameters())
    return model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=8,
                          eos_token_id=None, pad_token_id=0, batching=batching, **kwargs).cpu()


def _dynamo_frames() -> int:
    if "torch._dynamo" not in sys.modules:
        return 0
    return sum(sys.modules["torch._dynamo"].utils.counters["frames"].values())


def check(form: str, path: str, device: str) -> dict:
    row = {"form": form}
    start = time.perf_counter()
    try:
        try:
            model = FORMS[form](path, device).eval()
            expected = _greedy(model, "off")
        except NotInstalled:
            raise
        except Exception as error:  # noqa: BLE001 - the library itself: no oracle
            raise StockFails(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
        if form == "compiled":
            model.compile()
        frames = _dynamo_frames()
        runs = []
        for fuse in (None, False):  # None: the device's default (fused on CUDA)
            held = []  # (the runtime each call ran on: the second call of a config must keep the first's)
            for mode in ("sync", "async"):
                t = time.perf_counter()
                got = _greedy(model, mode, batching_config=BatchingConfig(fuse_projections=fuse))
                runs.append({"mode": mode, "fused": fuse, "exact": bool(torch.equal(got, expected)),
                             "s": round(time.perf_counter() - t, 2)})
                held.append(next((runtime_module._RUNTIMES.get(h) for h in runtime_module._holders(model, "check")),
                                 None))
            row.setdefault("runtime_kept", []).append(held[1] is held[0])
            hf_async_cb.release(model)
        row["runs"] = runs
        row["outcome"] = "exact" if all(r["exact"] for r in runs) else "DIFFERS"
        if row["outcome"] == "exact" and not all(row["runtime_kept"]):  # (each call paid a first call's cost)
            row["outcome"] = "REBUILT"
        if form == "compiled":
            row["dynamo_frames_in_engine_calls"] = _dynamo_frames() - frames
            if row["dynamo_frames_in_engine_calls"]:
                row["outcome"] = "DIFFERS"
    except NotInstalled as error:
        row.update(outcome="not installed", reason=str(error))
    except StockFails as error:
        row.update(outcome="stock fails", reason=str(error))
    except ValueError as error:
        row.update(outcome="refused", reason=str(error).splitlines()[0])
    except Exception as error:  # noqa: BLE001 - reported, and a failure
        row.update(outcome="CRASH", reason=f"{type(error).__name__}: {error}".splitlines()[0],
                   where=traceback.format_exc().splitlines()[-3:])
    row["s"] = round(time.perf_counter() - start, 1)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", help=f"comma-separated, of: {', '.join(FORMS)} (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join(os.environ["OUT"], "model_stack_gpu.json")
                        if os.environ.get("OUT") else None)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast", at every call
    forms = args.forms.split(",") if args.forms else list(FORMS)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    for package in ("peft", "torchao", "bitsandbytes", "optimum.quanto", "hqq"):
        try:
            versions[package] = getattr(__import__(package, fromlist=["__version__"]), "__version__", "?")
        except Exception as error:  # noqa: BLE001
            versions[package] = f"absent ({type(error).__name__})"
    print(json.dumps(versions), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as path:
        _plain("cpu").save_pretrained(path)
        for form in forms:
            row = check(form, path, args.device)
            rows.append(row)
            runs = " ".join(f"{r['mode']}/{'default' if r['fused'] is None else 'unfused'}:"
                            f"{'ok' if r['exact'] else 'DIFF'}({r['s']}s)" for r in row.get("runs", ()))
            print(f"{form:36s} {row['outcome']:14s} {row['s']:6.1f}s  {runs}  {row.get('reason', '')[:300]}",
                  flush=True)
            if row["outcome"] == "CRASH":
                print("    " + "\n    ".join(row["where"]), flush=True)
            if args.out:  # after every form: a run cut short still reports what it did
                with open(args.out, "w") as f:
                    json.dump({"versions": versions, "rows": rows}, f, indent=1)
    failed = [r["form"] for r in rows if r["outcome"] in ("DIFFERS", "CRASH", "REBUILT")]
    print(f"{len(rows)} forms: " + ", ".join(f"{k} {sum(r['outcome'] == k for r in rows)}" for k in
                                               ("exact", "refused", "DIFFERS", "REBUILT", "CRASH", "stock fails",
                                                "not installed")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
