"""Parity passes kept on disk (engine/parity_store.py): a later process skips the check for the same
family, and only then. The in-process cache is cleared to stand for the later process."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import transformers
from models import tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine import parity, parity_store

IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store in a fresh folder, the in-process verdicts empty, and every probe counted."""
    monkeypatch.setenv("HF_ASYNC_CB_CACHE", str(tmp_path))
    monkeypatch.setenv(parity_store.KEEP_VARIABLE, "1")
    monkeypatch.setattr(parity, "_VERDICTS", {})
    probes = []
    original = parity._probe
    monkeypatch.setattr(parity, "_probe", lambda engine, model, **kw: probes.append(1) or original(engine, model, **kw))
    return probes, tmp_path / "parity-passed"


def _later_process(monkeypatch):
    monkeypatch.setattr(parity, "_VERDICTS", {})


def test_a_pass_is_kept_for_a_later_process(store, monkeypatch):
    probes, folder = store
    model = tiny_model("llama")
    Engine(copy.deepcopy(model), BatchingConfig(mode="sync")).close()
    assert len(probes) == 1 and len(os.listdir(folder)) == 1
    _later_process(monkeypatch)
    Engine(copy.deepcopy(model), BatchingConfig(mode="sync")).close()
    assert len(probes) == 1  # read from disk
    # Another dtype, config or family is another key: checked.
    _later_process(monkeypatch)
    Engine(copy.deepcopy(model).to(torch.float64), BatchingConfig(mode="sync")).close()
    other = copy.deepcopy(tiny_model("qwen2"))
    Engine(other, BatchingConfig(mode="sync")).close()
    assert len(probes) == 3 and len(os.listdir(folder)) == 3


def test_patched_modeling_code_is_checked_afresh(store, monkeypatch):
    """Kernel libraries patch transformers' modeling modules (a class's forward, a module's helper):
    a pass measured without the patch is not taken for the patched code."""
    probes, _ = store
    model = tiny_model("llama")
    Engine(copy.deepcopy(model), BatchingConfig(mode="sync")).close()
    llama = transformers.models.llama.modeling_llama
    rotary = llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda *args, **kwargs: rotary(*args, **kwargs))
    _later_process(monkeypatch)
    Engine(copy.deepcopy(model), BatchingConfig(mode="sync")).close()
    assert len(probes) == 2
    mlp_forward = llama.LlamaMLP.forward
    monkeypatch.setattr(llama.LlamaMLP, "forward", lambda self, x: mlp_forward(self, x))
    _later_process(monkeypatch)
    Engine(copy.deepcopy(model), BatchingConfig(mode="sync")).close()
    assert len(probes) == 3
    monkeypatch.undo()  # (the store's folder too: what follows is the plain code again, in a fresh folder)


def test_refusals_and_models_running_the_users_code_are_not_kept(store, monkeypatch):
    probes, folder = store
    model = copy.deepcopy(tiny_model("llama"))
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output)
    Engine(model, BatchingConfig(mode="sync")).close()
    patched = copy.deepcopy(tiny_model("llama"))
    forward = patched.model.layers[0].mlp.forward
    patched.model.layers[0].mlp.forward = lambda x: forward(x)
    Engine(patched, BatchingConfig(mode="sync")).close()
    assert len(probes) == 2 and not folder.exists()

    from hf_async_cb.model.kv_cache import PagedKVCache

    update = PagedKVCache.update
    monkeypatch.setattr(PagedKVCache, "update", lambda self, k, v, layer_idx, *a, **kw: update(self, k * 2, v, layer_idx, *a, **kw))
    with pytest.raises(ValueError, match="differ from its own forward"):
        Engine(copy.deepcopy(tiny_model("qwen2")), BatchingConfig(mode="sync"))
    assert not folder.exists()


def test_the_store_can_be_turned_off(store, monkeypatch):
    probes, folder = store
    monkeypatch.setenv(parity_store.KEEP_VARIABLE, "0")
    assert parity_store.folder() is None
    model = tiny_model("llama")
    for _ in range(2):
        _later_process(monkeypatch)
        Engine(copy.deepcopy(model), BatchingConfig(mode="sync")).close()
    assert len(probes) == 2 and not folder.exists()


_PROCESS = r"""
import torch, transformers, hf_async_cb
from hf_async_cb.engine import parity
probes = []
original = parity._probe
parity._probe = lambda engine, model, **kw: probes.append(1) or original(engine, model, **kw)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config).eval()
ids = torch.tensor([[5, 6, 7, 8, 9]])
assert torch.equal(model.generate(ids, max_new_tokens=4, batching="sync", pad_token_id=0),
                   model.generate(ids, max_new_tokens=4, batching="off", pad_token_id=0))
print("PROBES", len(probes))
"""


def test_two_processes(tmp_path):
    """The real thing: the second process's first generate() runs no probe, and gives stock's tokens."""
    env = dict(os.environ, HF_ASYNC_CB_CACHE=str(tmp_path), **{parity_store.KEEP_VARIABLE: "1"})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    found = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", _PROCESS], env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        found.append(int(result.stdout.split("PROBES")[-1]))
    assert found == [1, 0]
