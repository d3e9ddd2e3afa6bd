"""streamer= with generate(batching=...): the same put() calls as stock generate, in both modes."""

import pytest
import torch
from models import left_pad, random_prompts, stock_generate, tiny_model
from transformers.generation.streamers import BaseStreamer


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def record(model, prompts, mode, **kwargs):
    ids, mask = left_pad(prompts)
    rec = Recorder()
    out = model.generate(ids, attention_mask=mask, batching=mode, streamer=rec, **kwargs)
    return out, rec


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("batch", [1, 4])
def test_streamer_sees_what_stock_shows_it(batch, mode):
    model = tiny_model("llama")
    prompts = random_prompts(batch, 3, 20, seed=41)
    first = stock_generate(model, prompts, max_new_tokens=10, eos_token_id=None)[:, max(map(len, prompts)):]
    eos = [first[0, 4].item(), first[-1, 2].item()]  # rows stop at different steps
    kwargs = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    expected, stock_rec = record(model, prompts, "off", **kwargs)
    got, rec = record(model, prompts, mode, **kwargs)
    assert torch.equal(got, expected)
    assert rec.ended == stock_rec.ended == 1
    assert len(rec.puts) == len(stock_rec.puts)
    for a, b in zip(rec.puts, stock_rec.puts):
        assert torch.equal(a, b)


def test_text_streamer_prints_like_stock(capsys):
    from transformers import TextStreamer

    from hf_async_cb.tools.demo_model import load_smollm2

    model, tokenizer = load_smollm2()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = tokenizer([text], return_tensors="pt")
    printed = []
    for mode in ("off", "async"):
        model.generate(**inputs, max_new_tokens=20, batching=mode, streamer=TextStreamer(tokenizer, skip_prompt=True))
        printed.append(capsys.readouterr().out)
    assert printed[0] and printed[1] == printed[0]
