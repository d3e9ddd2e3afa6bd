"""`generate(watermarking_config=...)` against stock generate: stock's watermark processor seeds its
greenlist from each row's own last tokens, so it runs as it is on each request's row (slow path)."""

from __future__ import annotations

import pytest
import torch
from models import left_pad, random_prompts, tiny_model
from transformers import WatermarkingConfig


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scheme", ["lefthash", "selfhash"])
def test_watermarked_rows_give_stock_tokens(scheme, mode):
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(4, 3, 10, seed=5))
    options = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    marked = dict(options, watermarking_config=WatermarkingConfig(bias=4.0, seeding_scheme=scheme))
    expected = model.generate(ids, attention_mask=mask, **marked)
    assert not torch.equal(expected, model.generate(ids, attention_mask=mask, **options))  # (the mark shows)
    assert torch.equal(model.generate(ids, attention_mask=mask, batching=mode, **marked), expected)
