"""Attention variants of the paged kernels: Gemma 2's logit softcap, gpt-oss's attention sinks,
value head sizes other than the keys' (DeepSeek's expanded MLA), strided pools, and large GQA
groups / MQA (Falcon's 71 heads on one KV head, groups split over several programs).

Three layers of checks:
- the pure-torch reference against a dense oracle written independently here (per request, in
  float64: repeat the KV heads, matmul, softcap, mask, sinks as a concatenated column, softmax,
  matmul), on the same random steps;
- the Triton kernels against the reference in fp32 (exact dots; on the CPU, Triton's interpreter),
  every variant alone and combined, with windows, prefill / decode / mixed steps and decode
  splits 1 / 2 / 4;
- on CUDA, bf16 at real sizes against the reference in fp32 on the same inputs.
"""

import math

import pytest
import torch
from test_triton_attention import CUDA, RAGGED, launch, make_step, needs_cuda, triton_paged

from hf_async_cb.kernels.paged_attention_reference import _padded_attention, paged_attention_reference

DEVICE = "cuda" if CUDA else "cpu"


def dense_oracle(query, keys, values, meta, scaling=None, window=None, softcap=None, sinks=None, alibi_slopes=None):
    """Attention of a packed step computed request by request, densely, in float64."""
    query, keys, values = query.double(), keys.double(), values.double()
    _, heads, _, head_dim = query.shape
    n_rep = heads // keys.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    starts, contexts = meta.query_start.tolist(), meta.context_lens.tolist()
    page, table = meta.page_size, meta.block_table.cpu()
    outs = []
    for i, ctx in enumerate(contexts):
        q = query[0, :, starts[i]:starts[i + 1]]  # [H, q_len, Dk]
        q_len = q.shape[1]
        t = torch.arange(ctx)
        slots = (table[i, t // page] * page + t % page).to(keys.device)
        k = keys[slots].transpose(0, 1)  # [KVH, ctx, Dk]
        v = values[slots].transpose(0, 1)  # [KVH, ctx, Dv]
        k = k[:, None].expand(-1, n_rep, -1, -1).reshape(heads, ctx, -1)  # repeat_kv
        v = v[:, None].expand(-1, n_rep, -1, -1).reshape(heads, ctx, -1)
        s = torch.matmul(q, k.transpose(1, 2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos = (ctx - q_len + torch.arange(q_len))[:, None]
        if alibi_slopes is not None:  # Bloom's form: slope x key position
            s = s + alibi_slopes.double().to(s.device).view(heads, 1, 1) * t.double().to(s.device)
        allowed = t[None, :] <= pos
        if window is not None:
            allowed &= (pos - t[None, :]) < window
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        if sinks is not None:
            column = sinks.double().to(s.device).view(heads, 1, 1).expand(heads, q_len, 1)
            p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, v).transpose(0, 1))  # [q_len, H, Dv]
    return torch.cat(outs)[None]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_sinks(heads, seed=0, dtype=torch.float32, device=DEVICE):
    """Sink logits of the size of a short row's log-sum-exp, so that they move the output."""
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(heads, generator=g) * 1.5 + 3.0).to(device=device, dtype=dtype)


STEPS = {
    "decode": ([1, 1, 1, 1], [1, 16, 17, 40]),
    "prefill": ([5, 16, 3], [5, 16, 3]),
    "chunk after cached pages": ([7, 1, 20], [30, 100, 20]),
    "mixed decode and chunks": ([1, 9, 1, 33], [64, 40, 129, 50]),
}
VARIANTS = {
    "plain": dict(),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "softcap and sinks": dict(softcap=2.0, sinks=True),
    "alibi": dict(alibi_slopes=True),
}
# (heads, kv_heads, Dk, Dv): MHA; GQA with smaller values; MQA with larger values; odd sizes.
SHAPES = [(4, 4, 16, 16), (8, 2, 24, 16), (4, 1, 16, 40), (6, 2, 80, 48)]


def variant_kwargs(name, heads, seed=0, sink_dtype=torch.float32):
    kw = dict(VARIANTS[name])
    if kw.get("sinks"):
        kw["sinks"] = make_sinks(heads, seed, sink_dtype)
    if kw.get("alibi_slopes"):  # ALiBi's geometric slopes, 2^(-8 i / H)
        kw["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=DEVICE)
    return kw


# -- the reference against the dense oracle ------------------------------------------------------

@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("heads, kv_heads, head_dim, head_dim_v", SHAPES)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("strided", [False, True])
def test_reference_matches_dense_oracle(step, variant, heads, kv_heads, head_dim, head_dim_v, window, strided):
    query_lens, context_lens = STEPS[step]
    q, k, v, meta = make_step(query_lens, context_lens, heads, kv_heads, head_dim, 16, torch.float32, DEVICE,
                              head_dim_v=head_dim_v, strided=strided)
    kw = variant_kwargs(variant, heads)
    out = paged_attention_reference(q, k, v, meta, None, window, **kw)
    assert out.shape == (1, sum(query_lens), heads, head_dim_v) and out.dtype == torch.float32
    assert rel(out, dense_oracle(q, k, v, meta, None, window, **kw)) < 1e-5


@pytest.mark.parametrize("variant", ["softcap", "sinks", "softcap and sinks"])
def test_reference_in_bf16_and_explicit_scaling(variant):
    """bf16 in, bf16 out (the CPU path of a bf16 model), a scaling other than 1 / sqrt(Dk), sinks
    in the model's dtype."""
    q, k, v, meta = make_step(*STEPS["mixed decode and chunks"], 8, 2, 24, 16, torch.bfloat16, DEVICE, head_dim_v=16)
    kw = variant_kwargs(variant, 8, sink_dtype=torch.bfloat16)
    out = paged_attention_reference(q, k, v, meta, 0.3, 8, **kw)
    assert out.dtype == torch.bfloat16
    assert rel(out, dense_oracle(q, k, v, meta, 0.3, 8, **kw)) < 1e-2


# Steps of several query lengths, which the reference pads per group of alike requests: ragged
# queries and contexts at and across the 16-token page boundaries, decodes next to long chunks.
MIXED_STEPS = {
    "decodes around a long chunk": ([1, 1, 40, 1, 1], [17, 160, 40, 33, 16]),
    "chunks at page boundaries": ([16, 1, 17, 15, 2, 1, 32], [32, 16, 49, 15, 18, 1, 64]),
    "chunks after cached pages": ([7, 1, 20, 3, 9], [30, 100, 20, 64, 200]),
}


@pytest.mark.parametrize("step", list(MIXED_STEPS))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("window", [None, 1, 8])
def test_grouped_padding_matches_one_padded_batch(step, variant, window):
    """Padded per group, a mixed step gives the results of one padded batch of the whole step (the
    math before the split) to fp32 rounding, GQA and Dv != Dk included, and the dense oracle's."""
    q, k, v, meta = make_step(*MIXED_STEPS[step], 8, 2, 24, 16, torch.float32, DEVICE, seed=7, head_dim_v=20)
    kw = variant_kwargs(variant, 8)
    grouped = paged_attention_reference(q, k, v, meta, None, window, **kw)
    assert len(meta.padded_groups()) > 1
    whole = _padded_attention(q, k, v, meta, None, window, kw.get("softcap"), kw.get("sinks"), kw.get("alibi_slopes"))
    assert grouped.shape == whole.shape == (1, q.shape[2], 8, 20)
    torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-6)
    assert rel(grouped, dense_oracle(q, k, v, meta, None, window, **kw)) < 1e-5


def test_groups_bound_the_padded_work():
    """60 decodes of 1000-2000 tokens of context next to a 512-token chunk: the groups cover every
    token once, each request of a group is one of the step's, and the padded work is within 4x
    the sum of query length x context length (one padded batch: over 50x). Decode steps are not split
    (no host sync, so that a CUDA graph can capture them)."""
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(1000, 2000, (60,), generator=g).tolist() + [1536]
    query_lens = [1] * 60 + [512]
    *_, meta = make_step(query_lens, contexts, 2, 1, 8, 16, torch.float32, DEVICE)
    groups = meta.padded_groups()
    tokens = torch.cat([t for t, _ in groups])
    assert torch.equal(tokens.sort().values.cpu(), torch.arange(sum(query_lens)))
    needed = sum(ql * c for ql, c in zip(query_lens, contexts))
    padded = sum(group.num_requests * group.max_query_len * group.max_context for _, group in groups)
    assert padded <= 4 * needed and 50 * needed < meta.num_requests * meta.max_query_len * meta.max_context
    for rows, group in groups:
        first = rows[group.query_start[:-1]]  # each request's first token in the whole step
        owner = torch.searchsorted(meta.query_start[1:], first, right=True)
        assert torch.equal(group.context_lens, meta.context_lens[owner])
        assert torch.equal(group.block_table, meta.block_table[owner, :group.block_table.shape[1]])
    decode = make_step([1] * 5, [3, 70, 150, 16, 17], 4, 2, 16, 16, torch.float32, DEVICE)
    paged_attention_reference(*decode, None)
    assert "groups" not in decode[3]._derived


def test_variants_change_the_output():
    """The steps above are ones where a softcap and sinks matter (the checks are not vacuous)."""
    for step in STEPS.values():
        q, k, v, meta = make_step(*step, 8, 2, 24, 16, torch.float32, DEVICE, head_dim_v=16)
        plain = paged_attention_reference(q, k, v, meta, None)
        assert rel(paged_attention_reference(q, k, v, meta, None, softcap=2.0), plain) > 0.05
        assert rel(paged_attention_reference(q, k, v, meta, None, sinks=make_sinks(8)), plain) > 0.05


def test_sink_limits():
    """A -inf sink is no sink; a huge one takes all the weight (output ~ 0); a huge softcap is none."""
    q, k, v, meta = make_step([1, 1, 1], [3, 70, 150], 4, 2, 16, 16, torch.float32, DEVICE)
    plain = paged_attention_reference(q, k, v, meta, None)
    sinks = torch.tensor([float("-inf"), 2.0, float("-inf"), 60.0], device=DEVICE)
    for splits in (1, 2, 4):
        for out in (paged_attention_reference(q, k, v, meta, None, sinks=sinks),
                    triton_paged.paged_attention_triton(q, k, v, meta, None, num_splits=splits, sinks=sinks)):
            assert torch.isfinite(out).all()
            assert rel(out[:, :, 0::2], plain[:, :, 0::2]) < 1e-5
            assert out[:, :, 3].abs().max() < 1e-15
            assert rel(out[:, :, 1], plain[:, :, 1]) > 1e-3
    capped = triton_paged.paged_attention_triton(q, k, v, meta, None, softcap=1e6)
    assert rel(capped, plain) < 1e-5


def test_softcap_zero_is_none_and_bad_arguments_are_refused():
    q, k, v, meta = make_step([1, 3], [5, 3], 4, 2, 16, 16, torch.float32, DEVICE)
    for fn in (paged_attention_reference, triton_paged.paged_attention_triton):
        assert torch.equal(fn(q, k, v, meta, None, softcap=0.0), fn(q, k, v, meta, None))
        for softcap in (-1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="softcap"):
                fn(q, k, v, meta, None, softcap=softcap)
        with pytest.raises(ValueError, match="sinks"):
            fn(q, k, v, meta, None, sinks=torch.zeros(2, device=DEVICE))
        with pytest.raises(ValueError, match="sinks"):
            fn(q, k, v, meta, None, sinks=torch.zeros(4, dtype=torch.long, device=DEVICE))
        with pytest.raises(ValueError, match="do not fit"):
            fn(q, k, v[:, :1], meta, None)
        with pytest.raises(ValueError, match="do not fit"):
            fn(q[..., :8], k, v, meta, None)


# -- the Triton kernels against the reference, fp32 ----------------------------------------------

def triton_vs_reference(step, window=None, splits=None, scaling=None, **kw):
    q, k, v, meta = step
    out = triton_paged.paged_attention_triton(q, k, v, meta, scaling, window, num_splits=splits, **kw)
    ref = paged_attention_reference(q, k, v, meta, scaling, window, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    return rel(out, ref)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", ["softcap", "sinks", "softcap and sinks"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, head_dim_v", [(4, 4, 16, 16), (8, 2, 24, 16)])
@pytest.mark.parametrize("window", [None, 8])
def test_kernel_variants_match_reference_fp32(step, variant, heads, kv_heads, head_dim, head_dim_v, window):
    s = make_step(*STEPS[step], heads, kv_heads, head_dim, 16, torch.float32, DEVICE, head_dim_v=head_dim_v)
    assert triton_vs_reference(s, window, **variant_kwargs(variant, heads)) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim, head_dim_v", [(4, 1, 16, 40), (6, 2, 80, 48), (2, 2, 96, 24)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_value_head_sizes_match_reference_fp32(heads, kv_heads, head_dim, head_dim_v, variant):
    """Dv > Dk, Dv < Dk, sizes that are not powers of two; a mixed step with a window."""
    s = make_step(*STEPS["mixed decode and chunks"], heads, kv_heads, head_dim, 16, torch.float32, DEVICE,
                  head_dim_v=head_dim_v, seed=head_dim)
    assert triton_vs_reference(s, 33, scaling=0.2, **variant_kwargs(variant, heads)) < 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_splits_with_variants(variant, splits):
    """Decode split over the context (more splits than some contexts have blocks), Dv != Dk, with
    and without a window: the sink enters split 0 only, and the merge weighs it right."""
    s = make_step([1, 1, 1], [3, 150, 300], 8, 2, 32, 16, torch.float32, DEVICE, seed=splits, head_dim_v=24)
    kw = variant_kwargs(variant, 8, seed=splits)
    assert triton_vs_reference(s, splits=splits, **kw) < 1e-5
    assert triton_vs_reference(s, 50, splits=splits, **kw) < 1e-5


def test_strided_pools_give_the_same_results():
    """Pools as views of other layouts (keys x[0].transpose(0, 1) of [1, KVH, slots, D], values the
    front of a wider buffer): both implementations give exactly the contiguous pools' results."""
    args = ([1, 9, 1, 33], [64, 40, 129, 50], 8, 2, 24, 16, torch.float32, DEVICE)
    q, k, v, meta = make_step(*args, head_dim_v=16)
    _, ks, vs, _ = make_step(*args, head_dim_v=16, strided=True)
    slots = k.shape[0]
    assert ks.stride() == (24, slots * 24, 1) and vs.stride() == (21, slots * 21, 1)
    assert torch.equal(ks, k) and torch.equal(vs, v)
    kw = dict(softcap=2.0, sinks=make_sinks(8))
    for window in (None, 8):
        assert torch.equal(paged_attention_reference(q, ks, vs, meta, None, window, **kw),
                           paged_attention_reference(q, k, v, meta, None, window, **kw))
        assert torch.equal(triton_paged.paged_attention_triton(q, ks, vs, meta, None, window, **kw),
                           triton_paged.paged_attention_triton(q, k, v, meta, None, window, **kw))
    decode = make_step([1, 1, 1], [3, 150, 300], 8, 2, 24, 16, torch.float32, DEVICE, head_dim_v=16, strided=True)
    assert triton_vs_reference(decode, splits=4, **kw) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim, head_dim_v, chunks", [
    (71, 1, 16, 16, 1),  # Falcon-7B's MQA: one program of 128 rows for 71 heads
    (131, 1, 16, 16, 2),  # more than 128 heads per KV head: two programs of 66 and 65 heads
    (80, 2, 16, 16, 1),  # a group of 40 per KV head
    (80, 1, 136, 24, 2),  # a head size over 128: at most 64 rows, two programs of 40 heads
])
def test_large_groups_and_mqa(heads, kv_heads, head_dim, head_dim_v, chunks):
    assert launch.tile_shape(heads // kv_heads, head_dim, head_dim_v)["chunks"] == chunks
    kw = dict(softcap=2.0, sinks=make_sinks(heads))
    s = make_step([1, 1], [5, 70], heads, kv_heads, head_dim, 16, torch.float32, DEVICE, head_dim_v=head_dim_v)
    assert triton_vs_reference(s) < 1e-5
    assert triton_vs_reference(s, 20, splits=2, **kw) < 1e-5
    s = make_step([3, 2], [3, 20], heads, kv_heads, head_dim, 16, torch.float32, DEVICE, head_dim_v=head_dim_v)
    assert triton_vs_reference(s, **kw) < 1e-5


def test_tiles_cover_every_group():
    """Every group size maps onto programs whose valid rows cover it exactly once, in tiles of at
    most 128 rows (64 for head sizes over 128), never more programs than needed."""
    for head_dim, head_dim_v in [(64, 64), (128, 128), (192, 128), (256, 256), (80, 24)]:
        limit = 128 if max(head_dim, head_dim_v) <= 128 else 64
        for group in range(1, 300):
            for query_len in (1, 63, 64, 8192):
                t = launch.tile_shape(group, head_dim, head_dim_v, query_len)
                assert t["chunks"] * t["heads"] >= group > (t["chunks"] - 1) * t["heads"]
                assert t["chunks"] == -(-group // limit)
                assert t["block_q"] * t["heads"] <= t["block_m"] <= max(16, limit)
                assert t["block_m"] & (t["block_m"] - 1) == 0
                if query_len >= launch.TALL_TILE_QUERY_LEN and group <= 16:  # prefill: 64-row tiles
                    assert t["block_m"] == 64 and t["block_q"] == 64 // t["heads"]
                elif group <= 16:
                    assert t["block_m"] == 16


def test_launch_defaults_fit_shared_memory():
    """The default launches fit the H200's shared memory (by the generous estimate) for every head
    size up to 256 and tile up to 128 rows; the measured 16-bit choices for small tiles stand."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (16, 32, 64, 80, 96, 128, 192, 256):
            for head_dim_v in {head_dim, 16, 128, 256}:
                for block_m in (16, 32, 64, 128):
                    t = launch.launch_defaults(head_dim, dtype, head_dim_v, block_m)
                    bd = max(16, 1 << (head_dim - 1).bit_length())
                    bdv = max(16, 1 << (head_dim_v - 1).bit_length())
                    smem = launch.shared_memory_estimate(block_m, bd, bdv, t["block_n"],
                                                               t.get("num_stages", 3), dtype.itemsize)
                    assert smem <= launch.SHARED_MEMORY_BUDGET, (dtype, head_dim, head_dim_v, block_m, t)
    assert launch.launch_defaults(64, torch.bfloat16) == dict(block_n=64, num_warps=2, num_stages=2)
    assert launch.launch_defaults(128, torch.bfloat16) == dict(block_n=128, num_warps=4, num_stages=2)
    assert launch.launch_defaults(128, torch.bfloat16, decode=True) == dict(block_n=64, num_warps=2, num_stages=2,
                                                                                   early_loads=False)
    assert launch.launch_defaults(64, torch.bfloat16, decode=True)["early_loads"]
    assert launch.launch_defaults(64, torch.float32) == dict(block_n=64)


# -- CUDA: real sizes in bf16 --------------------------------------------------------------------

def bf16_error(step, window=None, splits=None, scaling=None, **kw):
    """Triton in bf16 against the reference in fp32 on the same (bf16) numbers; sinks as given."""
    q, k, v, meta = step
    out = triton_paged.paged_attention_triton(q, k, v, meta, scaling, window, num_splits=splits, **kw)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, scaling, window, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    return rel(out.float(), ref)


PREFILL = ([1, 64, 200, 17, 300, 1], [900, 64, 700, 17, 2048, 33])


@needs_cuda
@pytest.mark.parametrize("group", [1, 4])
def test_bf16_softcap_with_window(group):
    decode = make_step([1] * len(RAGGED), RAGGED, 8 * group, 8, 128, 16, torch.bfloat16, "cuda", seed=group)
    prefill = make_step(*PREFILL, 8 * group, 8, 128, 16, torch.bfloat16, "cuda", seed=group)
    for step in (decode, prefill):
        q, k, v, meta = step
        plain = paged_attention_reference(q.float(), k.float(), v.float(), meta, 0.5, 256)
        capped = paged_attention_reference(q.float(), k.float(), v.float(), meta, 0.5, 256, softcap=50.0)
        assert rel(capped, plain) > 1e-2  # the cap bites at these scores
        assert bf16_error(step, 256, scaling=0.5, softcap=50.0) < 1e-2
        assert bf16_error(step, None, scaling=0.5, softcap=50.0) < 1e-2
    assert bf16_error(decode, 256, splits=4, scaling=0.5, softcap=50.0) < 1e-2


@needs_cuda
@pytest.mark.parametrize("window", [None, 128])
def test_bf16_sinks(window):
    """gpt-oss-like: 64 heads on 8 KV heads of 64, bf16 sinks, alternating windows of 128."""
    sinks = make_sinks(64, dtype=torch.bfloat16, device="cuda")
    decode = make_step([1] * len(RAGGED), RAGGED, 64, 8, 64, 16, torch.bfloat16, "cuda", seed=3)
    prefill = make_step(*PREFILL, 64, 8, 64, 16, torch.bfloat16, "cuda", seed=4)
    assert bf16_error(decode, window, sinks=sinks) < 1e-2
    assert bf16_error(decode, window, splits=8, sinks=sinks) < 1e-2
    assert bf16_error(prefill, window, sinks=sinks) < 1e-2
    q, k, v, meta = prefill
    assert rel(paged_attention_reference(q.float(), k.float(), v.float(), meta, None, window, sinks=sinks),
               paged_attention_reference(q.float(), k.float(), v.float(), meta, None, window)) > 1e-2


@needs_cuda
@pytest.mark.parametrize("heads, kv_heads, head_dim, head_dim_v, splits", [
    (16, 16, 192, 128, 4),  # DeepSeek MLA expanded: keys of 192, values of 128
    (71, 1, 64, 64, 1),  # Falcon-7B: 71 query heads on one KV head
], ids=["mla", "mqa-71"])
def test_bf16_head_layouts(heads, kv_heads, head_dim, head_dim_v, splits):
    decode = make_step([1] * len(RAGGED), RAGGED, heads, kv_heads, head_dim, 16, torch.bfloat16, "cuda",
                       seed=heads, head_dim_v=head_dim_v)
    prefill = make_step(*PREFILL, heads, kv_heads, head_dim, 16, torch.bfloat16, "cuda", seed=heads + 1,
                        head_dim_v=head_dim_v)
    assert bf16_error(decode) < 1e-2
    assert bf16_error(decode, splits=splits) < 1e-2
    assert bf16_error(prefill) < 1e-2
    assert bf16_error(prefill, 256) < 1e-2


@needs_cuda
@pytest.mark.parametrize("window", [None, 256])
def test_bf16_gemma2_like(window):
    """Gemma 2-like: 8 heads on 4 KV heads of 256, softcap 50, scaling 256 ** -0.5, windows on
    alternate layers."""
    decode = make_step([1] * len(RAGGED), RAGGED, 8, 4, 256, 16, torch.bfloat16, "cuda", seed=9)
    prefill = make_step(*PREFILL, 8, 4, 256, 16, torch.bfloat16, "cuda", seed=10)
    assert bf16_error(decode, window, scaling=256 ** -0.5, softcap=50.0) < 1e-2
    assert bf16_error(decode, window, splits=2, scaling=256 ** -0.5, softcap=50.0) < 1e-2
    assert bf16_error(prefill, window, scaling=256 ** -0.5, softcap=50.0) < 1e-2


@needs_cuda
@pytest.mark.parametrize("heads, kv_heads, head_dim, head_dim_v", [(128, 1, 128, 128), (160, 1, 64, 64),
                                                                   (96, 1, 256, 256)])
def test_bf16_large_groups(heads, kv_heads, head_dim, head_dim_v):
    """MQA with many heads: 128 in one program of 128 rows; 160 in two of 80; 96 of head size 256
    in two of 48 (with sinks and a softcap, all variants together)."""
    decode = make_step([1] * len(RAGGED), RAGGED, heads, kv_heads, head_dim, 16, torch.bfloat16, "cuda",
                       head_dim_v=head_dim_v)
    prefill = make_step(*PREFILL, heads, kv_heads, head_dim, 16, torch.bfloat16, "cuda", head_dim_v=head_dim_v)
    kw = dict(softcap=30.0, sinks=make_sinks(heads, dtype=torch.bfloat16, device="cuda"))
    assert bf16_error(decode) < 1e-2
    assert bf16_error(decode, 512, **kw) < 1e-2
    assert bf16_error(prefill, 512, **kw) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU end-to-end run of the interpreted kernels")
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "falcon"])
def test_engine_with_the_variants_in_triton_matches_stock(model_type):
    """Softcapping with sliding windows (Gemma 2), sinks with sliding windows (gpt-oss), multi-query
    (Falcon): the whole engine on the Triton kernels (interpreted), chunked prefill and a small pool
    included, gives stock's greedy tokens."""
    from family_sweep import GENERATE, prompts_for
    from model_configs import tiny_model as sweep_model

    from hf_async_cb import BatchingConfig, Engine

    model, _ = sweep_model(model_type)
    ids, mask = prompts_for(model_type, 256)
    expected = model.generate(ids, attention_mask=mask, batching="off", **GENERATE)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    engine = Engine(model, BatchingConfig(mode="async", attention="triton", page_size=8, num_pages=24,
                                          max_batch_tokens=16))
    outs = engine.generate(prompts, max_new_tokens=GENERATE["max_new_tokens"], eos_token_ids=())  # GENERATE: no EOS
    assert [o.output_token_ids for o in outs] == expected[:, ids.shape[1]:].tolist()


def test_attention_variants_compile_for_sm90():
    """Every variant flag at once (window, softcap, sinks, ALiBi, Dv != Dk, splits) and MLA-sized
    bf16 tiles compile for an H200 without a GPU (CI has none)."""
    from sm90 import assert_compiles_for_sm90

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "new_k_ptr", "new_v_ptr")}
    pointers.update({n: "*fp32" for n in ("m_ptr", "l_ptr", "sinks_ptr", "slopes_ptr")})
    pointers.update({n: "*i64" for n in ("block_table_ptr", "query_start_ptr", "context_lens_ptr", "slot_ptr",
                                         "kv_start_ptr")})
    scalars = {"qk_scale": "fp32", "cap_log2": "fp32", "window": "i32", "num_seqs": "i32", "num_splits": "i32"}
    strides = {n: "i64" for n in ("stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_os stride_ot "
                                  "stride_oh stride_ms stride_mt stride_bt stride_nkt stride_nkh stride_nvt "
                                  "stride_nvh").split()}
    signature = {**pointers, **scalars, **strides}
    variants = dict(PAGE=16, HEAD_DIM=192, BLOCK_D=256, HEAD_DIM_V=128, BLOCK_DV=128, GROUP=16, HEADS=16, CHUNKS=1,
                    BLOCK_Q=1, BLOCK_M=16, BLOCK_N=32, SPLIT=True, ALIGNED_INPUTS=True, HAS_WINDOW=True, HAS_SOFTCAP=True,
                    HAS_SINKS=True, HAS_ALIBI=True, IEEE=False, KV_START=False)
    plain = dict(HAS_WINDOW=False, HAS_ALIBI=False, HAS_SOFTCAP=False, HAS_SINKS=False)  # prefill's unmasked loop
    assert_compiles_for_sm90([("hf_async_cb.kernels.paged_attention", "_paged_attention_kernel", signature,
                               dict(variants, DECODE=decode, NEW_KV=new, EARLY_LOADS=early, HEADS_FIRST=first, **more))
                              for decode, new, early, first, more in (
                                  (False, False, False, False, {}), (True, False, True, True, {}),
                                  (True, True, False, False, {}), (True, True, True, False, {}),
                                  (True, True, False, False, dict(KV_START=True, HAS_WINDOW=False, HAS_ALIBI=False)),
                                  (False, False, False, True, plain), (False, False, False, False, dict(plain, BLOCK_M=64)))],
                             options={"num_warps": 4, "num_stages": 1})
