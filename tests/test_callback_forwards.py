"""The call's own callbacks run the model it generates with, as stock generate lets them
(model/callback_forwards.py): a self-guiding logits processor, a stopping criterion that scores
the text, a processor running stock generate to look ahead, a streamer scoring each token, a
serving loop's token and done callbacks. Stock generate with the same callbacks is the oracle;
the projections fused (what the GPU runs) and not."""

from __future__ import annotations

import copy

import pytest
import torch
from models import Gate, left_pad, random_prompts, started_thread, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_async_cb import BatchingConfig, Engine

MODES = ["sync", "async"]
CONFIGS = {"unfused": BatchingConfig(fuse_projections=False), "fused": BatchingConfig(fuse_projections=True)}
PROMPTS = random_prompts(4, 3, 12, seed=11)


class SelfGuide(LogitsProcessor):
    """Contrast with the model's own logits on the last three tokens alone."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, scores):
        own = self.model(input_ids[:, -3:]).logits[:, -1].float()
        return scores - 0.5 * own


class LookAhead(LogitsProcessor):
    """Ban the token stock greedy would give two tokens later (stock generate inside the call)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, scores):
        ahead = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2,
                                    do_sample=False, pad_token_id=0)
        return scores.scatter(1, ahead[:, -1:], -1e9)


class ModelSaysStop(StoppingCriteria):
    """Stop a row once the model, on its last two tokens, ranks token 3 above token 4."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, scores, **kwargs):
        logits = self.model(input_ids[:, -2:]).logits[:, -1]
        return logits[:, 3] > logits[:, 4]


class ScoringStreamer:
    """Each step's tokens scored by the model (what a streamer computing a running score does)."""

    def __init__(self, model):
        self.model, self.scores = model, []

    def put(self, value):
        if value.dim() == 1:  # a step's tokens (the prompt comes first, as a [batch, width] tensor)
            with torch.no_grad():
                self.scores.append(self.model(value[:, None]).logits[:, -1].argmax(-1).tolist())

    def end(self):
        pass


def generate(model, mode=None, config=None, **kwargs):
    ids, mask = left_pad(PROMPTS)
    if mode is not None:
        kwargs.update(batching=mode, batching_config=config)
    kwargs.setdefault("max_new_tokens", 6)
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)


def own_hooks(model) -> list:
    return [(name, hook) for name, m in model.named_modules() for hook in m._forward_pre_hooks.values()
            if getattr(hook, "__module__", "").startswith("hf_async_cb.")]


@pytest.mark.parametrize("fusion", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("callback", ["processor", "lookahead", "criterion", "streamer"])
def test_a_callback_running_the_model_gives_stock_tokens(callback, mode, fusion):
    model = tiny_model("llama")
    before = model(torch.tensor([PROMPTS[0]])).logits

    def arguments():
        if callback == "processor":
            return {"logits_processor": LogitsProcessorList([SelfGuide(model)])}
        if callback == "lookahead":
            return {"logits_processor": LogitsProcessorList([LookAhead(model)])}
        if callback == "criterion":
            return {"stopping_criteria": StoppingCriteriaList([ModelSaysStop(model)]), "max_new_tokens": 12}
        return {"streamer": ScoringStreamer(model)}

    stock_arguments, engine_arguments = arguments(), arguments()
    expected = generate(model, **stock_arguments)
    got = generate(model, mode, CONFIGS[fusion], **engine_arguments)
    assert torch.equal(got, expected)
    if callback == "criterion":  # (it ended rows at different steps)
        assert (expected[:, -1] == 0).any() and (expected[:, -1] != 0).any()
    if callback == "streamer":
        assert engine_arguments["streamer"].scores == stock_arguments["streamer"].scores
    assert own_hooks(model) == []  # the call's hooks went with it
    assert torch.equal(model(torch.tensor([PROMPTS[0]])).logits, before)  # stock again, the weights untouched
    assert torch.equal(generate(model, mode, CONFIGS[fusion]), generate(model))  # and the next call runs


@pytest.mark.parametrize("mode", MODES)
def test_a_callback_running_a_layer_on_its_own_is_refused_with_what_to_do(mode):
    """Below the model, its base model and its embeddings the engine cannot tell a callback's
    forward from its own: refused by name (the request fails; nothing hangs, no wrong tokens)."""
    model = tiny_model("llama")
    layer, rotary = model.model.layers[0], model.model.rotary_emb

    class OneLayer(LogitsProcessor):
        def __call__(self, input_ids, scores):
            hidden = torch.randn(1, 3, model.config.hidden_size)
            positions = torch.arange(3)[None]
            layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary(hidden, positions))
            return scores

    with pytest.raises(RuntimeError, match="a layer called on its own"):
        generate(model, mode, logits_processor=LogitsProcessorList([OneLayer()]))
    assert torch.equal(generate(model, mode), generate(model))


@pytest.mark.parametrize("mode", MODES)
def test_a_serving_loops_token_and_done_callbacks_run_the_model_it_serves(mode):
    """On the loop's thread, between its steps: each token scored by the model (on_token) and the
    whole text scored when the request ends (a done-callback computing a reward)."""
    model = copy.deepcopy(tiny_model("llama"))
    expected = generate(model, max_new_tokens=5)
    width = expected.shape[1] - 5
    engine = Engine(model, BatchingConfig(mode=mode, fuse_projections=True))
    engine.start()
    try:
        scored, rewards, handles = {}, {}, []
        for i, prompt in enumerate(PROMPTS):
            def on_token(request, token, i=i):
                scored.setdefault(i, []).append(float(model(torch.tensor([[token]])).logits[0, -1, 0]))

            handle = engine.add_request(prompt, max_new_tokens=5, eos_token_ids=(), on_token=on_token)
            handle.add_done_callback(lambda h, i=i: rewards.__setitem__(
                i, model(torch.tensor([h.request.prompt_token_ids + h.request.output_token_ids])).logits[0, -1, 0].item()))
            handles.append(handle)
        outs = [h.result(timeout=60).output_token_ids for h in handles]
    finally:
        engine.shutdown(timeout=30)
    assert outs == expected[:, width:].tolist()
    with torch.no_grad():
        for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
            assert scored[i] == [float(model(torch.tensor([[t]])).logits[0, -1, 0]) for t in out]
            assert rewards[i] == model(torch.tensor([prompt + out])).logits[0, -1, 0].item()


def test_a_callback_running_a_model_another_threads_call_holds_is_refused_and_that_call_goes_on():
    """Thread A's engine call holds model A (paused inside its processor); a processor of thread B's
    call on model B runs model A: only A's own callbacks get A set aside, so B's forward is refused,
    saying so (never a forward on A's engine modules), and A's call then ends with stock's tokens."""
    a, b = copy.deepcopy(tiny_model("llama")), copy.deepcopy(tiny_model("llama", seed=1))
    width = max(map(len, PROMPTS))
    expected = [row[width:] for row in generate(a).tolist()]
    engine_a, engine_b = Engine(a, CONFIGS["fused"]), Engine(b, CONFIGS["fused"])
    gate = Gate(width)
    thread, box = started_thread(lambda: engine_a.generate(PROMPTS, max_new_tokens=6, eos_token_ids=(),
                                                           logits_processor=gate))
    try:
        assert gate.inside.wait(30)
        with pytest.raises(RuntimeError, match="another thread's engine call holds"):
            engine_b.generate(PROMPTS, max_new_tokens=3, logits_processor=LogitsProcessorList([SelfGuide(a)]))
    finally:
        gate.release.set()
        thread.join(30)
    assert [o.output_token_ids for o in box["value"]] == expected
    engine_a.close()
    engine_b.close()
