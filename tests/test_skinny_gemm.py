"""The skinny GEMM kernel against F.linear (in Triton's interpreter on the CPU, on the GPU with
CUDA), its default launch heuristic, its sm_90 build, and the measured choice against cuBLAS."""

import json

import pytest
import torch
import torch.nn.functional as F
from sm90 import assert_compiles_for_sm90

from hf_async_cb.kernels.gemm_choice import GemmChoice, relative_error
from hf_async_cb.kernels.skinny_gemm import CONFIG_KEYS, block_m, candidate_configs, default_config, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_N=32, BLOCK_K=32)  # several N tiles and K blocks even at the small shapes, ragged tails included


def _inputs(M, N, K, dtype, lead=None, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + M * 100 + N + K)
    x = torch.randn(*(lead or (M,)), K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype)
    return x, w, b


# Every (M, N, K) of M in 1 3 16 33, N in 8 40 96, K in 16 72 128, each with one split and bias choice in turn.
CASES = [(M, N, K, (1, 2, 4)[i % 3], i % 2 == 0)
         for i, (M, N, K) in enumerate((M, N, K) for M in (1, 3, 16, 33) for N in (8, 40, 96) for K in (16, 72, 128))]


@pytest.mark.parametrize("M,N,K,split,with_bias", CASES)
def test_fp32_matches_linear(M, N, K, split, with_bias):
    x, w, b = _inputs(M, N, K, torch.float32)
    bias = b if with_bias else None
    got = skinny_linear(x, w, bias, config=dict(SMALL, SPLIT_K=split, SWAP_AB=M == 3))
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("swap", [False, True])
def test_leading_dims_are_flattened(split, swap):
    x, w, b = _inputs(6, 40, 72, torch.float32, lead=(2, 3))
    got = skinny_linear(x, w, b, config=dict(SMALL, SPLIT_K=split, SWAP_AB=swap))
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_default_config_and_odd_inputs():
    """The default launch (no config), a 1-D x, a strided x and zero rows, as F.linear takes them."""
    x, w, b = _inputs(5, 96, 128, torch.float32)
    torch.testing.assert_close(skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny_linear(x[0], w), F.linear(x[0], w), rtol=1e-5, atol=1e-5)
    wide = torch.randn(5, 200, device=DEVICE)
    torch.testing.assert_close(skinny_linear(wide[:, 10:138], w, config=SMALL), F.linear(wide[:, 10:138], w),
                               rtol=1e-5, atol=1e-5)
    assert skinny_linear(x[:0], w, b).shape == (0, 96)


@pytest.mark.parametrize("M,N,K,split,swap", [(1, 40, 72, 1, False), (16, 96, 128, 2, True), (33, 40, 128, 4, False),
                                              (3, 96, 72, 4, True)])
def test_fp16_matches_fp32_reference(M, N, K, split, swap):
    """The 16-bit path (fp16 stands in for bf16, which the interpreter may not do faithfully): fp32
    accumulation, one rounding to fp16 at the end."""
    x, w, b = _inputs(M, N, K, torch.float16)
    got = skinny_linear(x, w, b, config=dict(SMALL, SPLIT_K=split, SWAP_AB=swap))
    assert got.dtype == torch.float16
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3)
    assert relative_error(got, ref) < 1e-2


def test_split_k_is_deterministic():
    x, w, b = _inputs(16, 96, 128, torch.float16)
    runs = [skinny_linear(x, w, b, config=dict(SMALL, SPLIT_K=4)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_bad_inputs_raise_value_error():
    x, w, b = _inputs(4, 40, 72, torch.float32)
    with pytest.raises(ValueError, match="at most 256 rows"):
        skinny_linear(torch.zeros(257, 72, device=DEVICE), w)
    with pytest.raises(ValueError, match="features"):
        skinny_linear(x[:, :64], w)
    with pytest.raises(ValueError, match="contiguous weight"):
        skinny_linear(x, torch.zeros(72, 40, device=DEVICE).t())
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x.half(), w)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x.long(), w.long())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:-1])
    with pytest.raises(ValueError, match="power of two"):
        skinny_linear(x, w, config=dict(BLOCK_N=48))
    with pytest.raises(ValueError, match="unknown keys"):
        skinny_linear(x, w, config=dict(BLOCK_M=16))


LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_default_config_gives_two_waves(name):
    """At 32 rows every 8B projection launches at least two programs per SM of the H200 (132)."""
    N, K = LLAMA3_8B[name]
    config = default_config(32, N, K, torch.bfloat16, 132)
    assert set(config) == set(CONFIG_KEYS)
    assert -(-N // config["BLOCK_N"]) * config["SPLIT_K"] >= 2 * 132
    assert default_config(32, N, K, torch.bfloat16) == config  # None (off CUDA) assumes the H200
    assert default_config(17, N, K, torch.bfloat16, 132) == config  # one launch (one variant) per M bucket
    for M in (1, 8, 64, 128, 256):
        c = default_config(M, N, K, torch.bfloat16, 132)
        assert K % (c["SPLIT_K"] * c["BLOCK_K"]) == 0  # the 8B shapes split into whole K blocks
        assert c["SPLIT_K"] * M * N * 4 <= N * K * 2 // 4  # partials at most a quarter of the weight's bytes
    configs = candidate_configs(32, N, K, torch.bfloat16, 132)
    assert configs[0] == config and len(configs) == len({json.dumps(c, sort_keys=True) for c in configs}) > 3


def test_kernels_compile_for_sm90():
    """bf16 with SPLIT_K 4 (the main kernel, plain and SWAP_AB, and the reduction) builds for an
    H200 without a GPU, and the default tiles of every M bucket fit its shared memory (227 KB a block)."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    reduce = {"part_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "s_ptr": "*fp32", "total": "i32", "N": "i32"}
    # What a launch sees at the 8B o-projection: aligned pointers, 16-divisible sizes (not M, never specialised).
    aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
    kernels = []
    for M in (1, 32, 64, 128, 256):
        c = default_config(M, 4096, 4096, torch.bfloat16, 132)
        for swap in ((False, True) if M == 32 else (False,)):
            kernels.append(("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel", sig,
                            dict(BLOCK_M=block_m(M), BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=4,
                                 EVEN_K=True, EVEN_N=True, HAS_BIAS=False, SWAP_AB=swap, IEEE=False, SCALED=False,
                                 GROUP=0, PRESCALED=False, CODEBOOK=0, BITS=4, DEQUANT=0),
                            dict(num_warps=c["num_warps"], num_stages=c["num_stages"], divisible_by_16=aligned)))
    kernels.append(("hf_async_cb.kernels.skinny_gemm", "_splitk_reduce_kernel", reduce,
                    dict(SPLIT_K=4, BLOCK=1024, HAS_BIAS=True, SCALED=False)))
    # The scaled int8 form (weight-only int8): int8 tiles, the scale in the epilogue or in the reduction.
    c = default_config(32, 4096, 4096, torch.int8, 132)
    kernels.append(("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel", dict(sig, w_ptr="*i8", b_ptr="*i8",
                                                                                   out_ptr="*bf16"),
                    dict(BLOCK_M=32, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=1, EVEN_K=True, EVEN_N=True,
                         HAS_BIAS=False, SWAP_AB=False, IEEE=False, SCALED=True, GROUP=0, PRESCALED=False, CODEBOOK=0, BITS=4, DEQUANT=0),
                    dict(num_warps=c["num_warps"], num_stages=c["num_stages"], divisible_by_16=aligned)))
    kernels.append(("hf_async_cb.kernels.skinny_gemm", "_splitk_reduce_kernel", dict(reduce, b_ptr="*fp32",
                                                                                     s_ptr="*bf16"),
                    dict(SPLIT_K=4, BLOCK=1024, HAS_BIAS=False, SCALED=True)))
    shared = assert_compiles_for_sm90(kernels)
    assert max(shared) <= 227 * 1024
    assert shared[0] > 0  # the weight tiles are pipelined through shared memory


def _fake_timer(times: dict):
    """Milliseconds by config (None: cuBLAS), looked up by BLOCK_N; records the calls."""
    calls = []

    def timer(M, N, K, dtype, config):
        calls.append((M, N, K, dtype, config))
        return times[None if config is None else config["BLOCK_N"]]

    timer.calls = calls
    return timer


def test_gemm_choice_picks_faster_persists_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ASYNC_CB_CACHE", str(tmp_path))
    configs = [dict(default_config(32, 4096, 4096), BLOCK_N=n) for n in (32, 64, 128)]
    timer = _fake_timer({None: 10.0, 32: 12.0, 64: 6.0, 128: 7.0})
    choice = GemmChoice(timer=timer)
    assert choice.path == tmp_path / "gemm_choices.json"
    assert choice.lookup(20, 4096, 4096, torch.bfloat16, "NVIDIA H200") is None
    assert not choice.known(20, 4096, 4096, torch.bfloat16, "NVIDIA H200")
    won = choice.tune_named(20, 4096, 4096, torch.bfloat16, "NVIDIA H200", timer, configs)
    assert won == configs[1]
    assert {c[0] for c in timer.calls} == {32}  # timed at M's bucket
    # cuBLAS wins a shape where no config beats it by the margin.
    slow = _fake_timer({None: 10.0, 32: 12.0, 64: 9.9, 128: 11.0})
    assert choice.tune_named(128, 6144, 4096, torch.bfloat16, "NVIDIA H200", slow, configs) is None

    saved = json.loads((tmp_path / "gemm_choices.json").read_text())
    assert len(saved["choices"]) == 2
    again = GemmChoice()
    for M in (17, 32):  # the whole bucket
        assert again.lookup(M, 4096, 4096, torch.bfloat16, "NVIDIA H200") == configs[1]
    assert again.known(128, 6144, 4096, torch.bfloat16, "NVIDIA H200")
    assert again.lookup(128, 6144, 4096, torch.bfloat16, "NVIDIA H200") is None
    assert again.lookup(32, 4096, 4096, torch.float16, "NVIDIA H200") is None
    assert again.lookup(32, 4096, 4096, torch.bfloat16, "NVIDIA H100") is None
    # Off CUDA: no choice, no timing.
    assert again.choose(32, 4096, 4096, torch.bfloat16, torch.device("cpu")) is None
    assert again.tune(32, 4096, 4096, torch.bfloat16, "cpu") is None
    assert GemmChoice(timer=timer).choose(32, 4096, 4096, torch.bfloat16, "cpu") is None


def test_gemm_choice_survives_a_corrupt_file(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        choice = GemmChoice(path)
    choice.record(8, 64, 64, torch.float16, "dev", dict(default_config(8, 64, 64, torch.float16)))
    assert GemmChoice(path).known(8, 64, 64, torch.float16, "dev")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("M", [1, 32, 256])
@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_bf16_8b_shapes_on_cuda(name, M):
    N, K = LLAMA3_8B[name]
    x, w, _ = _inputs(M, N, K, torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    got = skinny_linear(x, w)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, ref) < 1e-2
    if M == 32:  # the tuner's other candidates too (benchmarks/tune_gemm.py checks them at every M)
        for config in candidate_configs(M, N, K, torch.bfloat16)[1:]:
            assert relative_error(skinny_linear(x, w, config=config), ref) < 1e-2, config


@cuda
def test_one_variant_serves_a_bucket():
    """M is not specialised: every M of a BLOCK_M bucket runs the same compiled kernel."""
    from hf_async_cb.kernels import compiled_keys

    x, w, b = _inputs(64, 4096, 4096, torch.bfloat16)
    config = default_config(64, 4096, 4096, torch.bfloat16)
    skinny_linear(x[:33], w, b, config=config)
    before = sum(len(v) for k, v in compiled_keys().items() if "skinny_gemm" in k)
    for M in (34, 47, 63, 64):
        torch.testing.assert_close(skinny_linear(x[:M], w, b, config=config).float(),
                                   F.linear(x[:M].float(), w.float(), b.float()), rtol=2e-2, atol=2e-2)
    assert sum(len(v) for k, v in compiled_keys().items() if "skinny_gemm" in k) == before


@cuda
def test_gemm_choice_tunes_on_cuda(tmp_path):
    choice = GemmChoice(tmp_path / "choices.json")
    won = choice.tune(32, 2048, 2048, torch.bfloat16, "cuda")
    assert won is None or set(won) == set(CONFIG_KEYS)
    assert GemmChoice(tmp_path / "choices.json").choose(32, 2048, 2048, torch.bfloat16, "cuda") == won
