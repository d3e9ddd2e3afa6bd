"""What users load on top of a model family: adapters, quantized weights, cache options, compiled
forwards, loading options. Each gives stock generate's tokens (greedy, fp32, tiny random Llama,
both loops, projections fused and not) or a ValueError that names it; never other tokens, never
an internal error. One test per row of docs/models.md's model stack table.

The quantization libraries are optional: a test whose library is not installed is skipped with
its name (the `test` extra installs them all).
"""

import copy
import logging

import pytest
import torch
import transformers
from models import COMMON, hqq_in_place, left_pad, random_prompts, scaled

import hf_async_cb
from hf_async_cb import BatchingConfig
from hf_async_cb.engine import parity
from hf_async_cb.generate import runtime as runtime_module
from hf_async_cb.model.fusion import fuse_projections
from hf_async_cb.model.numerics_key import numerics_key
from hf_async_cb.model.prepared import signature

MODES = ("sync", "async")
FUSED = (False, True)  # on the CPU fusion is off by default: forced on to run the path CUDA takes
EVERY_RUN = tuple((mode, fuse) for fuse in FUSED for mode in MODES)
# Where no projection group can fuse (every one quantized or adapted), a fused engine runs the
# unfused path: one fused run shows that its preparation leaves them alone.
UNFUSABLE_RUNS = (("sync", False), ("async", False), ("async", True))


def _llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return scaled(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval())


def _greedy(model, batching, batching_config=None, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(random_prompts(4, 5, 20, seed=7))
    if batching_config is not None:
        kwargs["batching_config"] = batching_config
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None,
                          pad_token_id=0, batching=batching, **kwargs)


def _assert_exact(model, runs=EVERY_RUN, **kwargs) -> None:
    """Each (loop, fused) run gives stock's tokens; the model is stock again afterwards."""
    expected = _greedy(model, "off", **kwargs)
    for mode, fuse in runs:
        got = _greedy(model, mode, batching_config=BatchingConfig(fuse_projections=fuse), **kwargs)
        assert torch.equal(got, expected), (mode, fuse)
    hf_async_cb.release(model)
    assert torch.equal(_greedy(model, "off", **kwargs), expected)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    """The tiny Llama on disk, for the loading paths (from_pretrained with a quantization config)."""
    path = tmp_path_factory.mktemp("llama")
    _llama().save_pretrained(path)
    return str(path)


# --- PEFT adapters ---------------------------------------------------------------------------------------

def _lora(**overrides):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"], lora_dropout=0.0,
                    init_lora_weights=False)  # random B: the adapter changes the tokens
    return peft.LoraConfig(**{**settings, **overrides})


def test_lora_adapters_switched_disabled_and_merged_are_exact():
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = _llama()
    base_tokens = _greedy(base, "off")
    torch.manual_seed(1)
    model = peft.get_peft_model(base, _lora())
    model.add_adapter("other", _lora(r=2))
    model.eval()
    for adapter in ("other", "default"):
        model.set_adapter(adapter)
        assert not torch.equal(_greedy(model, "off"), base_tokens)  # the adapter matters
        _assert_exact(model, UNFUSABLE_RUNS)  # (q and gate adapted: no group fuses)
    with model.disable_adapter():
        _assert_exact(model, UNFUSABLE_RUNS)
    merged = model.merge_and_unload()
    _assert_exact(merged)


def test_a_held_engine_on_a_peft_wrapper_says_to_pass_the_base_model():
    """Engine(peft_model): the wrapper is not a generative model; the error says what works (the base
    model, which holds the adapter layers), and that runs the adapter exactly."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(1)
    model = peft.get_peft_model(_llama(), _lora()).eval()
    with pytest.raises(ValueError, match=r"PEFT wrapper.*model.get_base_model\(\)"):
        hf_async_cb.Engine(model)
    prompt = [3, 14, 15, 92, 65]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    with hf_async_cb.Engine(model.get_base_model(), hf_async_cb.BatchingConfig(mode="sync")) as engine:
        got = engine.generate([prompt], max_new_tokens=4, eos_token_ids=())[0].output_token_ids
    assert got == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["lora", "prefix tuning"])
def test_the_runtime_functions_reach_a_peft_wrappers_runtime(kind):
    """PEFT's generate runs on its base model, whose generate runtime holds the pool: release(),
    clear_prefix_cache(), prefix_cache_stats() and runtime_info() given the wrapper reach it (release
    frees it, as a user freeing memory for training expects)."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(1)
    config = _lora() if kind == "lora" else peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(_llama(), config).eval()
    ids = torch.tensor([list(range(3, 40))])
    assert hf_async_cb.release(model) is False and hf_async_cb.prefix_cache_stats(model) is None
    for _ in range(2):
        model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None, batching="sync")
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] >= 32  # (the second call took the first's pages)
    assert hf_async_cb.runtime_info(model) is not None
    assert hf_async_cb.clear_prefix_cache(model) is True
    assert hf_async_cb.prefix_cache_stats(model)["clears"] >= 1
    assert hf_async_cb.release(model) is True
    assert not [m for m in model.modules() if m in runtime_module._RUNTIMES]
    assert hf_async_cb.release(model) is False


def test_lora_added_after_a_fused_engine_existed_is_exact():
    peft = pytest.importorskip("peft", reason="peft is not installed")
    model = _llama()
    expected_base = _greedy(model, "off")
    config = BatchingConfig(fuse_projections=True)
    assert torch.equal(_greedy(model, "sync", batching_config=config), expected_base)
    torch.manual_seed(2)
    adapted = peft.get_peft_model(model, _lora()).eval()
    expected = _greedy(adapted, "off")
    assert not torch.equal(expected, expected_base)
    for mode in MODES:
        assert torch.equal(_greedy(adapted, mode, batching_config=config), expected)
    hf_async_cb.release(model)


def _embedding_adapter(kind: str):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    if kind == "lora":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens"], init_lora_weights=False)
    if kind == "lora+tokens":
        return _lora(trainable_token_indices=[27, 95, 187])  # (tokens of the prompts)
    return peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[27, 95, 187])


@pytest.mark.parametrize("kind", ["lora", "lora+tokens", "tokens"])
def test_adapters_on_the_input_embeddings_are_exact(kind):
    """PEFT wraps the input embeddings (a LoRA on them, trainable tokens): the wrapper has no
    num_embeddings of its own, and its forward is what the prompt's and each step's tokens go
    through."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = _llama()
    base_tokens = _greedy(base, "off")
    torch.manual_seed(4)
    model = peft.get_peft_model(base, _embedding_adapter(kind)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "trainable_tokens" in name:  # (they start as the base rows: moved, they change the tokens)
                p.add_(torch.randn_like(p))
    assert not torch.equal(_greedy(model, "off"), base_tokens)
    _assert_exact(model, EVERY_RUN if kind != "lora+tokens" else UNFUSABLE_RUNS)


def test_trainable_tokens_on_tied_embeddings_are_exact():
    """`trainable_token_indices` on a model whose head is tied to its input embeddings (Gemma,
    Llama-3.2-1B, Qwen2-0.5B): PEFT wraps the head too, in a TrainableTokensWrapper that has no
    out_features of its own; reading them for the logits' width crashed every call."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    base = scaled(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)).eval())
    base_tokens = _greedy(base, "off")
    torch.manual_seed(4)
    model = peft.get_peft_model(base, _lora(trainable_token_indices=[27, 95, 187])).eval()
    assert type(base.get_output_embeddings()).__name__ == "TrainableTokensWrapper"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "trainable_tokens" in name:
                p.add_(torch.randn_like(p))
    assert not torch.equal(_greedy(model, "off"), base_tokens)
    _assert_exact(model, UNFUSABLE_RUNS)


_TUNERS = {  # PEFT's other weight tuners, each on some of the projections
    "dora": lambda peft: _lora(use_dora=True),
    "rslora+bias": lambda peft: _lora(use_rslora=True, lora_bias=True),
    "ia3": lambda peft: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                       feedforward_modules=["down_proj"]),
    "loha": lambda peft: peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "lokr": lambda peft: peft.LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "up_proj"]),
    "adalora": lambda peft: peft.AdaLoraConfig(r=4, target_modules=["q_proj", "v_proj"], total_step=10),
    "vera": lambda peft: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "oft": lambda peft: peft.OFTConfig(r=4, oft_block_size=0, target_modules=["q_proj", "v_proj"]),
    "boft": lambda peft: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj", "v_proj"]),
    "ln_tuning": lambda peft: peft.LNTuningConfig(target_modules=["input_layernorm", "post_attention_layernorm"]),
    "adaption_prompt": lambda peft: peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=2, task_type="CAUSAL_LM"),
}


@pytest.mark.parametrize("kind", sorted(_TUNERS))
def test_other_peft_tuners_are_exact(kind):
    """PEFT's other tuners run their own layers' forward (AdaptionPrompt wraps the attention modules
    and attends to its own prompt beside the cache), with adapter weights that change the tokens."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = _llama()
    base_tokens = _greedy(base, "off")
    torch.manual_seed(6)
    model = peft.get_peft_model(base, _TUNERS[kind](peft)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # (many start as the identity; AdaptionPrompt's gate at 0)
                p.add_(torch.randn_like(p))
    assert not torch.equal(_greedy(model, "off"), base_tokens)
    _assert_exact(model, EVERY_RUN)


def test_qlora_on_bitsandbytes_4bit_is_exact(saved_llama):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, quantization_config=quantization,
                                                              device_map="cpu", dtype=torch.float32)
    torch.manual_seed(3)
    _assert_exact(peft.get_peft_model(model, _lora()).eval(), UNFUSABLE_RUNS)


def test_a_mixed_adapter_batch_is_refused():
    """adapter_names= (one adapter per row), Poly's task_ids= ride on forward pre-hooks that index the
    batch's rows, which the engine packs into one: refused, before any tokens, naming the hooks."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    model = peft.get_peft_model(_llama(), _lora())
    model.add_adapter("other", _lora(r=2))
    model.eval()
    for mode in MODES:
        with pytest.raises(ValueError, match=r"adapter_names.*forward pre-hooks of PEFT's lora"):
            _greedy(model, mode, adapter_names=["default", "other", "default", "other"])
    torch.manual_seed(5)
    poly = peft.get_peft_model(_llama(), peft.PolyConfig(target_modules=["q_proj", "v_proj"], n_tasks=3, n_skills=2,
                                                         r=4, task_type="CAUSAL_LM")).eval()
    for rows in (1, 4):  # (Poly's task ids per row: one row crashed the parity probe, four its K/V measurement)
        ids, mask = left_pad(random_prompts(rows, 5, 12, seed=3))
        for mode in MODES:
            with pytest.raises(ValueError, match=r"task_ids.*forward pre-hooks of PEFT's poly"):
                poly.generate(input_ids=ids, attention_mask=mask, task_ids=torch.arange(rows) % 3, max_new_tokens=3,
                              do_sample=False, pad_token_id=0, batching=mode)


def _prompt_learning(method):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    return {
        "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "p_tuning": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                     encoder_hidden_size=32),
    }[method]()


@torch.no_grad()
def _virtual_token_oracle(base, virtual, ids, mask, new):
    """PEFT prompt tuning's tokens, one row at a time with the base model and its own cache: the
    virtual tokens' embeddings before the row's, positions counted from the cache as PEFT's forward
    counts them (it drops generate's position ids), the row's left padding included. (Stock PEFT
    generate re-injects the virtual tokens at every decode step on transformers 5.24, whose cache
    argument it no longer finds, so it cannot be the oracle there.)"""
    rows = []
    n = virtual.shape[0]
    for row, keep in zip(ids, mask.bool()):
        tokens, pads = row[keep], int((~keep).sum())
        embeds = torch.cat([virtual, base.get_input_embeddings()(tokens)])[None]
        positions = torch.cat([torch.arange(n), torch.arange(n + pads, n + pads + len(tokens))])[None]
        cache = transformers.DynamicCache()
        out = base(inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True)
        generated = []
        for step in range(new):
            token = out.logits[0, -1].argmax()
            generated.append(int(token))
            position = torch.tensor([[n + pads + len(tokens) + step]])
            out = base(input_ids=token.view(1, 1), position_ids=position, past_key_values=cache, use_cache=True)
        rows.append(row.tolist() + generated)
    return torch.tensor(rows)


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning"])
def test_peft_prompt_tuning_runs_as_prompt_embeddings(method):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = _llama()
    model = peft.get_peft_model(base, _prompt_learning(method)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "prompt_encoder" in name:
                p.add_(torch.randn_like(p))  # virtual tokens far from any token's embedding
    ids, mask = left_pad(random_prompts(4, 5, 20, seed=7))
    expected = _virtual_token_oracle(base, model.get_prompt(batch_size=1)[0], ids, mask, 8)
    assert not torch.equal(expected, _greedy(base, "off"))  # the adapter matters
    for mode in MODES:
        for config in (None, BatchingConfig(max_batch_tokens=6, page_size=4)):  # chunks inside the virtual tokens
            assert torch.equal(_greedy(model, mode, batching_config=config), expected), (mode, config)
    with pytest.raises(ValueError, match=f"PEFT {method.upper()}: stock generate's logits processors"):
        _greedy(model, "sync", repetition_penalty=1.2)
    hf_async_cb.release(base)


def test_peft_prompt_learning_of_other_methods_is_refused_by_name_before_any_work():
    """Multitask prompt tuning (task ids of its own); prefix tuning runs: tests/test_prefix_tuning.py."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = _llama()
    config = peft.MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_tasks=2)
    model = peft.get_peft_model(base, config).eval()
    task_ids = torch.zeros(4, dtype=torch.long)
    expected = _greedy(model, "off", task_ids=task_ids)
    for mode in MODES:
        with pytest.raises(ValueError, match=r"cannot run PEFT prompt learning \(MULTITASK_PROMPT_TUNING, 4 virtual"):
            _greedy(model, mode, task_ids=task_ids)
    assert runtime_module._RUNTIMES.get(base) is None  # refused before the engine was built
    assert torch.equal(_greedy(model, "off", task_ids=task_ids), expected)
    assert torch.equal(_greedy(base, "sync"), _greedy(base, "off"))  # the base model alone still runs


def test_an_input_rewriter_set_on_the_instance_is_refused():
    model = _llama()
    original = model.prepare_inputs_for_generation
    model.prepare_inputs_for_generation = lambda *args, **kwargs: original(*args, **kwargs)
    with pytest.raises(ValueError, match=r"prepare_inputs_for_generation is replaced on this instance"):
        _greedy(model, "sync")
    model.prepare_inputs_for_generation = original  # the model's own method, bound: not a replacement
    assert torch.equal(_greedy(model, "sync"), _greedy(model, "off"))


# --- quantized weights ------------------------------------------------------------------------------------

def _bitsandbytes(path, **settings):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.BitsAndBytesConfig(**settings), device_map="cpu", dtype=torch.float32)


def _quanto(path, weights):
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.QuantoConfig(weights=weights), device_map="cpu", dtype=torch.float32)


def _hqq(path):
    """HQQ 4-bit (transformers 5.24 has no HqqConfig loading path: HQQ's own HQQLinear, put in place)."""
    quantize = pytest.importorskip("hqq.core.quantize", reason="hqq is not installed")
    return hqq_in_place(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), quantize)


def _torchao(path, config_name, **settings):
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    config = getattr(quantization, config_name)(**settings)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.TorchAoConfig(config), device_map="cpu", dtype=torch.float32)


def _torchao_after_loading(path, config_name, **settings):
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    quantization.quantize_(model, getattr(quantization, config_name)(**settings))
    return model


QUANTIZED = {
    "bitsandbytes-int8": lambda path: _bitsandbytes(path, load_in_8bit=True),
    "bitsandbytes-fp4": lambda path: _bitsandbytes(path, load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    "bitsandbytes-nf4": lambda path: _bitsandbytes(path, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.float32),
    "quanto-int8": lambda path: _quanto(path, "int8"),
    "quanto-int4": lambda path: _quanto(path, "int4"),
    "hqq-4bit": _hqq,
    "torchao-int8-weight-only": lambda path: _torchao(path, "Int8WeightOnlyConfig"),
    "torchao-float8-weight-only": lambda path: _torchao_after_loading(path, "Float8WeightOnlyConfig"),
    "torchao-intx-weight-only": lambda path: _torchao_after_loading(path, "IntxWeightOnlyConfig"),
    "torchao-int8-activation-intx-weight": lambda path: _torchao_after_loading(
        path, "Int8DynamicActivationIntxWeightConfig"),
}


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_quantized_weights_are_exact_and_never_fused(saved_llama, method):
    """Quantized modules and tensor-subclass weights run through their own forward: fusion leaves
    their groups alone (no crash on a weight with no storage of its own), tokens are stock's."""
    model = QUANTIZED[method](saved_llama).eval()
    signature(model)  # reads every weight's storage without touching a subclass's
    with fuse_projections(model) as fused:
        assert fused.num_groups == 0  # every projection is quantized
    _assert_exact(model, UNFUSABLE_RUNS)


def _k_proj(model):
    return model.model.layers[0].self_attn.k_proj


# Writes inside a quantized weight that bump no counter of the weight the model lists (its inner data,
# its scales, the objects it carries) or that only move its rows (which a plain sum of its bits misses).
INNER_WRITES = {
    "bitsandbytes-nf4 absmax": ("bitsandbytes-nf4", lambda m: _k_proj(m).weight.quant_state.absmax.mul_(-1.5)),
    "bitsandbytes-nf4 rows flipped": ("bitsandbytes-nf4", lambda m: _k_proj(m).weight.data.copy_(
        _k_proj(m).weight.data.flip(0))),
    "bitsandbytes-int8 rows flipped": ("bitsandbytes-int8", lambda m: _k_proj(m).weight.data.copy_(
        _k_proj(m).weight.data.flip(0))),
    "quanto-int8 data": ("quanto-int8", lambda m: _k_proj(m).weight._data.copy_(_k_proj(m).weight._data.flip(0))),
    "hqq-4bit meta scale": ("hqq-4bit", lambda m: _k_proj(m).meta["scale"].mul_(-1.5)),
    "torchao-int8 scale": ("torchao-int8-weight-only", lambda m: _k_proj(m).weight.scale.mul_(-1.5)),
    "torchao-int8 qdata rows flipped": ("torchao-int8-weight-only", lambda m: _k_proj(m).weight.qdata.copy_(
        _k_proj(m).weight.qdata.flip(0))),
}


@pytest.mark.parametrize("write", list(INNER_WRITES))
def test_a_write_inside_a_quantized_weight_is_seen_by_the_next_call(saved_llama, write):
    """The prefix cache keeps pages across calls; a write inside a quantized weight (torchao's qdata
    and scale, bitsandbytes' quant_state, HQQ's meta dict, quanto's data) or one that only moves a
    weight's rows changes no counter a plain weight list shows, and left the old K/V served: the
    next call now computes them again, with stock's tokens for the model as it is now."""
    method, change = INNER_WRITES[write]
    model = QUANTIZED[method](saved_llama).eval()
    shared = random_prompts(1, 24, 24, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(3, 2, 5, seed=4)]
    ids, mask = left_pad(prompts)
    config = BatchingConfig(page_size=8)

    def run(batching):
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None,
                              pad_token_id=0, batching=batching, batching_config=config)

    try:
        before = run("off")
        assert torch.equal(run("sync"), before)  # (its pages cached)
        with torch.no_grad():
            change(model)
        expected = run("off")
        assert not torch.equal(expected, before)  # (the write changes the tokens: stale pages would show)
        assert torch.equal(run("sync"), expected)
        assert torch.equal(run("async"), expected)
        assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] > 0  # (the cache serves, just not stale pages)
    finally:
        hf_async_cb.release(model)


def test_quanto_packed_weights_are_known_to_escape_cuda_graphs(saved_llama):
    """quanto's 2/4-bit weights run CUDA kernels on the legacy stream, which a CUDA graph does not
    record (on an H200 its graphs gave other tokens): the engine runs such models eagerly there.
    Its 8-bit weights, and the other libraries', are captured as they are."""
    from hf_async_cb.model.graph_safety import graph_unsafe_weights, launches_off_stream

    int4, int8 = _quanto(saved_llama, "int4"), _quanto(saved_llama, "int8")
    projection = "model.layers.0.self_attn.q_proj.weight"
    assert launches_off_stream(dict(int4.named_parameters())[projection])
    assert not any(launches_off_stream(p) for p in int8.parameters())
    assert graph_unsafe_weights(int4) == []  # on the CPU: no graphs to escape


def test_fusion_skips_only_the_quantized_groups():
    """torchao on the MLPs alone: the q/k/v groups still fuse, the gate/up ones are left as they are."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model = _llama()
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(),
                           filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and ".mlp." in name)
    with fuse_projections(model) as fused:
        assert fused.counts == {"qkv": 2, "gate_up": 0}
    _assert_exact(model)


def test_int8_dynamic_activation_is_refused_with_its_difference():
    """Activation scales computed per forward: stock's own logits for a prompt differ from those for
    its prefix, and the engine's packed steps cannot reproduce them; the parity check measures it."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model = _llama()
    quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig())
    for mode in MODES:
        with pytest.raises(ValueError, match=r"differ from its own forward by [0-9.e-]+ of the largest logit"):
            _greedy(model, mode)


def test_per_tensor_activation_scales_are_refused_before_any_work():
    """One activation scale for the whole input: stock's own tokens for a prompt depend on the other
    rows of its batch, so no batching reproduces them (Float8DynamicActivationFloat8WeightConfig's
    default on CUDA; int8 here, the CPU runs it)."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    from torchao.quantization.granularity import PerTensor

    model = _llama()
    quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig(granularity=PerTensor()))
    ids, mask = left_pad(random_prompts(4, 5, 20, seed=7))
    batched = _greedy(model, "off")[:, -8:]
    alone = [model.generate(ids[i:i + 1, int(mask[i].argmax()):], do_sample=False, max_new_tokens=8,
                            eos_token_id=None, pad_token_id=0, batching="off")[0, -8:] for i in range(4)]
    assert not all(torch.equal(row, one) for row, one in zip(batched, alone))  # stock depends on the batch
    for mode in MODES:
        with pytest.raises(ValueError, match=r"one scale per tensor .* PerTensor"):
            _greedy(model, mode)
    assert runtime_module._RUNTIMES.get(model) is None


def test_a_verdict_is_never_borrowed_across_quantize_(monkeypatch):
    """torchao's quantize_ after loading leaves the class, config and dtype as they were: the verdict
    of the plain model must not run the quantized one (other tokens), nor the quantized one's refuse
    the plain one; also when one model object is quantized in place between calls."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")

    def quantized(model):
        quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig())
        return model

    monkeypatch.setattr(parity, "_VERDICTS", {})
    plain = _llama()
    assert torch.equal(_greedy(plain, "sync"), _greedy(plain, "off"))
    with pytest.raises(ValueError, match="differ from its own forward"):
        _greedy(quantized(_llama()), "sync")
    with pytest.raises(ValueError, match="differ from its own forward"):
        _greedy(quantized(plain), "async")  # the same object, quantized in place after a call

    monkeypatch.setattr(parity, "_VERDICTS", {})
    with pytest.raises(ValueError, match="differ from its own forward"):
        _greedy(quantized(_llama()), "sync")
    other = _llama()
    assert torch.equal(_greedy(other, "async"), _greedy(other, "off"))


def test_the_numerics_key_tells_apart_what_changes_numerics():
    """Identical models share a key (one parity check for all); a quantized form, its layout, an
    adapter, the active adapter, a disabled or merged one, and a compiled wrapper each change it."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    plain = numerics_key(_llama())
    assert numerics_key(_llama(seed=5)) == plain == numerics_key(copy.deepcopy(_llama()))
    keys = [plain]
    for config in (quantization.Int8WeightOnlyConfig(), quantization.Int8DynamicActivationInt8WeightConfig(),
                   quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4),
                   quantization.IntxWeightOnlyConfig(weight_dtype=torch.int2)):
        model = _llama()
        quantization.quantize_(model, config)
        keys.append(numerics_key(model))
    model = peft.get_peft_model(_llama(), _lora())
    model.add_adapter("other", _lora(r=2))
    base = model.get_base_model()
    keys.append(numerics_key(base))
    model.set_adapter("other")
    keys.append(numerics_key(base))
    with model.disable_adapter():
        keys.append(numerics_key(base))
    model.base_model.merge_adapter()
    keys.append(numerics_key(base))
    compiled = _llama()
    compiled.compile(backend="eager")
    keys.append(numerics_key(compiled))
    assert len(set(keys)) == len(keys)


# --- cache_implementation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["dynamic", "static", "sliding_window", "hybrid"])
def test_layout_only_cache_options_are_exact(option):
    model = _llama()
    _assert_exact(model, (("sync", False), ("async", True)), cache_implementation=option)
    model.generation_config.cache_implementation = option  # the same, read from the model's own config
    _assert_exact(model, (("async", False),))


@pytest.mark.parametrize("option", ["quantized", "offloaded", "offloaded_static", "offloaded_hybrid"])
@pytest.mark.parametrize("where", ["argument", "generation_config", "model.generation_config"])
def test_cache_options_that_change_numerics_or_placement_are_refused_by_name(option, where):
    model = _llama()
    ids, mask = left_pad(random_prompts(2, 5, 9, seed=1))
    kwargs = dict(max_new_tokens=3, do_sample=False)
    if where == "argument":
        kwargs["cache_implementation"] = option
    elif where == "generation_config":
        kwargs = dict(generation_config=transformers.GenerationConfig(cache_implementation=option, **kwargs))
    else:
        model.generation_config.cache_implementation = option
    reason = "quantized" if option == "quantized" else "CPU memory"
    for mode in MODES:
        with pytest.raises(ValueError, match=rf"does not run cache_implementation='{option}': .*{reason}"):
            model.generate(ids, attention_mask=mask, batching=mode, **kwargs)
    assert runtime_module._RUNTIMES.get(model) is None


def test_paged_as_an_argument_asks_for_two_engines_and_is_refused():
    model = _llama()
    with pytest.raises(ValueError, match=r"cache_implementation='paged'.*choose one"):
        _greedy(model, "sync", cache_implementation="paged")
    model.generation_config.cache_implementation = "paged"  # on a GenerationConfig: stock's dynamic cache
    _assert_exact(model, (("sync", False), ("async", False)))


# --- compiled forwards ------------------------------------------------------------------------------------

def _compile_three_ways(model, backend):
    return {
        "module.compile()": lambda: model.compile(backend=backend),
        "forward = torch.compile(forward)": lambda: setattr(model, "forward",
                                                            torch.compile(model.forward, backend=backend)),
        "torch.compile(layer)": lambda: model.model.layers.__setitem__(
            0, torch.compile(model.model.layers[0], backend=backend)),
    }


@pytest.mark.parametrize("how", ["module.compile()", "forward = torch.compile(forward)", "torch.compile(layer)"])
def test_a_compiled_model_runs_the_engines_own_path(how, caplog):
    """The engine sets the compiled wrappers aside (no dynamo frame, no compile), says so once,
    gives stock's tokens and leaves the wrappers in place for stock generate."""
    import torch._dynamo

    compiles = []

    def counting_backend(graph, inputs):
        compiles.append(graph)
        return graph.forward

    model = _llama()
    expected = _greedy(model, "off")
    _compile_three_ways(model, counting_backend)[how]()
    state = (model._compiled_call_impl, vars(model).get("forward"), model.model.layers[0])
    frames = dict(torch._dynamo.utils.counters["frames"])
    with caplog.at_level(logging.INFO, logger="hf_async_cb.model.compiled"):
        for fuse in FUSED:
            for mode in MODES:
                assert torch.equal(_greedy(model, mode, batching_config=BatchingConfig(fuse_projections=fuse)),
                                   expected)
            hf_async_cb.release(model)
    assert not compiles and dict(torch._dynamo.utils.counters["frames"]) == frames
    said = [r for r in caplog.records if "compiled forward" in r.getMessage()]
    assert len(said) == 1 and "uncompiled path" in said[0].getMessage()
    assert (model._compiled_call_impl, vars(model).get("forward"), model.model.layers[0]) == state


# --- loading options --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(device_map="cpu"), dict(device_map="auto"), dict(low_cpu_mem_usage=True),
                                     dict(dtype=torch.float16)], ids=["device_map=cpu", "device_map=auto",
                                                                      "low_cpu_mem_usage", "float16"])
def test_loading_options_are_exact(saved_llama, options):
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, **{"dtype": torch.float32, **options})
    _assert_exact(model.eval())


@pytest.mark.parametrize("kwargs, named", [
    (lambda: dict(past_key_values=transformers.DynamicCache()), "past_key_values"),
    (lambda: dict(assistant_model=_llama(seed=1)), "assistant_model"),
    (lambda: dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
], ids=["past_key_values", "assistant_model", "prompt_lookup_num_tokens"])
def test_other_generation_machinery_is_refused_by_name(kwargs, named):
    model = _llama()
    for mode in MODES:
        with pytest.raises(ValueError, match=named):
            _greedy(model, mode, **kwargs())
