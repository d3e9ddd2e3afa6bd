"""BatchingConfig(progress=True): the bar moves while requests run, not only as they finish."""

import pytest
from models import generated_rows, random_prompts, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine.progress import Progress as _Progress


def test_the_bar_shows_tokens_and_their_rate_before_any_request_finishes(monkeypatch):
    """Two requests of 5 tokens, one step a (fake) second: after step k the postfix reads 2k tokens
    at 2 tok/s, while the request count stays at 0 until both end at step 5."""
    now = [0.0]
    monkeypatch.setattr(_Progress, "clock", staticmethod(lambda: now[0]), raising=False)
    shown = []
    update = _Progress.update

    def update_and_record(self, finished):
        update(self, finished)
        if self.bar is not None:  # (the engine's parity probe runs without a bar)
            shown.append((self.bar.n, self.bar.postfix))

    monkeypatch.setattr(_Progress, "update", update_and_record)
    engine = Engine(tiny_model("llama"), BatchingConfig(mode="sync", max_batch_tokens=64, progress=True))
    pipeline = engine.pipeline("sync")
    step = pipeline.step

    def step_of_a_second(*args, **kwargs):
        now[0] += 1.0
        return step(*args, **kwargs)

    monkeypatch.setattr(pipeline, "step", step_of_a_second)
    prompts = random_prompts(2, 3, 10, seed=94)
    outs = engine.generate(prompts, max_new_tokens=5, eos_token_ids=())
    expected = generated_rows(stock_generate(tiny_model("llama"), prompts, max_new_tokens=5),
                              max(map(len, prompts)), pad=0, eos=())
    assert [o.output_token_ids for o in outs] == expected
    assert shown == [(0, "2 tok, 2 tok/s"), (0, "4 tok, 2 tok/s"), (0, "6 tok, 2 tok/s"),
                     (0, "8 tok, 2 tok/s"), (2, "10 tok, 2 tok/s")]


def test_a_string_turns_the_bar_on_and_labels_it():
    from hf_async_cb.engine.progress import Progress

    with Progress([], "async timed") as labelled, Progress([], True) as plain, Progress([], False) as off:
        assert labelled.bar.desc == "async timed" and plain.bar.desc == "hf_async_cb" and off.bar is None
    assert BatchingConfig(progress="async timed").progress == "async timed"
    for bad in ("", 1, None):
        with pytest.raises(ValueError, match="progress"):
            BatchingConfig(progress=bad)
