"""bitsandbytes' LLM.int8() projections (Linear8bitLt: an int8 weight with a scale per output row,
activations quantized per row at each call, the columns holding an outlier computed apart in x's
dtype) through kernels/llm_int8.py: the kernels give the module's own forward's result bit for bit
(on the CPU its PyTorch implementation, in Triton's interpreter; on CUDA its CUDA kernels'
rounding), with one outlier column or none; with several, up to the summation order of the outlier
columns' fp32 product. The outlier columns depend on every row of the call, so a CUDA-graph
bucket's padding rows must not count: the real-rows mask gives the module's result on the real
rows alone. A model loaded with `load_in_8bit` through the engine gives stock's greedy tokens, its
padded graph steps pass the mask, and its listed variants are the ones launched."""

import copy
import inspect

import pytest
import torch
from models import tiny_model
from quantized_checks import (assert_engine_greedy_matches_stock, engine_launches_and_listing, interpreter_launches,
                              routed_logits)

from hf_async_cb.kernels import llm_int8
from hf_async_cb.model.decode_gemm import DecodeGemms, bnb_int8

bnb = pytest.importorskip("bitsandbytes")
import transformers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (the interpreter converts fp32 to bf16 by truncation, where the GPU rounds to nearest: bf16 is the GPU's)
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16, torch.float16, torch.float32]


def _linear8bit(n: int, k: int, *, bias: torch.dtype | None = None, threshold: float = 6.0, seed: int = 0):
    """A Linear8bitLt as bitsandbytes builds one for inference: fp32 weights put in as Int8Params,
    quantized when moved to the device, in eval mode."""
    torch.manual_seed(seed)
    module = bnb.nn.Linear8bitLt(k, n, bias=bias is not None, has_fp16_weights=False, threshold=threshold)
    module.weight = bnb.nn.Int8Params(torch.randn(n, k), requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        module.bias = torch.nn.Parameter(torch.randn(n).to(bias), requires_grad=False)
    return module.to(DEVICE).eval()


def _x(rows: int, k: int, dtype: torch.dtype, outliers: list[tuple[int, int]], seed: int = 1) -> torch.Tensor:
    """Activations below 6 in magnitude, but at the (row, column) pairs given, set to 7-9."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(rows, k, generator=g) * 10 - 5).clamp(-5.5, 5.5)
    for i, (row, col) in enumerate(outliers):
        x[row, col] = (7.0 + i) * (-1) ** i
    return x.to(DEVICE, dtype)


def _kernel(module, x, real=None):
    found = bnb_int8(module)
    assert found is not None
    return llm_int8.llm_int8_linear(x, found.weight, found.scb, found.threshold, module.bias, real=real)


def _own(module, x):
    with torch.no_grad():
        return type(module).forward(module, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, outliers", [(1, []), (1, [(0, 7)]), (5, []), (5, [(1, 3), (4, 3)]), (33, [(32, 90)])])
@pytest.mark.parametrize("bias", [None, "x"] + ([torch.float16] if DEVICE == "cuda" else []))
def test_kernel_gives_the_modules_result_exactly(dtype, rows, outliers, bias):
    """At most one outlier column (flagged by one row or several): every output equals the module's own
    forward's. A K tail (100 with K tiles of 128), several rows quantized apart, a bias in x's dtype
    (on CUDA added to the fp16 result) and on CUDA an fp16 one under other x (fused in bitsandbytes'
    dequantization: only CUDA keeps a bias in another dtype, set after the module's first call)."""
    bias = dtype if bias == "x" else bias
    module = _linear8bit(48, 100, bias=bias if bias in (None, dtype) else None)
    if bias is not None and bias != dtype:  # (CUDA: a bias in fp16 under x in another dtype, set after the first call)
        _own(module, _x(2, 100, dtype, []))
        module.bias = torch.nn.Parameter(torch.randn(48).to(DEVICE, bias), requires_grad=False)
    x = _x(rows, 100, dtype, outliers)
    expected = _own(module, x)
    got = _kernel(module, x)
    assert got.dtype == x.dtype and got.shape == expected.shape
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_outlier_columns_differ_only_by_summation_order(dtype):
    module = _linear8bit(64, 256, bias=dtype)
    x = _x(9, 256, dtype, [(0, 1), (3, 40), (3, 200), (8, 255)])
    expected = _own(module, x)
    got = _kernel(module, x)
    assert not torch.equal(got, _kernel(module, x.clamp(-5.9, 5.9)))  # (the outliers count)
    ulp = torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=4 * ulp)


@pytest.mark.parametrize("rows", [9, 70])
def test_outlier_columns_in_some_k_splits(rows):
    """K = 4,160 splits the GEMM (8 splits of 768 columns at 9 rows; 2 of 2,112 at 70, whose boundary
    cuts a 128-column statistics block): the outlier product is summed per split, and a split whose
    range holds no outlier block is skipped (its sums are never written: read, they would be garbage).
    Outliers on both sides of a cut block, in the K tail, and in one split alone: the module's result
    up to the summation order."""
    dtype = DTYPES[0]
    module = _linear8bit(64, 4160, bias=dtype)
    assert llm_int8._gemm_config(rows, 64, 4160)["SPLIT_K"] == (8 if rows == 9 else 2)
    for outliers in ([(0, 2100), (rows - 1, 2150), (3, 4150)], [(1, 10)]):
        x = _x(rows, 4160, dtype, outliers)
        expected = _own(module, x)
        got = _kernel(module, x)
        assert not torch.equal(got, _kernel(module, x.clamp(-5.9, 5.9)))  # (the outliers count)
        ulp = torch.finfo(dtype).eps * expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=4 * ulp)


def test_no_threshold_is_plain_int8_quantization():
    """threshold 0 (bitsandbytes' option): no outlier columns, values of any size quantized with the rest."""
    dtype = DTYPES[0]
    module = _linear8bit(32, 128, threshold=0.0)
    x = _x(6, 128, dtype, [(2, 5), (4, 60)])
    assert torch.equal(_kernel(module, x), _own(module, x))


@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_rows_marked_not_real_do_not_flag_columns(dtype):
    """A CUDA-graph bucket's padding rows (real = 0): their outliers flag no column, so the real rows
    get the module's result on the real rows alone; with every row real, the padding's outlier column
    changes the real rows' result (the mask is what keeps it out)."""
    module = _linear8bit(40, 128, bias=dtype)
    x = _x(8, 128, dtype, [(1, 10), (6, 90), (7, 20)])
    real = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.int8, device=DEVICE)
    expected = _own(module, x[:6])
    got = _kernel(module, x, real=real)
    assert torch.equal(got[:6], expected), (got[:6] - expected).abs().max()
    assert not torch.equal(_kernel(module, x)[:6], expected)
    assert torch.equal(_kernel(module, x, real=real.bool()), got)


def test_kernel_refuses_what_it_does_not_take():
    module = _linear8bit(16, 64)
    found = bnb_int8(module)
    x = torch.randn(3, 64, device=DEVICE)
    cases = [
        (lambda: llm_int8.llm_int8_linear(x, found.weight.float(), found.scb, 6.0), "int8 weight"),
        (lambda: llm_int8.llm_int8_linear(x[:, :32], found.weight, found.scb, 6.0), "int8 weight"),
        (lambda: llm_int8.llm_int8_linear(x.to(torch.int32), found.weight, found.scb, 6.0), "x in one of"),
        (lambda: llm_int8.llm_int8_linear(x, found.weight, found.scb[:8], 6.0), "row scales"),
        (lambda: llm_int8.llm_int8_linear(x, found.weight, found.scb, 6.1), "fp16 holds exactly"),
        (lambda: llm_int8.llm_int8_linear(x, found.weight, found.scb, -1.0), "threshold >= 0"),
        (lambda: llm_int8.llm_int8_linear(x, found.weight, found.scb, 6.0, torch.ones(8, device=DEVICE)), "bias"),
        (lambda: llm_int8.llm_int8_linear(torch.randn(300, 64, device=DEVICE), found.weight, found.scb, 6.0),
         "rows"),
        (lambda: llm_int8.llm_int8_linear(x, found.weight, found.scb, 6.0, real=torch.ones(2, device=DEVICE)),
         "flags 2 rows"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_which_linear8bit_modules_are_taken():
    """Taken: an inference Linear8bitLt with a threshold fp16 holds (or none). Left to its own forward:
    fp16 weights (trained: quantized at every call), a threshold fp16 rounds, hooks, other classes."""
    assert bnb_int8(_linear8bit(16, 64)).threshold == 6.0
    assert bnb_int8(_linear8bit(16, 64, threshold=0.0)).threshold == 0.0
    assert bnb_int8(_linear8bit(16, 64, threshold=6.1)) is None
    trained = bnb.nn.Linear8bitLt(64, 16, has_fp16_weights=True).to(DEVICE)
    assert bnb_int8(trained) is None
    hooked = _linear8bit(16, 64)
    hooked.register_forward_hook(lambda *args: None)
    assert bnb_int8(hooked) is None
    assert bnb_int8(torch.nn.Linear(64, 16)) is None


def test_routed_int8_linears_cap_the_captured_steps():
    """An engine routing LLM.int8() linears with a threshold captures steps of up to 256 tokens (over
    them the module's own forward runs, which splits its outliers on the host); without a threshold,
    or with no such linears, nothing caps them."""
    from hf_async_cb.model.graph_safety import graph_token_cap

    assert graph_token_cap([_linear8bit(16, 64)]) == 256
    assert graph_token_cap([_linear8bit(16, 64, threshold=0.0)]) is None
    assert graph_token_cap([]) is None


@pytest.fixture
def int8_calls(monkeypatch):
    """Every call of llm_int8_linear from a routed projection: (rows, weight shape, real rows or None)."""
    calls = []
    real_linear = llm_int8.llm_int8_linear

    def counted(x, weight, scb, threshold, bias=None, *, real=None):
        # (inside a CUDA-graph capture the real rows cannot be read back: that would end the capture)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        calls.append((x.numel() // x.shape[-1], tuple(weight.shape),
                      None if real is None else "captured" if capturing else int(real.sum())))
        return real_linear(x, weight, scb, threshold, bias, real=real)

    monkeypatch.setattr(llm_int8, "llm_int8_linear", counted)
    return calls


def test_routed_projection_runs_its_own_forward_where_the_kernel_would_differ(int8_calls):
    """A bias not yet in x's dtype (the module converts it on its first call: that call runs its own
    forward, later ones the kernel); training mode off CUDA (bitsandbytes computes another product
    there); a weight given other storage."""
    module = _linear8bit(32, 64, bias=torch.float16 if DEVICE == "cpu" else torch.float32)
    x = _x(3, 64, torch.float32 if DEVICE == "cpu" else torch.bfloat16, [(0, 9)])
    gemms = DecodeGemms(torch.nn.Sequential(module), None)
    assert "1 bitsandbytes LLM.int8() projections read as int8" in gemms.summary()
    gemms.attach()
    try:
        with torch.no_grad():
            first = module(x)
            assert int8_calls == [] and module.bias.dtype == x.dtype
            assert torch.equal(module(x), first) and int8_calls == [(3, (32, 64), None)]
            if DEVICE == "cpu":
                module.train()
                module(x)
                module.eval()
                assert len(int8_calls) == 1
    finally:
        gemms.detach()


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    """The tiny Llama with an outlier feature, as LLM.int8() meets them in real models: column 3 of every
    token's embedding at 50 (after each norm about 8, at or above the threshold in every row), and the
    embedding of token 0 (a graph bucket's padding token, and stock's left padding) with a column of
    its own at 200, so that padding rows flag another column."""
    path = tmp_path_factory.mktemp("llama_int8")
    model = copy.deepcopy(tiny_model("llama"))  # (tiny_model's models are shared)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 3] = 50.0
        embeddings[0, 11] = 200.0
    model.save_pretrained(path)
    return str(path)


def _int8_model(path: str, dtype=torch.float32) -> torch.nn.Module:
    quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map=DEVICE, dtype=dtype)
    return model.eval()


def test_routed_forward_matches_the_quantized_model(saved_llama, int8_calls):
    model = _int8_model(saved_llama)
    expected, got = routed_logits(model, int8_calls)
    assert len(int8_calls) == model.config.num_hidden_layers * 7 and {rows for rows, *_ in int8_calls} == {18}
    # (most projections see several outlier columns: their fp32 sums in another order)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_engine_greedy_matches_stock(saved_llama, int8_calls):
    """The async loop (the sync one: the padded graph steps' test below)."""
    model = _int8_model(saved_llama)
    assert_engine_greedy_matches_stock(model, "async", int8_calls)


def test_padded_graph_steps_count_only_their_real_rows(saved_llama, int8_calls):
    """With CUDA graphs (on the CPU the same static buffers and padding, run eagerly), a step padded
    to its bucket passes the routed projections the mask of its real rows (the padding's token 0
    would flag a column of its own); the tokens stay stock's."""
    from models import left_pad, random_prompts, stock_generate

    from hf_async_cb import BatchingConfig

    model = _int8_model(saved_llama)
    prompts = random_prompts(3, 2, 20, seed=7)
    expected = stock_generate(model, prompts, max_new_tokens=5)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    config = BatchingConfig(page_size=16, max_batch_tokens=64, skinny_gemm=True, cuda_graphs=True)
    got = model.generate(ids, attention_mask=mask, batching="sync", batching_config=config, max_new_tokens=5)
    assert torch.equal(got.cpu(), expected.cpu())
    padded = [(rows, real) for rows, _, real in int8_calls if real is not None and (real == "captured" or real < rows)]
    # 3 decode rows in a bucket of 4 (prefill steps are padded to theirs too); on CUDA that bucket's first
    # step is captured, where the mask is passed but cannot be read back (the tokens above check it)
    assert (4, 3) in padded or (DEVICE == "cuda" and (4, "captured") in padded)


KERNELS = (llm_int8._int8_stats_kernel, llm_int8._int8_gemm_kernel, llm_int8._int8_finish_kernel)


def test_an_engine_lists_every_launch(monkeypatch, saved_llama):
    """What an engine on an LLM.int8() model hands the precompile covers every launch of the three
    kernels, at several batch sizes."""
    model = _int8_model(saved_llama)
    seen, launched, listed = engine_launches_and_listing(
        monkeypatch, model, KERNELS)
    assert {kernel for kernel, _, _ in seen} == set(KERNELS)
    assert launched <= listed


def test_the_kernels_compile_for_sm90_and_fit_an_h200():
    """The three kernels' launches for Llama-3-8B's projections in bf16 (at the rows buckets 32 and 256, with
    an outlier threshold, with a bias and without) build for an H200 without a GPU (int8 dots, the
    fast division), within its 227 KB of shared memory per block."""
    from sm90 import assert_compiles_for_sm90

    kernels = {}
    for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
        for bucket in (32, 256):
            for bias in (None, torch.bfloat16):
                for v in llm_int8.variants(n, k, torch.bfloat16, bias, True, bucket):
                    fn = getattr(v.kernel, "fn", v.kernel)
                    name, names = fn.__name__, list(inspect.signature(fn).parameters)[:len(v.args)]
                    sig = {a: (_pointer(t) if isinstance(t, torch.dtype) else ("fp32" if isinstance(t, float) else "i32"))
                           for a, t in zip(names, v.args)}
                    # (what a launch's JIT sees 16-divisible: the pointers, and sizes such as the 32 absmax blocks
                    # of K = 4096, with which Triton 3.6 once failed to compile a reduction inside a loop)
                    aligned = [a for a, t in zip(names, v.args)
                               if isinstance(t, torch.dtype) or (type(t) is int and t % 16 == 0)]
                    key = (name, repr(sorted(sig.items())), repr(sorted(v.constexprs.items())))
                    kernels[key] = ("hf_async_cb.kernels.llm_int8", name, sig, v.constexprs,
                                    dict(v.options, divisible_by_16=aligned))
    shared = assert_compiles_for_sm90(list(kernels.values()))
    assert max(shared) <= 232448, max(zip(shared, kernels))


def _pointer(dtype: torch.dtype) -> str:
    return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "i8",
                  torch.int32: "i32"}[dtype]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs are captured on CUDA alone (the CPU runs their stand-in)")
def test_an_int8_model_is_captured_up_to_the_kernels_rows(saved_llama, int8_calls):
    """On CUDA an LLM.int8() model gets CUDA graphs (its own forward could not be captured): steps of up
    to 256 tokens replay graphs through the kernels, larger ones run eagerly; tokens stay stock's."""
    from models import left_pad, random_prompts, stock_generate

    import hf_async_cb
    from hf_async_cb import BatchingConfig
    from hf_async_cb.generate import runtime

    model = _int8_model(saved_llama)
    prompts = random_prompts(5, 2, 30, seed=9)
    expected = stock_generate(model, prompts, max_new_tokens=6)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    got = model.generate(ids, attention_mask=mask, batching="sync", max_new_tokens=6,
                         batching_config=BatchingConfig(page_size=16, skinny_gemm=True))
    graphs = runtime._RUNTIMES.get(model).engine.graphs
    assert graphs is not None and graphs.max_tokens == 256
    assert graphs.num_captured > 0 and graphs.num_replays > 0
    hf_async_cb.release(model)
    assert torch.equal(got.cpu(), expected.cpu())


def test_the_next_call_keeps_the_runtime_and_the_prompts_pages(saved_llama):
    """Each LLM.int8() forward stores its outlier columns in the module's state (a new `idx` tensor a
    call): scratch, not a weight. The next generate call keeps the runtime (no second parity check,
    pool or graphs) and reuses the prompts' pages, with stock's tokens; a write into the int8 weights
    is still seen."""
    import hf_async_cb
    from hf_async_cb.generate import runtime as runtime_module
    from models import left_pad, random_prompts, stock_generate

    model = _int8_model(saved_llama)
    prompts = random_prompts(3, 40, 60, seed=2)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))

    def call():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, batching="sync")
        assert torch.equal(out.cpu(), stock_generate(model, prompts, max_new_tokens=4).cpu())
        return runtime_module._RUNTIMES[model], hf_async_cb.prefix_cache_stats(model)

    first, stats = call()
    hits = stats["hit_tokens"]
    second, stats = call()
    assert second is first and stats["hit_tokens"] >= hits + 3 * 32
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1)  # (int8 codes negated: other tokens)
    call()
    assert hf_async_cb.prefix_cache_stats(model)["clears"] >= 1
    hf_async_cb.release(model)


def test_the_outlier_columns_a_forward_leaves_read_as_no_change(saved_llama):
    """A forward with outliers and one without leave `state.idx` of other lengths (and a new tensor each
    time): the numerics key (the parity verdict's and the prefix cache's), the fingerprint and the
    preparation's signature read the model the same after either."""
    from hf_async_cb.model.kv_fingerprint import kv_fingerprint
    from hf_async_cb.model.numerics_key import numerics_key
    from hf_async_cb.model.prepared import signature

    model = _int8_model(saved_llama)
    q = model.model.layers[0].self_attn.q_proj
    reads, lengths = [], []
    for outliers in ([], [(1, 3), (4, 7)], []):
        _own(q, _x(5, q.in_features, torch.float32, outliers))
        lengths.append(q.state.idx.numel())
        reads.append((numerics_key(model), kv_fingerprint(model, content=True), signature(model)))
    assert lengths[1] > lengths[0] == lengths[2]  # (the state did change)
    assert reads[0] == reads[1] == reads[2]
