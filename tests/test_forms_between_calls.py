"""Every form a user loads (benchmarks/gpu_model_stack.py's table: the quantization libraries, PEFT
adapters, a compiled forward) keeps its generate runtime and its prefix cache from one call to the next
with the same prompts, with stock's tokens: nothing a forward leaves behind reads as a changed model.
(LLM.int8()'s outlier columns, a new tensor in the module's state each forward, made every call rebuild
the runtime; HQQ's zeros, inference tensors with no version counter, emptied the cache at each call.)"""

import os
import sys

import pytest
import torch
from models import left_pad, random_prompts

import hf_async_cb
from hf_async_cb.generate import runtime as runtime_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_model_stack as stack  # noqa: E402

FORMS = ["plain", "bitsandbytes-int8", "bitsandbytes-nf4", "quanto-int8", "quanto-int4", "hqq-4bit",
         "torchao-int8-weight-only", "torchao-float8-weight-only", "torchao-intx-weight-only", "lora", "prefix-tuning",
         "compiled"]


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    stack._plain("cpu").save_pretrained(path)
    return str(path)


def _load(form: str, path: str) -> torch.nn.Module:
    """The form's model on the CPU (the test skipped on CUDA, or where its library is absent)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's forms (the GPU's: benchmarks/gpu_model_stack.py)")
    try:
        return stack.FORMS[form](path, "cpu").eval()
    except stack.NotInstalled as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("form", FORMS)
def test_the_next_call_keeps_the_runtime_and_the_prompts_pages(form, saved_llama):
    model = _load(form, saved_llama)
    prompts = random_prompts(3, 40, 60, seed=2)
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    if form == "compiled":
        model.compile()
    runtimes, hits = [], []
    for _ in range(2):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
                             pad_token_id=0, batching="sync")
        if form == "prefix-tuning" and not runtimes:  # (stock PEFT drops the prefix on transformers 5.24+:
            expected = got                           # docs/models.md; exact in tests/test_prefix_tuning.py)
        assert torch.equal(got, expected)
        holder, = runtime_module._holders(model, "test")
        runtimes.append(runtime_module._RUNTIMES[holder])
        hits.append(hf_async_cb.prefix_cache_stats(model)["hit_tokens"] - sum(hits))
    assert runtimes[1] is runtimes[0], "the runtime was rebuilt for the second call"
    assert hits[1] >= hits[0] + 3 * 32, "the second call did not take the first call's pages"
    hf_async_cb.release(model)


@pytest.mark.parametrize("form", [f for f in FORMS if f not in ("lora", "prefix-tuning")])
def test_a_serving_loop_serves_request_after_request(form, saved_llama):
    """A held Engine's background loop checks the model at each admission: what a forward leaves behind
    must not read as a model changed since the build (which refuses the request)."""
    model = _load(form, saved_llama)
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    engine = hf_async_cb.Engine(model, hf_async_cb.BatchingConfig(mode="async"))
    try:
        engine.start()
        for _ in range(3):
            out = engine.add_request(prompt, max_new_tokens=4, eos_token_ids=()).result(timeout=120)
            assert out.output_token_ids == expected
    finally:
        engine.shutdown(cancel=True, timeout=60)
        engine.close()
