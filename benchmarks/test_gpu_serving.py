"""GPU serving benchmark: the serving workload (tools/serving.py) under pytest-benchmark.

    python -m pytest benchmarks/test_gpu_serving.py --benchmark-enable --benchmark-autosave
    python -m pytest benchmarks/test_gpu_serving.py --benchmark-enable --benchmark-compare

128 ShareGPT-like requests on the llama3.2-1b shape, arriving as a Poisson process of 16 requests/s
and all at once, through our sync and async loops on a held engine whose loop is started. Each
test first warms up as `bench --serve` does (the workload's shapes once, with other prompts, and a
decode step of every graph bucket: serving.OurServer.warm_up), then times one run; its
extra_info carries what the time alone does not: TTFT and ITL p50/p99 and the throughputs. One
round: a run at 16 requests/s lasts as long as its arrivals (~8 s), so more rounds would mostly
measure the schedule. Skipped without CUDA; `python -m hf_async_cb bench --serve` prints the same
workload as a table, transformers' own batching included.
"""

import math

import pytest
import torch

from hf_async_cb import BatchingConfig
from hf_async_cb.tools import serving
from hf_async_cb.tools.bench import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REQUESTS = 128
RATES = {"16 req/s": 16.0, "all at once": math.inf}


@pytest.fixture(scope="module")
def model():
    model = build_model("llama3.2-1b", torch.device("cuda"), torch.bfloat16)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("rate", list(RATES))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_serving_latency(benchmark, model, mode, rate):
    workload = serving.make_workload(REQUESTS, model.config.vocab_size, RATES[rate], "sharegpt", seed=0)
    server = serving.open_server(mode, model, BatchingConfig(max_running_requests=REQUESTS), sizing=workload)
    try:
        assert server.warm_up(workload, timeout=300)  # its shapes once (other prompts), every decode bucket
        captures = server.counters()["captures"]
        traces = benchmark.pedantic(lambda: server.serve(workload, timeout=300)[0], rounds=1, iterations=1)
        captures = server.counters()["captures"] - captures
    finally:
        server.close()
    assert [len(t.token_times) for t in traces] == workload.new
    assert captures == 0, f"{captures} graphs captured during the timed run"
    m = serving.summarize(traces)
    benchmark.extra_info.update(
        request_throughput=m["request_throughput"], output_throughput=m["output_throughput"],
        ttft_ms_p50=m["ttft_ms"]["p50"], ttft_ms_p99=m["ttft_ms"]["p99"],
        itl_ms_p50=m["itl_ms"]["p50"], itl_ms_p99=m["itl_ms"]["p99"], e2e_s_p50=m["e2e_s"]["p50"],
        e2e_s_p99=m["e2e_s"]["p99"])
