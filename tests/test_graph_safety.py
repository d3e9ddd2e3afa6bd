"""Modules whose CUDA kernels launch on the legacy stream (model/graph_safety.py): named from their class
(optimum-quanto's packed weights, gptqmodel's ExLlamaV2 and AWQ linears), kept out of CUDA graphs, and
an engine over them computes on the default stream, where those kernels are ordered with the rest of
its steps. gptqmodel's classes are stood in for by classes of the same module path and name: its
package needs a newer torch than the CI's (tests/test_gptq_awq.py runs the real ones on the CPU)."""

import copy

import pytest
import torch
from models import left_pad, random_prompts, tiny_model

from hf_async_cb.model import graph_safety

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _stand_in(module_path: str, name: str) -> type:
    """A linear class named as one of another package's (its module path and class name)."""
    return type(name, (torch.nn.Linear,), {"__module__": module_path})


GPTQ = "gptqmodel.nn_modules.qlinear."
OFF_STREAM = [(GPTQ + "exllamav2", "ExllamaV2Linear"), (GPTQ + "exllamav2_awq", "AwqExllamaV2Linear"),
              (GPTQ + "gemm_awq", "AwqGEMMLinear"), (GPTQ + "gemv_fast_awq", "AwqGEMVFastLinear")]
ON_STREAM = [(GPTQ + "marlin", "MarlinLinear"), (GPTQ + "tritonv2", "TritonV2Linear"), (GPTQ + "torch", "TorchLinear"),
             ("mylib.exllamav2", "ExllamaV2Linear"),  # (the same name from another package)
             (GPTQ + "machete", "MacheteLinear")]


@pytest.mark.parametrize("module_path, name", OFF_STREAM + ON_STREAM)
def test_module_classes_that_launch_on_the_legacy_stream_are_named(module_path, name):
    module = _stand_in(module_path, name)(8, 8)
    assert graph_safety.module_launches_off_stream(module) == ((module_path, name) in OFF_STREAM)
    assert not graph_safety.module_launches_off_stream(torch.nn.Linear(8, 8))


def _with_projection(cls: type) -> torch.nn.Module:
    model = copy.deepcopy(tiny_model("llama"))
    attention = model.model.layers[1].self_attn
    old = attention.v_proj
    attention.v_proj = cls(old.in_features, old.out_features, bias=False)
    return model


def test_off_stream_modules_are_kept_out_of_graphs_and_named_only_on_cuda(monkeypatch):
    model = _with_projection(_stand_in(GPTQ + "exllamav2", "ExllamaV2Linear"))
    on_stream = _with_projection(_stand_in(GPTQ + "marlin", "MarlinLinear"))
    if DEVICE == "cpu":  # nothing on CUDA: nothing to name
        assert graph_safety.holds_off_stream_kernels(model) == [] and graph_safety.graph_unsafe_weights(model) == []
        monkeypatch.setattr(graph_safety, "_on_cuda", lambda module: True)
    else:
        model, on_stream = model.cuda(), on_stream.cuda()
    name = "model.layers.1.self_attn.v_proj"
    assert graph_safety.holds_off_stream_kernels(model) == [name]
    assert graph_safety.graph_unsafe_weights(model) == [(name, "ExllamaV2Linear")]
    routed = [model.get_submodule(name)]  # routed: its small steps are captured, larger ones are capped
    assert graph_safety.graph_unsafe_weights(model, routed) == [] and graph_safety.graph_token_cap(routed) is not None
    assert graph_safety.holds_off_stream_kernels(model) == [name]  # (routed or not: it still runs its own forward)
    assert graph_safety.holds_off_stream_kernels(on_stream) == [] and graph_safety.graph_unsafe_weights(on_stream) == []


@pytest.mark.skipif(DEVICE != "cuda", reason="streams exist on CUDA only")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_over_legacy_stream_kernels_computes_on_the_default_stream(mode):
    """quanto's fp32 int4 weights unpack on the legacy stream in their own forward (the prefill steps,
    larger than the kernel's rows): the engine computes there, and gives stock's tokens."""
    quanto = pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    import hf_async_cb
    from hf_async_cb.generate.runtime import _RUNTIMES

    def compute_stream(model, prompts):
        ids, mask = (t.cuda() for t in left_pad(prompts))
        expected = model.generate(ids, attention_mask=mask, batching="off", max_new_tokens=8)
        got = model.generate(ids, attention_mask=mask, batching=mode, max_new_tokens=8)
        assert torch.equal(got, expected)
        stream = _RUNTIMES[model].engine.streams.compute
        hf_async_cb.release(model)
        return stream

    model = copy.deepcopy(tiny_model("llama")).cuda()
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    prompts = random_prompts(6, 200, 300, seed=3)  # prefill steps over the kernel's rows
    assert compute_stream(model, prompts) == torch.cuda.default_stream()
    assert compute_stream(copy.deepcopy(tiny_model("llama")).cuda(), prompts) != torch.cuda.default_stream()
