"""A tensor-parallel model (transformers' tp_plan="auto", two CPU processes over gloo) on the engine.

The oracle is the same model in one process: greedy tokens must equal stock generate's and the
single-process engine's, sampled tokens with an engine seed must equal the single-process engine's,
and both ranks must produce the same tokens (their engines schedule alike: engine/distributed.py).
Each rank's KV pool holds its own KV heads only.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from models import left_pad, scaled

import hf_async_cb
from hf_async_cb import BatchingConfig

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
NEW = 8
CASES = {  # name -> generate options
    "greedy sync": dict(batching="sync", do_sample=False),
    "greedy async": dict(batching="async", do_sample=False),
    "sampled, engine seed": dict(batching="async", do_sample=True, temperature=0.9, top_k=40,
                                 batching_config=BatchingConfig(seed=123)),
    "sampled, no seed": dict(batching="sync", do_sample=True, temperature=0.9),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs():

    return left_pad(PROMPTS)


def _generate(model, options) -> list[list[int]]:
    ids, mask = _inputs()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None, **options)
    return out[:, ids.shape[1]:].tolist()


def _rank(rank: int, world: int, port: int, path: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
        out = {"stock": _generate(model, dict(batching="off", do_sample=False))}
        for name, options in CASES.items():
            torch.manual_seed(1000 + rank)  # ranks seeded apart, as per-rank seeding would leave them
            out[name] = _generate(model, options)
        # A pool sized differently per rank (another memory budget): the ranks agree on the smaller.
        engine = hf_async_cb.Engine(model, BatchingConfig(cpu_kv_cache_bytes=(1 + rank) * 2**20))
        out["pages"] = engine.num_pages
        out["kv heads"] = engine.layout.layers[0].key_heads
        try:
            engine.start()
            out["start"] = "started"
        except ValueError as error:
            out["start"] = str(error)
        results.put((rank, out))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put((rank, {"error": f"{type(error).__name__}: {error}"}))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process results, per-rank results of the two-process tensor-parallel run)."""
    path = str(tmp_path_factory.mktemp("tp") / "llama")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(0)
    model = scaled(transformers.LlamaForCausalLM(config).eval())
    model.save_pretrained(path)
    single = {"stock": _generate(model, dict(batching="off", do_sample=False))}
    single.update((name, _generate(model, options)) for name, options in CASES.items())
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank, args=(rank, 2, port, path, results)) for rank in range(2)]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, out in per_rank.items():
        assert "error" not in out, f"rank {rank}: {out['error']}"
    return single, per_rank


def test_greedy_tokens_equal_the_single_process_run(runs):
    single, per_rank = runs
    assert single["greedy sync"] == single["stock"] == single["greedy async"]
    for out in per_rank.values():
        assert out["stock"] == single["stock"]  # stock generate on the sharded model: the oracle holds
        assert out["greedy sync"] == out["greedy async"] == single["stock"]


def test_sampled_tokens_agree_across_ranks_and_with_one_process(runs):
    single, per_rank = runs
    assert per_rank[0]["sampled, engine seed"] == per_rank[1]["sampled, engine seed"] == single["sampled, engine seed"]
    # Without an engine seed each rank would draw its own: they agree on rank 0's.
    assert per_rank[0]["sampled, no seed"] == per_rank[1]["sampled, no seed"]


def test_each_rank_holds_its_own_kv_heads_and_the_pools_agree(runs):
    _, per_rank = runs
    assert per_rank[0]["kv heads"] == per_rank[1]["kv heads"] == 1  # 2 KV heads over 2 ranks
    assert per_rank[0]["pages"] == per_rank[1]["pages"]  # each rank's own budget, the smaller one wins


def test_a_background_loop_is_refused_on_a_tensor_parallel_model(runs):
    _, per_rank = runs
    assert all("tensor-parallel" in out["start"] for out in per_rank.values())


def test_a_model_spread_over_devices_is_refused_before_any_work():
    """device_map models (layers on several devices) are refused with the way out; on the CPU the
    split is faked by reporting a second device for one parameter."""
    from models import tiny_model

    model = tiny_model("llama")
    weight = model.model.layers[1].self_attn.q_proj.weight
    original = type(weight).device
    try:
        type(weight).device = property(lambda p: torch.device("cuda", 1) if p is weight else original.__get__(p))
        with pytest.raises(ValueError, match="spread over.*tp_plan"):
            hf_async_cb.Engine(model)
    finally:
        type(weight).device = original


@pytest.mark.parametrize("offload", ["cpu_offload", "disk device_map"])
def test_an_offloaded_model_is_refused_with_the_reason(offload, tmp_path):
    """accelerate's offload (weights on 'meta', loaded into each layer as it runs) is refused up
    front with the reason, by Engine and by generate, and the model still generates with stock."""
    accelerate = pytest.importorskip("accelerate")
    import copy

    from models import tiny_model

    model = copy.deepcopy(tiny_model("llama"))
    ids = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=3, do_sample=False, batching="off")
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device="cpu")
    else:  # one layer offloaded to disk, the rest in memory
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        model = accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="offloaded"):
        hf_async_cb.Engine(model)
    with pytest.raises(ValueError, match="offloaded"):
        model.generate(ids, max_new_tokens=3, do_sample=False, batching="async")
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, batching="off"), expected)
