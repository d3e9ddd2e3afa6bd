"""First use on a GPU: a fresh process with an empty Triton cache compiles every kernel variant its
model can need (and its launcher) in its first generate() call (kernels/precompile.py), and none in 20 later calls of
random batch sizes (1..256) and prompt lengths (1..4K), greedy and sampled. A 2-layer model of the
Llama-3.2-1B widths (its vocabulary, heads and head size set the variants) keeps it to a few
minutes on an H200. Skipped without CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

_SCRIPT = r"""
import json, random, sys, time
import torch
import hf_async_cb
from hf_async_cb.generate import runtime
from hf_async_cb.kernels import compiled_keys
from transformers import AutoConfig, AutoModelForCausalLM

config = AutoConfig.for_model("llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                              max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()


def call(rows, length, sampled, new):
    ids = torch.randint(3, config.vocab_size, (rows, length), device="cuda")
    decoding = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95) if sampled else dict(do_sample=False)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, batching="async",
                   batching_config=hf_async_cb.BatchingConfig(seed=0), pad_token_id=0, eos_token_id=None, **decoding)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def variants():
    return sum(len(keys) for keys in compiled_keys().values())


# C launchers built in this process (Triton <= 3.6 compiles one per kernel signature at its first launch,
# with the host's C compiler: the workers build them into the disk cache beside the kernels).
from triton.runtime import build
launchers = []
_build = build._build
build._build = lambda name, *args, **kwargs: launchers.append(name) or _build(name, *args, **kwargs)


report = dict(first_s=call(64, 128, True, 32))
report["launchers_first"] = launchers.count("__triton_launcher")
engine = runtime._RUNTIMES[model].engine  # the precompile started while the model was prepared, and the build's
ran = [p for p in (engine.prepared_model.checks_ahead, engine.prepared_model.kernels_ahead, engine._precompile) if p]
report.update(listed=sum(len(p.variants) for p in ran), loaded=sum(p.loaded for p in ran),
              on_device=sum(p.on_device for p in ran),
              failed=[f for p in ran for f in p.failed], summary=[p.summary() for p in ran], after_first=variants())
keys = compiled_keys()
# Binaries loaded onto the device by later calls' first launches (inside their graph captures): none, when
# the precompile loaded every variant ahead (HF_ASYNC_CB_LOAD_AHEAD, on unless "0").
from triton.runtime.driver import driver
loads = []
_load = driver.active.utils.load_binary
driver.active.utils.load_binary = lambda name, *args: loads.append(name) or _load(name, *args)
rng = random.Random(0)
report["later"] = []
for i in range(20):
    rows, length, sampled = rng.randint(1, 256), rng.randint(1, 4096), i % 2 == 0
    seconds = call(rows, length, sampled, 4)
    new = {name: sorted(set(k) - set(keys.get(name, ()))) for name, k in compiled_keys().items()}
    report["later"].append(dict(rows=rows, length=length, sampled=sampled, seconds=round(seconds, 3),
                                compiled={name: len(k) for name, k in new.items() if k}))
report["after_later"] = variants()
report["launchers_later"] = launchers.count("__triton_launcher") - report["launchers_first"]
report["loads_later"] = sorted(set(loads))
print("REPORT " + json.dumps(report))
"""


def test_a_fresh_process_compiles_everything_in_its_first_call_and_nothing_after(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    print(json.dumps(report, indent=1))  # (pytest -s shows the first call's time and each later call's)
    assert report["listed"] > 0 and not report["failed"], report["summary"]
    # (two listed variants may share a JIT key, so the JIT can hold fewer entries than were loaded)
    assert report["loaded"] > 0 and report["after_first"] > 0
    compiled_later = [c for c in report["later"] if c["compiled"]]
    assert not compiled_later, compiled_later
    assert report["after_later"] == report["after_first"]
    # No C launcher is compiled in the serving process (each one 0.3-1 s on its first launch): the workers built them.
    assert report["launchers_first"] == 0 and report["launchers_later"] == 0, report
    # Every variant was loaded onto the device ahead, so no later call loads one inside a capture.
    assert report["on_device"] == report["loaded"] and report["loads_later"] == [], report
