"""bench --breakdown: kernel time by kind and each GEMM shape's bandwidth (tools/breakdown.py).
On the CPU the tables come from operator times: the code runs, the numbers mean little."""

from types import SimpleNamespace

import pytest

from hf_async_cb import cli
from hf_async_cb.tools.breakdown import GemmShape, gemm_shapes, kind_of


@pytest.mark.parametrize("name, kind", [
    ("_paged_attention_kernel", "attention"), ("_merge_splits_kernel", "attention"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "GEMMs"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "GEMMs"),
    ("cutlass_80_tensorop_bf16_s16816gemm", "GEMMs"), ("aten::addmm", "GEMMs"), ("aten::mm", "GEMMs"),
    ("aten::scaled_dot_product_attention", "attention"), ("_rms_norm_kernel", "rest"), ("aten::add", "rest"),
])
def test_kernels_and_operators_are_sorted_by_kind(name, kind):
    assert kind_of(name) == kind


def test_gemm_bandwidth_counts_both_operands_and_the_result():
    g = GemmShape(m=32, k=4096, n=4096, calls_per_step=2.0, ms_per_step=0.02, itemsize=2)
    assert g.bytes_per_call == (32 * 4096 + 4096 * 4096 + 32 * 4096) * 2
    assert g.tb_per_s == pytest.approx(g.bytes_per_call * 2 / 20e-6 / 1e12)


def test_gemm_rows_from_profiler_averages():
    averages = [
        SimpleNamespace(key="aten::addmm", input_shapes=[[4096], [32, 4096], [4096, 4096]], count=64,
                        device_time_total=640.0, self_cpu_time_total=0.0),
        SimpleNamespace(key="aten::mm", input_shapes=[[32, 4096], [4096, 128256]], count=16,
                        device_time_total=1600.0, self_cpu_time_total=0.0),
        SimpleNamespace(key="aten::add", input_shapes=[[32, 4096], [32, 4096]], count=99, device_time_total=5.0,
                        self_cpu_time_total=0.0),
    ]
    rows = gemm_shapes(averages, steps=16, itemsize=2, on_cuda=True)
    assert [(r.m, r.k, r.n) for r in rows] == [(32, 4096, 128256), (32, 4096, 4096)]  # the costliest first
    assert rows[1].calls_per_step == 4 and rows[1].ms_per_step == pytest.approx(0.04)


def test_bench_breakdown_prints_both_tables(capsys):
    assert cli.main(["bench", "--breakdown", "--requests", "3", "--prompt", "8", "--new", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| GEMMs |" in out and "| attention |" in out and "| all |" in out
    assert "| 3 x 64 x 64 |" in out  # the q and o projections of the tiny shape at 3 decode rows
    with pytest.raises(SystemExit, match="no --compare"):
        cli.main(["bench", "--breakdown", "--compare", "sync"])
