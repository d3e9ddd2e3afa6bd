"""Which decode GEMM shapes take the skinny kernel (kernels/skinny_gemm.py) rather than cuBLAS:
measured, never guessed.

GemmChoice decides per shape (rows bucket, N, K, dtype, GPU, Triton version) between the kernel and
cuBLAS (F.linear) from measurements taken at warm-up (`tune`: a few candidate configs and cuBLAS,
each timed as calls replayed from a CUDA graph, the kernel checked against F.linear first),
remembered in memory and on disk (`cache_path()`); `choose` never times anything. A shape never
tuned runs cuBLAS.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from hf_async_cb.devices import num_sms
from hf_async_cb.kernels.graph_timing import cold_copies, graph_ms
from hf_async_cb.kernels.skinny_gemm import MAX_M, candidate_configs, m_bucket, skinny_linear


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    """max |y - reference| / max |reference| (in fp32): the correctness gate of the tuner and benchmark."""
    ref = reference.float()
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# --- measured choice between the kernel and cuBLAS ----------------------------------------------------------

# timer(M, N, K, dtype, config) -> milliseconds per call, or None when the config failed (did not
# compile, or gave a wrong result); config None times F.linear (cuBLAS).
Timer = Callable[[int, int, int, torch.dtype, "dict | None"], "float | None"]

WIN_MARGIN = 0.03  # the kernel must beat cuBLAS by 3% to be chosen: a tie is noise, cuBLAS the safe side


def cache_path() -> Path:
    """$HF_ASYNC_CB_CACHE (the package's cache directory, as for the demo model) or ~/.cache/hf_async_cb,
    then gemm_choices.json."""
    from hf_async_cb.cache_folder import cache_folder

    return cache_folder() / "gemm_choices.json"


@functools.lru_cache(maxsize=8)
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def cuda_timer(device: torch.device, weight: torch.Tensor | None = None, *, calls: int = 20) -> Timer:
    """The default timer: `calls` calls replayed from a CUDA graph (graph_timing.graph_ms, as the
    engine's decode graphs run them; eager timing would measure Triton's launch path), rotating
    weight copies when the weight fits in L2. A Triton config is first checked against F.linear
    (relative error < 1e-2) and answers None if wrong or if it does not compile or capture."""

    def timer(M: int, N: int, K: int, dtype: torch.dtype, config: dict | None) -> float | None:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
        if weight is not None and tuple(weight.shape) == (N, K) and weight.dtype == dtype:
            base = weight.contiguous()
        else:
            base = (torch.randn(N, K, generator=gen, device=device, dtype=dtype) / math.sqrt(K)).to(dtype)
        weights = [base] + [base.clone() for _ in range(cold_copies(base.numel() * base.element_size()) - 1)]
        if config is None:
            def fn(i):
                return F.linear(x, weights[i % len(weights)])
        else:
            def fn(i):
                return skinny_linear(x, weights[i % len(weights)], config=config)
            try:
                y = fn(0)
                torch.cuda.synchronize(device)
            except Exception:  # noqa: BLE001 (a config that does not compile or launch: not a candidate)
                return None
            if relative_error(y, F.linear(x.float(), base.float())) >= 1e-2:
                return None
        try:
            return graph_ms(fn, calls=calls, device=device)
        except Exception:  # noqa: BLE001 (a config that cannot be captured: not a candidate)
            torch.cuda.synchronize(device)
            return None

    return timer


class GemmChoice:
    """Per shape (M bucket, N, K, dtype, device name, Triton version), the skinny kernel's config
    that beat cuBLAS when measured, or None (cuBLAS). `tune` measures at warm-up and records;
    `choose` only looks up (no timing on the hot path; a shape never tuned answers None). Choices
    persist as JSON at cache_path(), so a process re-measures only shapes it has not seen; the
    Triton version is part of the key because a compiler upgrade can change the winner."""

    VERSION = 1

    def __init__(self, path: str | os.PathLike | None = None, timer: Timer | None = None) -> None:
        self.path = Path(path) if path is not None else cache_path()
        self._timer = timer
        self._choices: dict[str, dict | None] = self._load()

    @staticmethod
    def key(M: int, N: int, K: int, dtype: torch.dtype, device_name_: str) -> str:
        dtype_name = str(dtype).removeprefix("torch.")
        return f"{device_name_}|triton {triton.__version__}|{dtype_name}|m{m_bucket(M)}|n{N}|k{K}"

    def _load(self, quiet: bool = False) -> dict[str, dict | None]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            if not quiet:
                warnings.warn(f"ignoring unreadable GEMM choices at {self.path}: {e}", stacklevel=3)
            return {}
        if not isinstance(data, dict) or data.get("version") != self.VERSION:
            return {}
        return dict(data.get("choices", {}))

    def _save(self) -> None:
        """Merge into what is on disk (another process may have tuned other shapes), atomically."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._load(quiet=True), **self._choices}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gemm_choices.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": self.VERSION, "choices": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            warnings.warn(f"could not save GEMM choices to {self.path}: {e}", stacklevel=3)

    def lookup(self, M: int, N: int, K: int, dtype: torch.dtype, device_name_: str) -> dict | None:
        return self._choices.get(self.key(M, N, K, dtype, device_name_))

    def known(self, M: int, N: int, K: int, dtype: torch.dtype, device_name_: str) -> bool:
        return self.key(M, N, K, dtype, device_name_) in self._choices

    def choose(self, M: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str) -> dict | None:
        """The recorded config for this shape, or None: cuBLAS (not CUDA, M > 256, or never tuned)."""
        device = torch.device(device)
        if device.type != "cuda" or M > MAX_M:
            return None
        return self.lookup(M, N, K, dtype, device_name(device))

    def tune(self, M: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str, *,
             configs: list[dict] | None = None, weight: torch.Tensor | None = None) -> dict | None:
        """Measure cuBLAS and a few kernel configs at M's bucket (the padded size a CUDA graph runs)
        on `device`, record the winner and return it (None: cuBLAS). Off CUDA: nothing, None.
        `weight` (the layer's own) spares allocating a random one of its size."""
        device = torch.device(device)
        if device.type != "cuda" or M > MAX_M:
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        timer = self._timer or cuda_timer(device, weight)
        if configs is None:
            configs = candidate_configs(m_bucket(M), N, K, dtype, num_sms(device))
        return self.tune_named(M, N, K, dtype, device_name(device), timer, configs)

    def tune_named(self, M: int, N: int, K: int, dtype: torch.dtype, device_name_: str, timer: Timer,
                   configs: list[dict]) -> dict | None:
        """tune's decision with the device given by name and the timer given: time F.linear and each
        config at M's bucket, keep the fastest config if it beats cuBLAS by WIN_MARGIN, record, save."""
        bucket = m_bucket(M)
        cublas = timer(bucket, N, K, dtype, None)
        best, best_ms = None, math.inf
        for config in configs:
            ms = timer(bucket, N, K, dtype, config)
            if ms is not None and ms < best_ms:
                best, best_ms = dict(config), ms
        winner = best if best is not None and (cublas is None or best_ms < cublas * (1 - WIN_MARGIN)) else None
        self.record(M, N, K, dtype, device_name_, winner)
        return winner

    def record(self, M: int, N: int, K: int, dtype: torch.dtype, device_name_: str, config: dict | None) -> None:
        """Remember `config` (None: cuBLAS) for this shape, in memory and on disk."""
        self._choices[self.key(M, N, K, dtype, device_name_)] = None if config is None else dict(config)
        self._save()
