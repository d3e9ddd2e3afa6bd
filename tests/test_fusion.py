"""fuse_projections: fused model == unfused model (logits, greedy generate), no second weight copy,
restore() gives back exactly the original model, and the per-input cache never serves a stale result."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from models import CONFIGS, tiny_model
from torch import nn

from hf_async_cb.model.fusion import FusedPart, FusedProjections, fuse_projections

UNFUSED = ("llama", "qwen2", "qwen3", "mistral")
PREFUSED = ("phi3", "gpt2")
MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def fresh(family):
    return copy.deepcopy(tiny_model(family))


def input_ids(seed=0, batch=3, length=17):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def greedy(model, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), batching="off", do_sample=False,
                          max_new_tokens=8)


def transformers_model(family):
    torch.manual_seed(7)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def modules_by_name(model):
    return dict(model.named_modules())


def assert_no_shared_storage(model):
    ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(ptrs) == len(set(ptrs))


@pytest.mark.parametrize("family", UNFUSED)
def test_fused_model_matches_unfused(family):
    model = fresh(family)
    ids = input_ids(seed=len(family))
    expected_logits, expected_tokens = logits(model, ids), greedy(model, ids)
    keys = list(model.state_dict())

    fused = fuse_projections(model)

    assert fused.num_groups == 2 * model.config.num_hidden_layers
    layers = model.config.num_hidden_layers
    assert fused.summary() == f"fused {layers} qkv and {layers} gate_up groups"
    assert list(model.state_dict()) == keys  # parameter names survive fusion
    torch.testing.assert_close(logits(model, ids), expected_logits, rtol=0, atol=1e-5)
    # The model's forward fed each group's members the same tensor: every cache hit, then dropped.
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, FusedPart)}
    assert len(groups) == fused.num_groups
    assert all(g._x is None and g._outputs is None for g in groups.values())
    assert torch.equal(greedy(model, ids), expected_tokens)
    fused.restore()


@pytest.mark.parametrize("family", UNFUSED)
def test_members_are_views_of_one_fused_tensor(family):
    model = fresh(family)
    fuse_projections(model)
    parts = [m for m in model.modules() if isinstance(m, FusedPart)]
    assert len(parts) == 5 * model.config.num_hidden_layers
    assert not any(type(m) is nn.Linear and n.rsplit(".", 1)[-1] in MEMBERS for n, m in model.named_modules())
    for part in parts:
        group = part.group
        assert part.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
        if part.bias is not None:
            assert part.bias.untyped_storage().data_ptr() == group.bias.untyped_storage().data_ptr()
        start = sum(group.sizes[:part.index])
        assert torch.equal(part.weight, group.weight[start:start + part.out_features])
    # qwen2 has q/k/v biases; its MLP has none.
    assert any(p.bias is not None for p in parts) == (family == "qwen2")


@pytest.mark.parametrize("family", PREFUSED)
def test_prefused_models_are_left_alone(family):
    model = fresh(family)
    ids = input_ids()
    before_modules, before_state, expected = modules_by_name(model), snapshot(model), logits(model, ids)
    fused = fuse_projections(model)
    assert fused.num_groups == 0
    assert fused.summary() == "fused 0 qkv and 0 gate_up groups"
    after = modules_by_name(model)
    assert after.keys() == before_modules.keys()
    assert all(after[name] is module for name, module in before_modules.items())
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(model, ids), expected)


@pytest.mark.parametrize("family", UNFUSED + PREFUSED)
def test_restore_gives_back_the_exact_model(family):
    model = transformers_model(family)
    ids = input_ids(seed=1)
    before_modules, before_state, expected = modules_by_name(model), snapshot(model), logits(model, ids)
    before_types = {name: type(m) for name, m in before_modules.items()}

    fused = fuse_projections(model)
    logits(model, ids)  # use it while fused
    fused.restore()
    fused.restore()  # idempotent

    after = modules_by_name(model)
    assert after.keys() == before_modules.keys()
    assert all(after[name] is module and type(module) is before_types[name] for name, module in before_modules.items())
    state = model.state_dict()
    assert list(state) == list(before_state)
    assert all(torch.equal(state[k], before_state[k]) for k in before_state)
    assert_no_shared_storage(model)
    assert all(p.is_contiguous() for p in model.parameters())
    assert torch.equal(logits(model, ids), expected)


def test_restore_copies_one_group_at_a_time(monkeypatch):
    """restore() gives each member its own storage and lets its group's fused tensor go before it
    copies the next group: giving back an 8B model does not need a second copy of its weights (a
    closed engine's restore ran out of memory beside a full KV pool)."""
    import weakref

    model = transformers_model("llama")
    fused = fuse_projections(model)
    fused_tensors = [weakref.ref(group.weight) for group in fused.groups()]
    alive_at_copies = []
    clone = torch.Tensor.clone

    def counting_clone(tensor, *args, **kwargs):
        alive_at_copies.append(sum(ref() is not None for ref in fused_tensors))
        return clone(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    fused.restore()
    monkeypatch.undo()
    groups = len(fused_tensors)
    assert groups >= 4
    members_per_group = [3, 2] * (groups // 2)  # q/k/v then gate/up, layer by layer
    expected, left = [], groups
    for size in members_per_group:
        expected += [left] * size
        left -= 1
    assert alive_at_copies == expected
    assert all(ref() is None for ref in fused_tensors)
    assert_no_shared_storage(model)


def test_context_manager_restores_on_exception():
    model = fresh("qwen2")
    before_modules, before_state = modules_by_name(model), snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with fuse_projections(model) as fused:
            assert isinstance(fused, FusedProjections) and fused.num_groups == 4
            assert isinstance(model.model.layers[0].self_attn.q_proj, FusedPart)
            raise RuntimeError("boom")
    assert all(modules_by_name(model)[name] is m for name, m in before_modules.items())
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
    assert_no_shared_storage(model)


class Attention(nn.Module):
    """q/k/v with small-integer weights, so every product is exact and results compare with torch.equal."""

    def __init__(self, bias=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 6, bias), nn.Linear(8, 4, bias), nn.Linear(8, 4, bias)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-3, 4, p.shape, generator=g).float())


def ints(*shape, seed):
    return torch.randint(-5, 6, shape, generator=torch.Generator().manual_seed(seed)).float()


def reference(module):
    """The unfused weights (cloned), to compute the oracle F.linear from."""
    return {n: (getattr(module, n).weight.detach().clone(), getattr(module, n).bias.detach().clone())
            for n in ("q_proj", "k_proj", "v_proj")}


@torch.no_grad()
def test_cache_serves_siblings_of_the_same_input():
    module = Attention()
    ref = reference(module)
    fuse_projections(module)
    x = ints(2, 5, 8, seed=1)
    q, k, v = module.q_proj(x), module.k_proj(x), module.v_proj(x)
    for name, out in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
        assert torch.equal(out, F.linear(x, *ref[name]))
    # One GEMM: all three are slices of one output.
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    # Every member consumed its output: nothing is held.
    assert module.q_proj.group._x is None and module.q_proj.group._outputs is None


@torch.no_grad()
def test_cache_never_returns_a_stale_result():
    module = Attention()
    ref = reference(module)
    fuse_projections(module)
    x, y = ints(3, 8, seed=1), ints(3, 8, seed=2)

    module.q_proj(x)
    assert torch.equal(module.k_proj(y), F.linear(y, *ref["k_proj"]))  # different tensor
    assert torch.equal(module.v_proj(y.clone()), F.linear(y, *ref["v_proj"]))  # equal values, other object

    module.q_proj(x)
    x.add_(1)  # same object, bumped _version
    assert torch.equal(module.k_proj(x), F.linear(x, *ref["k_proj"]))

    q = module.q_proj(x)
    q.mul_(0)  # the caller overwrote its output; asking again must recompute
    assert torch.equal(module.q_proj(x), F.linear(x, *ref["q_proj"]))

    with torch.inference_mode():  # no version counter: computed per part, still exact
        z = ints(3, 8, seed=3)
        for name in ("q_proj", "k_proj", "v_proj", "q_proj"):
            assert torch.equal(getattr(module, name)(z), F.linear(z, *ref[name]))


class Mixed(nn.Module):
    def __init__(self, **members):
        super().__init__()
        for name, m in members.items():
            setattr(self, name, m)


class MyLinear(nn.Linear):
    pass


@pytest.mark.parametrize("case", {
    "subclass": dict(q_proj=nn.Linear(8, 4), k_proj=MyLinear(8, 4), v_proj=nn.Linear(8, 4)),
    "in_features": dict(q_proj=nn.Linear(8, 4), k_proj=nn.Linear(6, 4), v_proj=nn.Linear(8, 4)),
    "bias": dict(gate_proj=nn.Linear(8, 4), up_proj=nn.Linear(8, 4, bias=False)),
    "dtype": dict(gate_proj=nn.Linear(8, 4), up_proj=nn.Linear(8, 4, dtype=torch.float64)),
    "missing": dict(q_proj=nn.Linear(8, 4), k_proj=nn.Linear(8, 4)),
}.items(), ids=lambda case: case[0])
def test_incompatible_groups_are_not_fused(case):
    module = Mixed(**case[1])
    before = dict(module.named_children())
    fused = fuse_projections(module)
    assert fused.num_groups == 0
    assert dict(module.named_children()) == before


def test_out_features_may_differ():
    module = Mixed(gate_proj=nn.Linear(8, 3, bias=False), up_proj=nn.Linear(8, 5, bias=False))
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = module.gate_proj(x), module.up_proj(x)
        with fuse_projections(module) as fused:
            assert fused.summary() == "fused 0 qkv and 1 gate_up groups"
            got = module.gate_proj(x), module.up_proj(x)
    assert [t.shape for t in got] == [(4, 3), (4, 5)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_with_fused_projections_matches_stock_and_gives_the_model_back(family, mode):
    from models import generated_rows, random_prompts, stock_generate

    from hf_async_cb import BatchingConfig, Engine

    model = fresh(family)
    originals = {name: m for name, m in model.named_modules() if name.split(".")[-1] in MEMBERS}
    prompts = random_prompts(5, 3, 40, seed=2)
    expected = generated_rows(stock_generate(model, prompts, max_new_tokens=10, eos_token_id=[2], pad_token_id=0),
                              max(map(len, prompts)), 0, (2,))
    with Engine(model, BatchingConfig(mode=mode, fuse_projections=True, max_batch_tokens=32)) as engine:
        assert engine.prepared_model.fusion is not None and engine.prepared_model.fusion.num_groups == 2 * model.config.num_hidden_layers
        outs = engine.generate(prompts, max_new_tokens=10, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected
    assert {name: m for name, m in model.named_modules() if name.split(".")[-1] in MEMBERS} == originals
    # generate(batching=...) with fusion on restores the model too, even when the call fails.
    ids = torch.tensor([prompts[0]])
    cfg = BatchingConfig(fuse_projections=True)
    model.generate(ids, max_new_tokens=4, batching=mode, batching_config=cfg)
    with pytest.raises(ValueError):
        model.generate(ids, max_new_tokens=4, num_return_sequences=2, batching=mode, batching_config=cfg)
    assert {name: m for name, m in model.named_modules() if name.split(".")[-1] in MEMBERS} == originals


@pytest.mark.parametrize("when", ["before the first call", "between calls"])
def test_weights_shared_with_another_model_stay_shared(when):
    """A weight whose storage another tensor also holds (a second model given the first's weights by
    `load_state_dict(..., assign=True)`, a reference model sharing the policy's) keeps that storage:
    fusing (first call) or giving the weights their own storage back (Engine.close) used to move it
    to a new one, after which the other model no longer saw the model's training steps, where stock
    keeps them one tensor (its tokens silently went stale)."""
    import hf_async_cb

    config = hf_async_cb.BatchingConfig(fuse_projections=True, fuse_elementwise=False, max_batch_tokens=32)
    policy, reference = fresh("llama"), fresh("llama")
    ids = input_ids(batch=2, length=9)
    if when == "before the first call":
        reference.load_state_dict(policy.state_dict(), assign=True)
    out = policy.generate(ids, attention_mask=torch.ones_like(ids), batching="sync", max_new_tokens=4,
                          batching_config=config)
    assert torch.equal(out, greedy(policy, ids)[:, :13])
    if when == "between calls":
        reference.load_state_dict(policy.state_dict(), assign=True)
        hf_async_cb.release(policy)  # (the runtime's fusion would keep the views alive anyway)
        engine = hf_async_cb.Engine(policy, config)
        engine.generate([ids[0].tolist()], max_new_tokens=2)
        engine.close()
    with torch.no_grad():  # a training step on the policy
        for p in policy.parameters():
            p.mul_(0.5)
    for name, p in policy.named_parameters():
        assert torch.equal(p, reference.get_parameter(name)), name
    assert torch.equal(greedy(reference, ids), greedy(policy, ids))
    # A model that shares nothing is still fused.
    alone = fresh("llama")
    fused = fuse_projections(alone)
    assert fused.counts == {"qkv": 2, "gate_up": 2}
    fused.restore()
