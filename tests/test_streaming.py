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


def word_tokenizer(vocab: int = 256):
    """A word-level tokenizer over the tiny models' whole vocabulary (ids 0-2: <pad> <s> </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # (joins words with spaces)
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def consume_in_thread(streamer):
    """Iterate `streamer` on a thread of its own; returns (thread, pieces it read)."""
    import threading

    pieces = []
    thread = threading.Thread(target=lambda: pieces.extend(streamer), daemon=True)
    thread.start()
    return thread, pieces


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_iterator_streamer_consumer_is_released_when_the_call_is_refused(mode):
    # The threaded TextIteratorStreamer pattern: a refusal of the engine's (an option stock runs) left the
    # consumer waiting forever on a queue nobody would end (stock never calls end() on an error).
    from transformers import TextIteratorStreamer

    model = tiny_model("llama")
    streamer = TextIteratorStreamer(word_tokenizer(), skip_prompt=True)  # no timeout: a hang is a hang
    thread, pieces = consume_in_thread(streamer)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, batching=mode, streamer=streamer,
                       output_hidden_states=True, return_dict_in_generate=True)
    thread.join(30)
    assert not thread.is_alive(), "the streamer's consumer still waits after the call was refused"
    assert "".join(pieces) == ""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_iterator_streamer_consumer_is_released_when_the_run_fails(mode):
    from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

    class FailsLater(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] >= 7:
                raise KeyError("criterion failed")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = tiny_model("llama")
    tokenizer = word_tokenizer()
    ids = torch.tensor([[5, 6, 7]])
    expected = stock_generate(model, [[5, 6, 7]], max_new_tokens=3)  # the tokens put before the failure
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread, pieces = consume_in_thread(streamer)
    with pytest.raises(KeyError, match="criterion failed"):
        model.generate(ids, max_new_tokens=10, batching=mode, streamer=streamer,
                       stopping_criteria=StoppingCriteriaList([FailsLater()]))
    thread.join(30)
    assert not thread.is_alive(), "the streamer's consumer still waits after the call failed"
    assert "".join(pieces).split() == tokenizer.decode(expected[0, 3:]).split()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_streamer_whose_put_raises_is_not_ended(mode):
    # As stock: the streamer itself failed, so it is left alone (no end() after its own error).
    class FailsOnSecondPut(Recorder):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 2:
                raise KeyError("put failed")

    model = tiny_model("llama")
    for batching in ("off", mode):
        rec = FailsOnSecondPut()
        with pytest.raises(KeyError, match="put failed"):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, batching=batching, streamer=rec)
        assert (len(rec.puts), rec.ended) == (2, 0), batching
