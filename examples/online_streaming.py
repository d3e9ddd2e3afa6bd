"""A server-style loop: requests arrive from several threads while others are generating, and
each one's tokens are streamed as they come.

    python examples/online_streaming.py
"""

import threading
import time

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.tools.demo_model import load_smollm2

model, tokenizer = load_smollm2()
engine = Engine(model, BatchingConfig(mode="async"), tokenizer=tokenizer)
engine.start()


def client(name: str, question: str, delay: float) -> None:
    time.sleep(delay)  # arrive while others are already generating
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    submitted = time.perf_counter()
    handle = engine.add_request(prompt, max_new_tokens=40, eos_token_ids=(tokenizer.eos_token_id,))
    tokens = []
    for token in handle:  # each token as soon as the loop has it
        if not tokens:
            print(f"[{name}] first token after {1e3 * (time.perf_counter() - submitted):.0f} ms")
        tokens.append(token)
    # Decoded together: a character may span several tokens, and a token alone loses its leading space.
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    print(f"[{name}] {text.strip()!r} ({handle.result().finish_reason.value})")


questions = ["What is the capital of Italy?", "Name three colours.", "What is 6 times 7?", "Say hello in French."]
threads = [threading.Thread(target=client, args=(f"client-{i}", q, 0.2 * i)) for i, q in enumerate(questions)]
for t in threads:
    t.start()
for t in threads:
    t.join()
engine.shutdown()
