"""Every tiny vision-language family of tests/vlm_families.py runs under stock generate, and its images matter.

Stock only (no batching=...): this checks the fixtures the engine's VLM tests compare against. A family whose
stock forward is broken in the installed transformers is an expected failure (strict: it turns into a pass
to be noticed when transformers fixes it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

import vlm_families as V  # noqa: E402  (tests/ is on sys.path: conftest.py)

NEW = 4


def _params():
    out = []
    for name, fam in V.FAMILIES.items():
        marks = [pytest.mark.xfail(strict=True, reason=fam.stock_broken)] if fam.stock_broken else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = V.build_model(name)
        return cache[name]

    return get


@pytest.mark.parametrize("name", _params())
def test_stock_generate(models, name):
    model = models(name)
    for scenario in V.scenarios_for(name):
        inputs = V.build_inputs(name, scenario)
        ids = inputs["input_ids"]
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        assert out.sequences.shape == (ids.shape[0], ids.shape[1] + NEW), scenario
        assert torch.equal(out.sequences[:, :ids.shape[1]], ids)
        assert len(out.logits) == NEW
        if scenario == "one_each":
            # rows 0 and 1: the same text, the same placeholder ids, different images
            assert torch.equal(ids[0], ids[1])
            first = out.logits[0]
            assert (first[0] - first[1]).abs().max().item() > 1e-4, "the images do not change the logits"
