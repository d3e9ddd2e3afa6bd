"""Engine.generate(engine_seed=...) alone: the call's engine seed, as its docstring says (it was checked, then dropped)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.sampling.sampler import derive_seed


def _tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def test_engine_seed_without_seed_indices_is_not_silently_ignored():
    # Engine.generate's docstring: `engine_seed` is "that call's engine seed, so that sampled requests
    # without a seed of their own get the seeds one Engine gives the whole call (request i of it:
    # derive_seed(engine seed, i))". Without seed_indices it was dropped and a seed drawn from torch's
    # generator instead.
    engine = Engine(_tiny_model(), BatchingConfig(mode="sync"))
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7]]
        explicit = engine.generate(prompts, max_new_tokens=6, do_sample=True, eos_token_ids=(),
                                   seed_indices=[0, 1], engine_seed=5)
        torch.manual_seed(123)  # a drawn seed would come from here
        got = engine.generate(prompts, max_new_tokens=6, do_sample=True, eos_token_ids=(), engine_seed=5)
        for i, (g, e) in enumerate(zip(got, explicit)):
            own = engine.generate([prompts[i]], max_new_tokens=6, do_sample=True, eos_token_ids=(),
                                  seed=derive_seed(5, i))[0]
            assert e.output_token_ids == own.output_token_ids
            assert g.output_token_ids == own.output_token_ids, (
                f"request {i}: engine_seed=5 without seed_indices did not give derive_seed(5, {i})'s tokens")
    finally:
        engine.close()
