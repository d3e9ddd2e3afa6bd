"""The Engine without generate: token ids in, RequestOutputs out, per-request sampling parameters
(RL-rollout style: several samples of each prompt at different temperatures).

    python examples/engine_sampling.py
"""

from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.tools.demo_model import load_smollm2

model, tokenizer = load_smollm2()
engine = Engine(model, BatchingConfig(mode="async", seed=0))
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a one-line poem about rain."}],
                                       add_generation_prompt=True)
prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
eos = (tokenizer.eos_token_id,)
params = [SamplingParams(max_new_tokens=32, do_sample=True, temperature=t, top_p=0.95, eos_token_ids=eos)
          for t in (0.3, 0.7, 1.0, 1.3)]
for p, out in zip(params, engine.generate([prompt] * len(params), params)):
    print(f"T={p.temperature}: {tokenizer.decode(out.output_token_ids, skip_special_tokens=True)!r} "
          f"({out.finish_reason.value})")
