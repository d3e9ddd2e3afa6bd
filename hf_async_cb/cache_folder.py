"""Where the package keeps what outlives a process: $HF_ASYNC_CB_CACHE, else ~/.cache/hf_async_cb.

It holds the demo model (tools/demo_model.py), the decode GEMM choices measured on a GPU
(kernels/gemm_choice.py) and the parity checks passed (engine/parity_store.py). Triton keeps its
compiled kernels in its own folder (TRITON_CACHE_DIR)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder() -> Path:
    return Path(os.environ.get("HF_ASYNC_CB_CACHE") or Path.home() / ".cache" / "hf_async_cb")
