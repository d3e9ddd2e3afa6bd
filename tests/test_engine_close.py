"""Engine.close() from another thread while a call of the engine runs: it waits for the call (whose
pool it freed under it before: an IndexError from inside the step), then gives the model back."""

import copy

import pytest
import torch
from models import Gate, left_pad, random_prompts, started_thread, stock_generate, tiny_model

import hf_async_cb
from hf_async_cb import BatchingConfig

PROMPTS = random_prompts(3, 3, 16, seed=11)
WIDTH = max(map(len, PROMPTS))


@pytest.mark.parametrize("fuse", [False, True])
def test_closing_an_engine_while_another_thread_runs_it_waits_for_the_call(fuse):
    model = copy.deepcopy(tiny_model("llama"))
    expected = stock_generate(model, PROMPTS, max_new_tokens=5)[:, WIDTH:].tolist()
    engine = hf_async_cb.Engine(model, BatchingConfig(fuse_projections=fuse))
    gate = Gate(WIDTH)
    caller, box = started_thread(lambda: engine.generate(PROMPTS, max_new_tokens=5, eos_token_ids=(), logits_processor=gate))
    assert gate.inside.wait(30)
    closer, close_box = started_thread(engine.close)
    closer.join(1)
    assert closer.is_alive()  # waiting for the call
    gate.release.set()
    caller.join(30)
    closer.join(30)
    assert not caller.is_alive() and not closer.is_alive(), "hang"
    assert "error" not in box and "error" not in close_box, (box, close_box)
    assert [o.output_token_ids for o in box["value"]] == expected
    ids, mask = left_pad(PROMPTS)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="sync")
    assert torch.equal(got, stock_generate(model, PROMPTS, max_new_tokens=5))
    with pytest.raises(RuntimeError, match="this Engine was closed"):
        engine.generate(PROMPTS, max_new_tokens=2)


def test_closing_an_engine_from_inside_its_own_call_is_refused_clearly():
    model = copy.deepcopy(tiny_model("llama"))
    engine = hf_async_cb.Engine(model, BatchingConfig(mode="sync"))

    def closing(input_ids, scores):
        engine.close()
        return scores

    with pytest.raises(RuntimeError, match="called from inside a generate call on the same model"):
        engine.generate(PROMPTS, max_new_tokens=3, logits_processor=closing)
    outs = engine.generate(PROMPTS, max_new_tokens=3, eos_token_ids=())  # still open and working
    assert all(len(o.output_token_ids) == 3 for o in outs)
    engine.close()
