"""The serving benchmark's peer paths, "hf-cb-sync" / "hf-cb-async": transformers' own continuous
batching driven as ours are, through its online manager and its per-token timestamps.
"""

from __future__ import annotations

import inspect
import time

from hf_async_cb.tools import bench
from hf_async_cb.tools.serving_client import decoding_options, drive
from hf_async_cb.tools.serving_metrics import Trace
from hf_async_cb.tools.serving_warmup import fresh_prompts
from hf_async_cb.tools.serving_workload import Workload


def hf_online_missing() -> str | None:
    """Why transformers' online continuous batching cannot be driven here; None when it can (the
    manager's add_request with record_timestamps, and continuous_batching_context_manager)."""
    try:
        from transformers import GenerationMixin
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError as error:
        return f"transformers has no continuous batching manager ({error})"
    if not hasattr(GenerationMixin, "continuous_batching_context_manager"):
        return "transformers' generation has no continuous_batching_context_manager"
    if "record_timestamps" not in inspect.signature(ContinuousBatchingManager.add_request).parameters:
        return "transformers' ContinuousBatchingManager.add_request does not record token timestamps"
    return None


class HFServer:
    """transformers' continuous batching manager, started (its own warm-up included); `serve` runs
    a workload through its add_request / get_result, with its per-token timestamps."""

    def __init__(self, model, path: str, config=None, sample: bool = False, sizing: Workload | None = None) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from hf_async_cb.config import BatchingConfig

        device = model.device
        options = {}
        if device.type == "cpu" and sizing is not None:
            # As bench: else it sizes its cache from the host's free RAM and its step for 8192
            # tokens. Pages for every request of `sizing` at once; our step budget.
            options["num_blocks"] = sum(-(-(len(p) + n) // bench.HF_PAGE) for p, n in zip(sizing.prompts, sizing.new))
            options["max_batch_tokens"] = (config or BatchingConfig()).for_device(device).max_batch_tokens
        page_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        cb = ContinuousBatchingConfig(use_async_batching=path.endswith("async"), **{page_key: bench.HF_PAGE}, **options)
        gcfg = GenerationConfig(max_new_tokens=max(sizing.new) if sizing else 16, eos_token_id=-1, pad_token_id=0,
                                **decoding_options(sample))
        kwargs = dict(generation_config=gcfg, continuous_batching_config=cb, block=True, timeout=60)
        if sizing is not None and "workload_hints" in inspect.signature(model.continuous_batching_context_manager).parameters:
            from transformers.generation.continuous_batching.utils import WorkloadHints

            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, sizing.prompts)),
                                                     max_generated_length=max(sizing.new), num_requests=len(sizing))
        self._context = model.continuous_batching_context_manager(**kwargs)
        self.manager = self._context.__enter__()
        self._ids = 0
        self._vocab = model.config.vocab_size
        self.timed_out = False

    def counters(self) -> dict[str, int]:
        return {}

    def warm_up(self, workload: Workload, timeout: float | None = None, deadline: float | None = None) -> bool:
        """The replay (its own graph warm-up ran as it started); whether it finished before `deadline`."""
        traces, _ = self.serve(fresh_prompts(workload, self._vocab), timeout, deadline)
        return all(t.finished for t in traces)

    def serve(self, workload: Workload, timeout: float | None = None,
              deadline: float | None = None) -> tuple[list[Trace], float]:
        """As OurServer.serve: `timeout` for all the results (TimeoutError past it), none waited for
        past `deadline` (those left are marked unfinished, and the manager is hard-stopped at close)."""
        manager, ids = self.manager, {}

        def submit(i: int, trace: Trace) -> None:
            request_id = f"serve-{self._ids}"
            self._ids += 1
            ids[request_id] = i
            manager.add_request(workload.prompts[i], request_id=request_id, max_new_tokens=workload.new[i],
                                record_timestamps=True, eos_token_id=-1)

        traces, lag = drive(workload, submit)
        limit = None if timeout is None else time.perf_counter() + timeout
        pending = set(ids)
        while pending:
            if deadline is not None and time.perf_counter() > deadline:
                for request_id in pending:
                    traces[ids[request_id]].finished = False
                self.timed_out = True
                break
            if limit is not None and time.perf_counter() > limit:
                raise TimeoutError(f"transformers' manager did not finish {len(pending)} requests within {timeout} s")
            result = manager.get_result(timeout=0.1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"transformers' manager stopped with {len(pending)} requests unfinished")
                continue
            if result.request_id not in pending:
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers' manager failed request {result.request_id}: {result.error}")
            pending.discard(result.request_id)
            trace = traces[ids[result.request_id]]
            trace.output_token_ids = list(result.generated_tokens)
            # A stamp per token it appends (and one for a token past the limit it drops).
            trace.token_times = list(result.timestamps or [])[: len(trace.output_token_ids)]
        return traces, lag

    def close(self) -> None:
        if self.timed_out:  # else its stop would first finish every request still queued
            self.manager.stop(block=True, timeout=30, hard_stop=True)
        self._context.__exit__(None, None, None)
