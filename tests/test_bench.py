"""The bench command on the CPU (tiny shape): every path generates the whole workload, greedy and
sampled, and ablation suffixes parse into BatchingConfig changes."""

import pytest

from hf_async_cb.tools import bench


@pytest.mark.parametrize("sample", [False, True])
def test_every_path_generates_the_whole_workload(sample):
    report = bench.run("tiny", 4, 8, 6, paths=("stock", "sync", "async-eager"), device="cpu", sample=sample)
    assert [r["path"] for r in report["results"]] == ["stock", "sync", "async-eager"]
    assert all(r["tokens"] == 4 * 6 for r in report["results"])
    assert report["sample"] is sample
    table = bench.format_table(report)
    assert table.count("\n| ") == 4 and ("sampled" in table) is sample  # the header and a row per path


def test_ablation_suffixes():
    assert bench.our_path("async-noprefill-eager") == ("async", {"prefill_graphs": False, "cuda_graphs": False})
    assert bench.our_path("sync-ref") == ("sync", {"attention": "reference"})
    assert bench.our_path("stock") is None and bench.our_path("async-bogus") is None
    with pytest.raises(ValueError, match="unknown path"):
        bench.check_paths(["async-bogus"])
