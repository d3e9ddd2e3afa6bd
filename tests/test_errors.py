"""Bad input and unsupported options: a ValueError that says what is wrong, never a hang or wrong tokens."""

import pytest
import torch
import transformers
from models import generated_rows, left_pad, random_prompts, scaled, stock_generate, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TextStreamer

from hf_async_cb import BatchingConfig, Engine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, BatchingConfig(mode="sync", page_size=4, num_pages=16))


def gen(model, ids, **kwargs):
    return model.generate(ids, batching="sync", **kwargs)


@pytest.mark.parametrize("prompts, match", [
    ([], "empty"),
    ([[5, 6], []], "prompt 1 is empty"),
    ("hello", "list of token-id lists"),
    (["hello"], "tokenize"),
    ([[5, 300]], "outside the vocabulary"),
    ([[5, -1]], "outside the vocabulary"),
])
def test_engine_rejects_bad_prompts(engine, prompts, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, max_new_tokens=2)


def test_prompt_longer_than_model_maximum(engine):
    with pytest.raises(ValueError, match="longer than the model's maximum of 512"):
        engine.generate([[5] * 513], max_new_tokens=1)


def test_prompt_longer_than_the_pool(engine):
    with pytest.raises(ValueError, match="pool holds 64.*num_pages"):
        engine.generate([[5] * 60], max_new_tokens=10)


def test_learned_positions_cannot_be_exceeded():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(ValueError, match="positions of its position table"):
        Engine(gpt2, BatchingConfig(mode="sync")).generate([[5] * 500], max_new_tokens=20)


@pytest.mark.parametrize("family", ["opt", "biogpt", "ctrl", "gpt_bigcode", "codegen", "gptj"])
def test_every_fixed_position_table_is_a_limit_up_front(family):
    """Position tables other than GPT-2's wpe (OPT's and BioGPT's embed_positions, CTRL's
    pos_encoding, CodeGen's and GPT-J's precomputed rotary table) are limits too: a request running past one is refused before any work, so it
    cannot fail a step that other requests share (stock raises IndexError mid-run); one that
    ends at the table's last position runs."""
    from model_configs import routes_attention
    from model_configs import tiny_model as sweep_model

    from hf_async_cb.model.checks import has_learned_positions, max_positions

    model, why = sweep_model(family)
    assert model is not None, why
    assert has_learned_positions(model)
    limit = max_positions(model.config)
    if not routes_attention(model):  # (GPT-J's and CodeGen's attention before 5.2x: refused by name)
        with pytest.raises(ValueError, match="bypasses the attention interface"):
            Engine(model, BatchingConfig(mode="sync"))
        return
    engine = Engine(model, BatchingConfig(mode="sync"))
    with pytest.raises(ValueError, match="positions of its position table"):
        engine.generate([[5] * (limit - 5)], max_new_tokens=20)
    assert len(engine.generate([[5] * (limit - 5)], max_new_tokens=6, eos_token_ids=())[0].output_token_ids) == 6


def test_rope_and_alibi_models_have_no_position_table():
    from hf_async_cb.model.checks import has_learned_positions

    assert not has_learned_positions(tiny_model("llama")) and not has_learned_positions(tiny_model("qwen2"))


@pytest.mark.parametrize("value", [0, -3])
def test_max_new_tokens_must_be_positive(engine, model, value):
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[5, 6]], max_new_tokens=value)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen(model, torch.tensor([[5, 6]]), max_new_tokens=value)


def test_max_length_not_above_input(model):
    with pytest.raises(ValueError, match="max_length"):
        gen(model, torch.tensor([[5] * 10]), max_length=10)


def test_a_failed_request_leaves_the_engine_clean(engine):
    with pytest.raises(ValueError):
        engine.generate([[5, 6], [5] * 600], max_new_tokens=2)
    assert not engine.scheduler.has_work
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert engine.generate([[5, 6]], max_new_tokens=2)[0].finished


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=0), "page_size"),
    (dict(page_size=2.5), "page_size"),
    (dict(max_batch_tokens=0), "max_batch_tokens"),
    (dict(max_running_requests=-1), "max_running_requests"),
    (dict(num_pages=0), "num_pages"),
    (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
    (dict(mode="turbo"), "mode"),
    (dict(attention="flash"), "attention"),
])
def test_config_that_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchingConfig(**kwargs)


def test_pool_too_small_for_one_page(model):
    with pytest.raises(ValueError, match="single KV page"):
        Engine(model, BatchingConfig(cpu_kv_cache_bytes=16))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=2), "num_beams"),
    (dict(num_return_sequences=2), "do_sample"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(stop_strings=["x"]), "tokenizer"),
    (dict(token_type_ids=torch.zeros(1, 3, dtype=torch.long)), "token_type_ids"),
    (dict(inputs_embeds=torch.zeros(1, 4, 64)), "inputs_embeds .* does not match input_ids"),
])
def test_unsupported_generate_options_are_named(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gen(model, torch.tensor([[5, 6, 7]]), max_new_tokens=3, **kwargs)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_hidden_states_or_attentions_without_a_dict_output_run_as_in_stock(model, flag, mode):
    """Without return_dict_in_generate stock returns the sequences alone (the flag "may be ignored", it
    warns): they were refused as an unknown model argument. With it, refused by name."""
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, batching="off", **{flag: True})
    got = model.generate(ids, attention_mask=mask, max_new_tokens=3, batching=mode, **{flag: True})
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match=f"{flag}=True with return_dict_in_generate=True.*batching='off'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, batching=mode, return_dict_in_generate=True,
                       **{flag: True})


def test_text_streamer_refuses_batches_as_in_stock(model):
    class Tok:
        def decode(self, *a, **k):
            return ""

    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="batch size 1"):
        gen(model, ids, attention_mask=mask, max_new_tokens=3, streamer=TextStreamer(Tok()))


def test_right_padding_is_refused(model):
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="left padding"):
        gen(model, ids.flip(1), attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match="all zeros"):
        gen(model, ids, attention_mask=torch.zeros_like(mask), max_new_tokens=2)
    with pytest.raises(ValueError, match="does not match"):
        gen(model, ids, attention_mask=mask[:, 1:], max_new_tokens=2)
    # No mask passed and the pad id inside a prompt: the mask stock infers has a hole; the message
    # says where that mask came from and what to do.
    with pytest.raises(ValueError, match=r"inferred as input_ids != pad_token_id 0.*pass the attention_mask"):
        gen(model, torch.tensor([[5, 0, 7, 8], [0, 0, 9, 10]]), max_new_tokens=2, pad_token_id=0)


def test_bad_input_ids(model):
    with pytest.raises(ValueError, match="zero length"):
        gen(model, torch.zeros(2, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        gen(model, torch.zeros(0, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="integer"):
        gen(model, torch.zeros(1, 3), max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        gen(model, torch.tensor([[5, 10_000]]), max_new_tokens=2)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="integer"):
        SamplingParams(max_new_tokens=2.5)


def _tiny(config_cls, **kw):
    torch.manual_seed(0)
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, **kw)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_softcapping_architecture_runs_as_stock():
    """Gemma 2's attention and final-logit softcapping, once refused, now give stock's tokens."""
    gemma2 = _tiny(transformers.Gemma2Config, head_dim=16)
    expected = gemma2.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, batching="off")
    assert torch.equal(gemma2.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, batching="sync"), expected)


def test_an_alibi_falcon_is_refused():
    falcon = _tiny(transformers.FalconConfig, alibi=True)
    with pytest.raises(ValueError, match="ALiBi"):
        falcon.generate(torch.tensor([[5, 6]]), max_new_tokens=2, batching="sync")


def test_an_untested_family_runs_after_its_parity_check():
    olmo = _tiny(transformers.OlmoConfig)
    expected = olmo.generate(torch.tensor([[5, 6]]), max_new_tokens=4, batching="off")
    assert torch.equal(olmo.generate(torch.tensor([[5, 6]]), max_new_tokens=4, batching="sync"), expected)


def test_encoder_decoder_is_refused():
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0))
    with pytest.raises(ValueError, match="encoder-decoder"):
        Engine(t5)


def test_model_bypassing_the_attention_interface_is_refused(model, monkeypatch):
    """A layer that never calls the registered attention would silently skip the paged cache. The
    last layer's: the measured K/V layout must count it against the config's layers (it writes no
    K/V, so a layout of the layers that do would look whole)."""
    import copy

    m = copy.deepcopy(model)
    attn = m.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None))
    # Refused by the layout probe (a fresh preparation) or by the step's count of attention calls
    # inside the parity probe (a layout already measured), never run.
    with pytest.raises((ValueError, RuntimeError), match=r"only layers \[0\] of its 2 write|1 of its 2 layers"):
        gen(m, torch.tensor([[5, 6]]), max_new_tokens=2)


class CriterionFailsFor(StoppingCriteria):
    """Raises for the rows that start with `prompt` only."""

    def __init__(self, prompt):
        self.prompt = prompt

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids[0, :len(self.prompt)].tolist() == self.prompt:
            raise ValueError("user code failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class ProcessorFailsFor(CriterionFailsFor, LogitsProcessor):
    def __call__(self, input_ids, scores):
        super().__call__(input_ids, scores)
        return scores


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fault", ["criterion", "processor"])
def test_a_request_failing_in_its_own_code_is_named_and_no_page_is_kept(model, mode, fault):
    """B's criterion (or processor) raises in the step where A ends: the call raises B's error,
    noted with B's id alone; A keeps its token; C, still running, is aborted; every page is free."""
    engine = Engine(model, BatchingConfig(mode=mode))
    a_prompt, b_prompt, c_prompt = random_prompts(3, 5, 12, seed=90)
    hook = dict(stopping_criteria=StoppingCriteriaList([CriterionFailsFor(b_prompt)])) if fault == "criterion" \
        else dict(logits_processor=LogitsProcessorList([ProcessorFailsFor(b_prompt)]))
    a = engine.make_request(a_prompt, SamplingParams(max_new_tokens=1))
    b = engine.make_request(b_prompt, SamplingParams(max_new_tokens=8), **hook)
    c = engine.make_request(c_prompt, SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="user code failed") as caught:
        engine.run([a, b, c])
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert b.request_id in notes and a.request_id not in notes and c.request_id not in notes
    assert b.error is caught.value
    expected = generated_rows(stock_generate(model, [a_prompt], max_new_tokens=1), len(a_prompt), pad=0, eos=())
    assert a.finish_reason.value == "length" and a.output_token_ids == expected[0]
    assert not engine.scheduler.has_work and engine.allocator.num_free == engine.allocator.num_pages
    assert [o.output_token_ids for o in engine.generate([c_prompt], max_new_tokens=8)] == \
        generated_rows(stock_generate(model, [c_prompt], max_new_tokens=8), len(c_prompt), pad=0, eos=())


def test_generate_raises_a_failing_processor_s_error_as_stock_does(model):
    ids = torch.tensor([[5, 6, 7]])
    processors = LogitsProcessorList([ProcessorFailsFor([5, 6])])
    for batching in ("off", "sync", "async"):
        with pytest.raises(ValueError, match="user code failed"):
            model.generate(ids, max_new_tokens=3, logits_processor=processors, batching=batching)


def test_a_held_engine_refuses_a_model_changed_under_it():
    """A weight given new storage, or a dtype move, after an Engine was built (its fused weights and
    pools are the old ones): refused with the remedy, never stale weights or a torch error mid-step.
    An update in place runs, with the new weights; a new Engine takes the moved model."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 2, 9, seed=4)
    engine = Engine(model, BatchingConfig(mode="sync", fuse_projections=True))
    v_proj = model.model.layers[0].self_attn.v_proj
    with torch.no_grad():
        v_proj.weight.mul_(1.5)  # in place: the engine's fused weight sees it
    expected = stock_generate(model, prompts, max_new_tokens=5, pad_token_id=0)
    outs = engine.generate(prompts, max_new_tokens=5)
    assert [o.output_token_ids for o in outs] == generated_rows(expected, max(map(len, prompts)), 0, ())
    old = v_proj.weight.data
    v_proj.weight.data = torch.randn_like(old)
    with pytest.raises(RuntimeError, match="changed since this Engine was built"):
        engine.generate(prompts, max_new_tokens=5)
    with pytest.raises(RuntimeError, match="changed since this Engine was built"):
        engine.start()
    v_proj.weight.data = old
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="a dtype or device move"):
        engine.generate(prompts, max_new_tokens=5)
    model.to(torch.float32)  # new storages again (to() copies): still not the engine's
    with pytest.raises(RuntimeError, match="changed since this Engine was built"):
        engine.generate(prompts, max_new_tokens=5)
    engine.close()
    with Engine(model, BatchingConfig(mode="sync", fuse_projections=True)) as fresh:
        assert [o.output_token_ids for o in fresh.generate(prompts, max_new_tokens=5)] == \
            generated_rows(expected, max(map(len, prompts)), 0, ())


@pytest.mark.parametrize("fuse", [False, True])
def test_a_closed_engine_says_so(model, fuse):
    """close() leaves the engine unusable: generate(), start() and add_request() say it was closed
    (not a run on a model given back, nor a misleading "the model changed")."""
    prompts = random_prompts(2, 3, 8, seed=5)
    engine = Engine(model, BatchingConfig(mode="sync", fuse_projections=fuse))
    engine.generate(prompts, max_new_tokens=2)
    engine.close()
    engine.close()  # (idempotent)
    for use in (lambda: engine.generate(prompts, max_new_tokens=2), engine.start,
                lambda: engine.add_request(prompts[0], max_new_tokens=2),
                lambda: engine.make_request(prompts[0], SamplingParams(max_new_tokens=2))):
        with pytest.raises(RuntimeError, match="this Engine was closed|start\\(\\) the engine"):
            use()
    with pytest.raises(RuntimeError, match="this Engine was closed"):
        engine.start()


def test_one_dimensional_input_ids_are_refused_as_stock_does(model):
    """Stock generate fails on a 1-D input_ids (an IndexError); the engine's paths say what to pass."""
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\], got shape \(3,\) \(one prompt: "
                                         r"input_ids\[None\]\)"):
        gen(model, torch.tensor([5, 6, 7]), max_new_tokens=2)


def _rope_model(kind: str):
    params = {"rope_type": kind, "rope_theta": 10000.0}
    if kind == "longrope":  # Phi-3-128k's form: short factors up to 48 positions, long ones past
        params.update(short_factor=[1.0] * 8, long_factor=[3.0] * 8)
        config = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=192,
                                         original_max_position_embeddings=48, pad_token_id=0, rope_parameters=params)
    else:
        params["factor"] = 4.0
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                          rope_parameters=params)
    torch.manual_seed(0)
    return scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_rope_that_switches_with_the_longest_sequence_is_kept_below_its_switch(kind):
    """Dynamic NTK and LongRoPE pick a forward's frequencies from its largest position: past their
    original length stock's tokens depend on the batch and on when the cache was filled (Phi-3
    refills it at the crossing), so such requests are refused up front; below it every token is
    stock's, whatever the chunking."""
    model = _rope_model(kind)
    prompts = random_prompts(3, 20, 38, seed=2)
    ids, mask = left_pad(prompts)
    new = 48 - ids.shape[1] + 1  # the last fed position is 47: short factors throughout
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    for config in (BatchingConfig(), BatchingConfig(max_batch_tokens=16, page_size=4)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                             batching="async", batching_config=config)
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=rf"runs past 48 positions, where the model's '{kind}' RoPE"):
        model.generate(ids, attention_mask=mask, max_new_tokens=new + 1, batching="sync")
    longer = torch.randint(3, 200, (1, 50), generator=torch.Generator().manual_seed(3))  # past the 48 positions:
    with pytest.raises(ValueError, match=rf"where the model's '{kind}' RoPE"):  # the switch is the reason
        model.generate(longer, max_new_tokens=2, batching="sync")


def test_a_hybrid_model_is_refused_naming_only_its_other_layers():
    from model_configs import tiny_model as sweep_model

    model, why = sweep_model("bamba")
    assert model is not None, why
    with pytest.raises(ValueError, match=r"other than full or sliding-window attention \(\['linear_attention'\]\)"):
        Engine(model)


def test_cross_attention_layers_in_the_middle_are_refused_as_such():
    """Llama 3.2 Vision's text model: its cross-attention layers write no K/V without an image."""
    config = transformers.MllamaTextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
                                           pad_token_id=0)
    model = transformers.MllamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"only layers \[0, 2\] of its 3 write a K/V cache of their own \(the others write none"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, batching="sync")
