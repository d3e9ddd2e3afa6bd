"""The Triton paged-attention kernels against the pure-torch reference (the oracle).

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1): small
shapes, exact fp32 agreement, and the engine end to end against stock generate. On CUDA: bf16 at
real sizes (GQA 1/4/8, head dims 64/128, page sizes 16/32/64, ragged lengths at and across page
boundaries, 8K+ contexts, chunked prefill, sliding windows, split contexts), by relative error
against the reference computed in fp32 on the same inputs.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton_paged = pytest.importorskip("hf_async_cb.kernels.paged_attention",
                                   reason="Triton is not installed (pip install -e '.[test]')")
launch = pytest.importorskip("hf_async_cb.kernels.attention_launch")

from models import generated_rows, random_prompts, stock_generate, tiny_model  # noqa: E402

from hf_async_cb import BatchingConfig, Engine  # noqa: E402
from hf_async_cb.kernels.paged_attention_reference import paged_attention_reference  # noqa: E402
from hf_async_cb.model.attention import resolve_backend  # noqa: E402
from hf_async_cb.model.kv_cache import PagedKVCache  # noqa: E402
from hf_async_cb.model.step_metadata import StepMetadata, block_table  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (real-size bf16 kernel checks)")


def make_step(query_lens, context_lens, heads, kv_heads, head_dim, page_size, dtype, device, seed=0,
              head_dim_v=None, strided=False):
    """A random packed step over a shuffled page pool: (query, key pool, value pool, metadata).

    Values have head size `head_dim_v` (default: head_dim). With `strided`, the pools hold the same
    numbers as without, as views of other layouts (only the last dimension dense): the keys as
    [1, KVH, slots, Dk] seen through x[0].transpose(0, 1), the values as the front of a wider,
    head-major buffer, so that the two pools' strides differ from each other and from contiguous."""
    head_dim_v = head_dim_v or head_dim
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // page_size) for c in context_lens]
    num_pages = sum(need) + 2
    order = torch.randperm(num_pages, generator=g).tolist()
    pages, used = [], 0
    for n in need:
        pages.append(order[used:used + n])
        used += n
    max_context = -(-max(context_lens) // 64) * 64
    width = -(-max_context // page_size)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    total = starts[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    meta = StepMetadata(
        slot_mapping=torch.zeros(total, dtype=torch.long, device=device),
        block_table=torch.from_numpy(block_table(pages, context_lens, page_size, width)).to(device),
        query_start=torch.tensor(starts, device=device), context_lens=torch.tensor(context_lens, device=device),
        page_size=page_size, max_query_len=max(query_lens), max_context=max_context, backend="triton",
    )
    slots = num_pages * page_size
    query, keys, values = rand(1, heads, total, head_dim), rand(slots, kv_heads, head_dim), \
        rand(slots, kv_heads, head_dim_v)
    if strided:
        keys = keys.transpose(0, 1).contiguous()[None][0].transpose(0, 1)
        wide = torch.zeros(kv_heads, slots, head_dim_v + 5, dtype=dtype, device=device)
        wide[..., :head_dim_v] = values.transpose(0, 1)
        values = wide.transpose(0, 1)[..., :head_dim_v]
    return query, keys, values, meta


def relative_error(query, keys, values, meta, window=None, splits=None, tuning=None):
    out = triton_paged.paged_attention_triton(query, keys, values, meta, None, window, num_splits=splits,
                                              tuning=tuning)
    ref = paged_attention_reference(query.float(), keys.float(), values.float(), meta, None, window)
    assert out.shape == ref.shape and out.dtype == query.dtype
    return ((out.float() - ref).norm() / ref.norm()).item()


# -- CPU (interpreter) and CUDA: small shapes, fp32, against the reference -----------------------

SMALL = {
    "decode": ([1, 1, 1, 1], [1, 16, 17, 40]),
    "prefill": ([5, 16, 3], [5, 16, 3]),
    "chunk after cached pages": ([7, 1, 20], [30, 100, 20]),
    "mixed decode and chunks": ([1, 9, 1, 33], [64, 40, 129, 50]),
}


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (4, 1, 32), (8, 2, 24)])
@pytest.mark.parametrize("window", [None, 8])
def test_kernel_matches_reference_fp32(name, heads, kv_heads, head_dim, window):
    device = "cuda" if CUDA else "cpu"
    query_lens, context_lens = SMALL[name]
    step = make_step(query_lens, context_lens, heads, kv_heads, head_dim, 16, torch.float32, device)
    assert relative_error(*step, window=window) < 1e-5


@pytest.mark.parametrize("name", ["prefill", "chunk after cached pages", "mixed decode and chunks"])
@pytest.mark.parametrize("block_q", [3, 8, 32])
def test_taller_query_tiles_match_reference(name, block_q):
    """Prefill tiles of more query tokens per program (tuning block_q; a group of 2 heads, so
    tiles of 16, 16 and 64 rows) are as exact, whatever the tokens left over at a request's end."""
    device = "cuda" if CUDA else "cpu"
    query_lens, context_lens = SMALL[name]
    step = make_step(query_lens, context_lens, 4, 2, 16, 16, torch.float32, device, seed=block_q)
    assert relative_error(*step, tuning=dict(block_q=block_q)) < 1e-5
    assert relative_error(*step, window=8, tuning=dict(block_q=block_q)) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim, splits", [(5, 1, 96, 4), (6, 2, 32, 3), (8, 8, 16, 16)])
def test_split_decode_contexts_merge_to_the_reference(heads, kv_heads, head_dim, splits):
    """Decode contexts split over up to the most programs, with head counts and sizes that are not powers
    of two and rows whose later splits hold no keys, merge exactly."""
    device = "cuda" if CUDA else "cpu"
    step = make_step([1, 1, 1], [300, 17, 129], heads, kv_heads, head_dim, 16, torch.float32, device, seed=heads)
    assert relative_error(*step, splits=splits) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(71, 1, 64), (160, 1, 64), (80, 1, 256), (32, 32, 80)],
                         ids=["falcon-7b", "160-on-one", "80-of-256-on-one", "phi-2"])
@pytest.mark.parametrize("name", ["decode", "mixed decode and chunks"])
def test_large_query_groups_and_odd_head_sizes_match_reference(name, heads, kv_heads, head_dim):
    """Groups of more query heads per KV head than one program's tile holds (split over programs
    past 128, 64 for head sizes over 128) and a head size that is no power of two."""
    device = "cuda" if CUDA else "cpu"
    query_lens, context_lens = SMALL[name]
    step = make_step(query_lens, context_lens, heads, kv_heads, head_dim, 16, torch.float32, device)
    assert relative_error(*step) < 1e-5


LONG = {  # steps with a query of TALL_TILE_QUERY_LEN tokens or more: tall tiles by default
    "prompts": ([70, 64, 131], [70, 64, 131]),
    "chunks after cached pages, with decodes": ([1, 96, 1, 65], [300, 257, 64, 200]),
}


@pytest.mark.parametrize("name", list(LONG))
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "alibi", "sinks"])
def test_long_queries_take_tall_tiles_and_match_reference(name, variant):
    """A step with a long query takes 64-row tiles (16 tokens x 4 heads here), and its keys before a
    tile's first query go through the loop without the causal mask (several 16-key blocks per
    tile): as exact as the 16-row tiles, with every variant the mask or the scores carry."""
    device = "cuda" if CUDA else "cpu"
    query_lens, context_lens = LONG[name]
    query, keys, values, meta = make_step(query_lens, context_lens, 8, 2, 16, 16, torch.float32, device, seed=3)
    assert launch.tile_shape(4, 16, 16, meta.max_query_len)["block_m"] == 64
    kw = {"window": dict(sliding_window=40), "softcap": dict(softcap=5.0),
          "alibi": dict(alibi_slopes=torch.linspace(0.05, 0.5, 8, device=device)),
          "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8, device=device))}.get(variant, {})
    window = kw.pop("sliding_window", None)
    out = triton_paged.paged_attention_triton(query, keys, values, meta, None, window, tuning=dict(block_n=16), **kw)
    ref = paged_attention_reference(query, keys, values, meta, None, window, **kw)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("splits", [1, 2])
def test_early_loads_match_reference(name, splits):
    """The key loop with each block's K/V and the next block's pages loaded up front (the decode
    default for head sizes up to 64) is as exact, windowed or not, split or not."""
    device = "cuda" if CUDA else "cpu"
    query_lens, context_lens = SMALL[name]
    step = make_step(query_lens, context_lens, 4, 2, 16, 16, torch.float32, device, seed=11)
    tuning = dict(early_loads=True, block_n=16)  # several blocks per request, so the prefetch carries over
    splits = splits if max(query_lens) == 1 else None
    assert relative_error(*step, splits=splits, tuning=tuning) < 1e-5
    assert relative_error(*step, window=8, splits=splits, tuning=tuning) < 1e-5


@pytest.mark.parametrize("name", [*SMALL, *LONG])
@pytest.mark.parametrize("splits", [1, 2])
def test_heads_first_grid_matches_reference(name, splits):
    """The grid with a request's KV heads on the first axis (tuning heads_first) covers every
    (query block, head, split) once, as the default order does: decode, prefill, tall tiles."""
    device = "cuda" if CUDA else "cpu"
    query_lens, context_lens = {**SMALL, **LONG}[name]
    step = make_step(query_lens, context_lens, 8, 2, 16, 16, torch.float32, device, seed=5)
    splits = splits if max(query_lens) == 1 else None
    assert relative_error(*step, splits=splits, tuning=dict(heads_first=True, block_n=16)) < 1e-5
    assert relative_error(*step, window=8, splits=splits, tuning=dict(heads_first=True)) < 1e-5


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_contexts_merge_exactly(splits):
    """Decode split over the context (more splits than some contexts have blocks) == unsplit."""
    device = "cuda" if CUDA else "cpu"
    step = make_step([1, 1, 1], [3, 150, 300], 4, 2, 32, 16, torch.float32, device, seed=splits)
    assert relative_error(*step, splits=splits) < 1e-5
    assert relative_error(*step, window=50, splits=splits) < 1e-5


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, window", [(4, 2, None), (8, 1, 8)])
def test_decode_stores_the_new_kv_and_attends_with_it(splits, heads, kv_heads, window, early):
    """new_kv: the step's K/V, not in the pools yet (their slots hold garbage), are stored at the
    step's slots by the kernel and used for the newest key: the reference's result over the pools
    with them in, and those pools afterwards."""
    device = "cuda" if CUDA else "cpu"
    query, keys, values, meta = make_step([1, 1, 1], [5, 40, 17], heads, kv_heads, 16, 8, torch.float32, device,
                                          seed=splits)
    page = meta.page_size
    ends = (meta.context_lens - 1).tolist()
    slots = [int(meta.block_table[i, e // page]) * page + e % page for i, e in enumerate(ends)]
    meta.slot_mapping = torch.tensor(slots, device=device)
    g = torch.Generator().manual_seed(7)
    new_k = torch.randn(1, kv_heads, 3, 16, generator=g).to(device)
    new_v = torch.randn(1, kv_heads, 3, 16, generator=g).to(device)
    full_k, full_v = keys.clone(), values.clone()
    full_k[slots], full_v[slots] = new_k[0].transpose(0, 1), new_v[0].transpose(0, 1)
    keys[slots], values[slots] = float("nan"), float("nan")  # what the pools hold before the store
    expected = paged_attention_reference(query, full_k, full_v, meta, None, window)
    got = triton_paged.paged_attention_triton(query, keys, values, meta, None, window, num_splits=splits,
                                              new_kv=(new_k, new_v), tuning=dict(early_loads=early, block_n=16))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys, full_k) and torch.equal(values, full_v)
    prefill = make_step([2], [2], heads, kv_heads, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="decode steps only"):
        triton_paged.paged_attention_triton(*prefill, None, new_kv=(new_k[:, :, :2], new_v[:, :, :2]))


@settings(max_examples=12, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([4, 16, 32]), group=st.sampled_from([1, 2, 4]))
def test_random_steps_match_reference(data, page_size, group):
    """Random ragged steps: each request a decode token or a prefill chunk over cached pages."""
    n = data.draw(st.integers(1, 5))
    query_lens = data.draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    context_lens = [q + data.draw(st.integers(0, 90)) for q in query_lens]
    window = data.draw(st.sampled_from([None, 1, 7, 33]))
    device = "cuda" if CUDA else "cpu"
    step = make_step(query_lens, context_lens, 2 * group, 2, 16, page_size, torch.float32, device)
    assert relative_error(*step, window=window) < 1e-5


def test_backend_choice():
    assert resolve_backend("reference", torch.device("cpu")) == "reference"
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    if CUDA:
        assert resolve_backend("auto", torch.device("cuda")) == "triton"
        assert resolve_backend("triton", torch.device("cuda")) == "triton"
    else:
        assert resolve_backend("triton", torch.device("cpu")) == "triton"  # the interpreter (conftest)


def test_forcing_triton_without_a_way_to_run_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_paged, "runs_on", lambda device: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.skipif(CUDA, reason="the CPU end-to-end run of the interpreted kernels (CUDA runs test_gpu.py)")
@pytest.mark.parametrize("family, graphs, head_major, mode", [
    ("llama", False, False, "sync"), ("mistral", True, False, "async"), ("gpt2", False, True, "async"),
    ("qwen3", True, True, "sync")])
def test_engine_with_triton_attention_matches_stock(family, graphs, head_major, mode, monkeypatch):
    """Chunked prefill, a small pool (preemption), padded graph buckets, either pool layout, each
    loop with and without graphs (the kernels are the same in both loops; each pairing interpreted
    costs ~15 s of CI): every token is stock's."""
    monkeypatch.setattr(PagedKVCache, "HEAD_MAJOR", head_major)
    model = tiny_model(family)
    prompts = random_prompts(6, 3, 60, seed=11)
    expected = stock_generate(model, prompts, max_new_tokens=8, eos_token_id=[2], pad_token_id=0)
    engine = Engine(model, BatchingConfig(mode=mode, attention="triton", cuda_graphs=graphs, page_size=8,
                                          num_pages=40, max_batch_tokens=40))
    fused_stores = []
    real = triton_paged.paged_attention_triton

    def counted(*args, new_kv=None, **kwargs):
        fused_stores.append(new_kv is not None)
        return real(*args, new_kv=new_kv, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_paged, "paged_attention_triton", counted)
        outs = engine.generate(prompts, max_new_tokens=8, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == generated_rows(expected, max(map(len, prompts)), 0, (2,))
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert any(fused_stores) and not all(fused_stores)  # decode steps stored K/V in the kernel, prefill not


# -- CUDA: real sizes in bf16 --------------------------------------------------------------------

RAGGED = [1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 2049]


@needs_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_bf16_decode_ragged(group, head_dim, page_size):
    kv_heads = 8 if group < 8 else 4
    step = make_step([1] * len(RAGGED), RAGGED, kv_heads * group, kv_heads, head_dim, page_size,
                     torch.bfloat16, "cuda", seed=group + head_dim + page_size)
    assert relative_error(*step) < 1e-2


@needs_cuda
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [None, 4])
def test_bf16_decode_with_new_kv_is_store_then_attend(group, head_dim, splits):
    """The decode kernel taking the step's K/V (storing them itself, many programs at once) gives what
    a store followed by the plain kernel gives (the same tiles: equal but for a rounding of the
    compiled variant's schedule), and leaves exactly the same pools."""
    from hf_async_cb.kernels.store_kv import store_kv

    kv_heads = 8
    query, keys, values, meta = make_step([1] * len(RAGGED), RAGGED, kv_heads * group, kv_heads, head_dim, 16,
                                          torch.bfloat16, "cuda", seed=group + head_dim)
    page = meta.page_size
    meta.slot_mapping = torch.tensor([int(meta.block_table[i, (c - 1) // page]) * page + (c - 1) % page
                                      for i, c in enumerate(RAGGED)], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    new_k = torch.randn(1, kv_heads, len(RAGGED), head_dim, device="cuda", generator=g).to(torch.bfloat16)
    new_v = torch.randn(1, kv_heads, len(RAGGED), head_dim, device="cuda", generator=g).to(torch.bfloat16)
    stored_k, stored_v = keys.clone(), values.clone()
    store_kv(stored_k, stored_v, new_k, new_v, meta.slot_mapping)
    expected = triton_paged.paged_attention_triton(query, stored_k, stored_v, meta, None, num_splits=splits)
    got = triton_paged.paged_attention_triton(query, keys, values, meta, None, num_splits=splits,
                                              new_kv=(new_k, new_v))
    assert (got.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()
    assert torch.equal(keys, stored_k) and torch.equal(values, stored_v)


@needs_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_chunked_prefill(group, head_dim):
    query_lens = [1, 64, 200, 17, 512, 1]
    context_lens = [900, 64, 700, 17, 4096, 33]
    step = make_step(query_lens, context_lens, 4 * group, 4, head_dim, 16, torch.bfloat16, "cuda")
    assert relative_error(*step) < 1e-2
    assert relative_error(*step, window=256) < 1e-2


@needs_cuda
@pytest.mark.parametrize("context", [8192, 16384])
def test_bf16_long_contexts_split_and_whole(context):
    step = make_step([1, 1, 1, 1], [context, context - 1, 17, context // 2 + 3], 32, 8, 128, 16,
                     torch.bfloat16, "cuda", seed=context)
    assert launch.choose_splits(step[3], 8, torch.device("cuda")) > 1
    assert relative_error(*step) < 1e-2
    assert relative_error(*step, splits=1) < 1e-2
