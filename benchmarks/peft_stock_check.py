"""Does stock PEFT prompt tuning / p-tuning / prefix tuning generate give the tokens the engine
gives? (Run where PEFT's generate works with the installed transformers; in 5.24 its prompt
injection repeats at every decode step and its prefix never reaches the model, since the cache
keyword was renamed.) Prints one line per method and mode.

    PYTHONPATH=. python benchmarks/peft_stock_check.py
"""

import torch
from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import hf_async_cb  # noqa: F401

torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, pad_token_id=0,
                     eos_token_id=299)
base = LlamaForCausalLM(config).eval()
ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7]])
mask = (ids != 0).long()
for peft_config in (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
                    PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=5, encoder_hidden_size=32),
                    PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5)):
    model = get_peft_model(base, peft_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "prompt_encoder" in name:
                p.add_(torch.randn_like(p))
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for mode in ("sync", "async"):
        ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, batching=mode)
        rows = [bool(torch.equal(a, b)) for a, b in zip(stock, ours)]
        print(type(peft_config).__name__, mode, "rows equal to stock PEFT:", rows, flush=True)
    base = model.get_base_model()
