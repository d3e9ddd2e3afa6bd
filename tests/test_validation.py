"""Every option's type and range checked where it comes in: a ValueError naming it, before any work
(never a struct.error, a TypeError or an OverflowError later, nor a silently truncated value), and
what stock generate runs, run as stock runs it."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from models import left_pad, random_prompts, stock_generate, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_async_cb import BatchingConfig, Engine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, BatchingConfig(mode="sync", page_size=4, num_pages=32))


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if an Engine gets built: the error must come before any work."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("an Engine was built before the error")

    monkeypatch.setattr(Engine, "__init__", refuse)


# -- BatchingConfig ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("seed", "abc"), ("seed", -1), ("seed", 2**63), ("seed", 2**70), ("seed", 1.0), ("seed", True),
    ("cuda_graphs", "yes"), ("cuda_graphs", 1), ("progress", "no"), ("progress", None), ("profile", 1),
    ("prefill_graphs", None), ("trust_untested_model", "false"), ("fuse_projections", 0),
    ("fuse_elementwise", "auto"), ("kv_memory_fraction", "0.5"), ("kv_memory_fraction", 0),
    ("kv_memory_fraction", float("nan")), ("kv_memory_fraction", True), ("page_size", True),
    ("page_size", "4"), ("num_pages", 2.0), ("cpu_kv_cache_bytes", -1), ("max_batch_tokens", np.float64(8)),
    ("max_running_requests", None), ("mode", None), ("mode", ["sync"]), ("attention", None),
])
def test_config_field_types_and_ranges(field, value):
    with pytest.raises(ValueError, match=f"BatchingConfig.{field}"):
        BatchingConfig(**{field: value})


@pytest.mark.parametrize("value", [object(), "yes", [1]])
@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(BatchingConfig)])
def test_every_config_field_is_checked(field, value):
    """A field added later without a check fails here."""
    with pytest.raises(ValueError, match=f"BatchingConfig.{field}"):
        BatchingConfig(**{field: value})


def test_config_checked_again_when_changed(model):
    config = BatchingConfig(mode="sync")
    config.seed = "abc"
    with pytest.raises(ValueError, match="BatchingConfig.seed"):
        Engine(model, config)


def test_config_accepts_numpy_scalars_as_plain_values():
    config = BatchingConfig(seed=np.int64(2**63 - 1), page_size=np.int32(8), kv_memory_fraction=np.float32(0.25),
                            num_pages=np.int64(4))
    assert type(config.seed) is int and config.seed == 2**63 - 1
    assert type(config.page_size) is int and type(config.num_pages) is int
    assert type(config.kv_memory_fraction) is float
    assert BatchingConfig(kv_memory_fraction=1).kv_memory_fraction == 1.0
    assert BatchingConfig(seed=0, cuda_graphs=None, fuse_projections=False).seed == 0
