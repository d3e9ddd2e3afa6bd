"""Linear classes found by running them to launch kernels off the current stream (model/stream_probe.py):
which modules are probed, how the profiler's events are read, the verdict counted by graph_safety, and
on CUDA a class from no list that launches on the legacy stream found, kept out of graphs and computed
on the default stream, with stock's tokens."""

import copy

import pytest
import torch
from models import left_pad, random_prompts, tiny_model

from hf_async_cb.model import graph_safety, stream_probe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class OnStreamLinear(torch.nn.Linear):
    """A linear of another package's, launching on the current stream."""
    __module__ = "mylib.layers"


class LegacyStreamLinear(torch.nn.Linear):
    """A linear of another package's whose kernel runs on the legacy default stream, as a C++ extension
    launching with `<<<grid, block>>>` does."""
    __module__ = "mylib.layers"

    def forward(self, x):
        if x.device.type != "cuda":
            return super().forward(x)
        with torch.cuda.stream(torch.cuda.default_stream(x.device)):
            return super().forward(x)


class SubclassWeight(torch.Tensor):
    """A tensor subclass as a weight (torchao's and quanto's weights are)."""


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    monkeypatch.setattr(stream_probe, "_VERDICTS", {})


def test_only_leaf_linears_that_may_run_code_of_their_own_are_probed():
    plain = torch.nn.Linear(8, 8)
    assert not stream_probe.is_candidate(plain)
    assert stream_probe.is_candidate(OnStreamLinear(8, 8)) and stream_probe.is_candidate(LegacyStreamLinear(8, 8))
    subclassed = torch.nn.Linear(8, 8)
    subclassed.weight = torch.nn.Parameter(torch.randn(8, 8).as_subclass(SubclassWeight))
    assert stream_probe.is_candidate(subclassed)
    model = tiny_model("llama")
    assert not [name for name, m in model.named_modules() if stream_probe.is_candidate(m)]  # torch and transformers
    wrapper = type("Wrapper", (torch.nn.Module,), {"__module__": "mylib.layers"})()
    wrapper.in_features, wrapper.inner = 8, OnStreamLinear(8, 8)
    assert not stream_probe.is_candidate(wrapper)  # (not a leaf: its children are probed instead)


def test_kernels_on_another_stream_than_the_markers_are_named():
    marker = "void at::cuda::(anonymous namespace)::spin_kernel<long>(long)"
    events = [(marker, 13), ("gemm", 13), ("unpack", 7), ("gemm", 13), ("unpack", 7), ("gemv", 7)]
    assert stream_probe.off_stream_kernels(events) == ("unpack", "gemv")
    assert stream_probe.off_stream_kernels([(marker, 13), ("gemm", 13)]) == ()
    assert stream_probe.off_stream_kernels([("gemm", 13), ("unpack", 7)]) is None  # no marker: nothing said


def test_a_probed_verdict_counts_beside_the_lists(monkeypatch):
    model = copy.deepcopy(tiny_model("llama"))
    attention = model.model.layers[1].self_attn
    attention.v_proj = LegacyStreamLinear(attention.v_proj.in_features, attention.v_proj.out_features, bias=False)
    attention.o_proj = OnStreamLinear(attention.o_proj.in_features, attention.o_proj.out_features, bias=False)
    monkeypatch.setattr(graph_safety, "_on_cuda", lambda module: True)
    assert graph_safety.holds_off_stream_kernels(model) == []  # not listed, not probed
    stream_probe._VERDICTS[stream_probe.key(attention.v_proj)] = ("gemm",)
    stream_probe._VERDICTS[stream_probe.key(attention.o_proj)] = ()
    name = "model.layers.1.self_attn.v_proj"
    assert graph_safety.holds_off_stream_kernels(model) == [name]
    assert graph_safety.graph_unsafe_weights(model) == [(name, "LegacyStreamLinear")]


def test_the_probe_runs_nothing_off_cuda_or_under_a_running_profiler():
    model = copy.deepcopy(tiny_model("llama"))
    model.model.layers[0].mlp.up_proj = LegacyStreamLinear(64, 128, bias=False)
    assert stream_probe.probe(model, torch.float32) == {} and stream_probe._VERDICTS == {}  # (weights on the CPU)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert stream_probe.probe(model, torch.float32) == {}
    assert stream_probe._VERDICTS == {}


def _with_projection(cls: type) -> torch.nn.Module:
    model = copy.deepcopy(tiny_model("llama"))
    attention = model.model.layers[1].self_attn
    old = attention.v_proj
    attention.v_proj = cls(old.in_features, old.out_features, bias=False)
    attention.v_proj.weight.data.copy_(old.weight.data)
    return model


@pytest.mark.skipif(DEVICE != "cuda", reason="streams exist on CUDA only")
def test_the_probe_finds_a_legacy_stream_kernel_and_clears_an_on_stream_one():
    model = _with_projection(LegacyStreamLinear).cuda()
    model.model.layers[0].self_attn.o_proj = OnStreamLinear(64, 64, bias=False).cuda()
    found = stream_probe.probe(model, torch.float32)
    assert list(found) == ["model.layers.1.self_attn.v_proj"]
    assert stream_probe.verdict(model.model.layers[0].self_attn.o_proj) == ()


@pytest.mark.skipif(DEVICE != "cuda", reason="streams exist on CUDA only")
def test_the_probe_agrees_with_the_list_on_quantos_packed_weights():
    quanto = pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    model = copy.deepcopy(tiny_model("llama")).cuda()
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    assert stream_probe.probe(model, torch.float32) == {}  # (listed: not probed)
    stream_probe.probe(model, torch.float32, listed_too=True)
    for name, module in model.named_modules():
        if graph_safety.module_launches_off_stream(module) and stream_probe.is_candidate(module):
            assert stream_probe.verdict(module), name


@pytest.mark.skipif(DEVICE != "cuda", reason="streams exist on CUDA only")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_over_an_unlisted_legacy_stream_class_computes_on_the_default_stream(mode):
    import hf_async_cb
    from hf_async_cb.generate.runtime import _RUNTIMES

    model = _with_projection(LegacyStreamLinear).cuda()
    ids, mask = (t.cuda() for t in left_pad(random_prompts(6, 200, 300, seed=4)))
    expected = model.generate(ids, attention_mask=mask, batching="off", max_new_tokens=8)
    got = model.generate(ids, attention_mask=mask, batching=mode, max_new_tokens=8)
    assert torch.equal(got, expected)
    engine = _RUNTIMES[model].engine
    assert engine.streams.compute == torch.cuda.default_stream() and engine.graphs is None
    hf_async_cb.release(model)
