"""Decode attention that reads a shared prefix once per group of rows (kernels/shared_prefix_attention.py)
and the host's choice of those groups (engine/shared_prefix_groups.py), against the reference
attention (which reads every row's context whole) and stock generate.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import generated_rows, random_prompts, scaled, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine import shared_prefix_groups as groups_module
from hf_async_cb.engine.shared_prefix_groups import shared_prefix_groups
from hf_async_cb.kernels import paged_attention as triton_paged
from hf_async_cb.kernels import shared_prefix_attention as shared_kernel
from hf_async_cb.kernels.paged_attention_reference import paged_attention_reference
from hf_async_cb.kernels.shared_prefix_attention import MAX_GROUP_ROWS, MIN_SHARED_TOKENS
from hf_async_cb.model.step_metadata import StepMetadata, block_table

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def pages_of(layout: list[tuple[int, int]], page: int, seed: int = 0) -> tuple[list[list[int]], list[int], int]:
    """Rows as (group id or -1 for a row alone, own pages after the prefix), group g's prefix the
    fewest pages that pay plus g: page lists, context lengths (each row's last page partly filled),
    and the pool's page count. Pages drawn from a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    prefix_pages = {gid: -(-MIN_SHARED_TOKENS // page) + gid for gid, _ in layout if gid >= 0}
    total = sum(prefix_pages.values()) + sum(own for _, own in layout) + 2
    order = torch.randperm(total, generator=g).tolist()
    prefixes = {}
    for gid, n in prefix_pages.items():
        prefixes[gid], order = order[:n], order[n:]
    lists, lens = [], []
    for gid, own in layout:
        mine, order = order[:own], order[own:]
        row = (prefixes[gid] if gid >= 0 else []) + mine
        lists.append(row)
        lens.append((len(row) - 1) * page + 1 + int(torch.randint(0, page, (1,), generator=g)))
    return lists, lens, total


def decode_step(lists, lens, page, total, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    width = -(-max(lens) // 64) * 64 // page
    table = block_table(lists, lens, page, width)
    meta = StepMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long, device=DEVICE),
                        block_table=torch.from_numpy(table).to(DEVICE),
                        query_start=torch.arange(len(lens) + 1, device=DEVICE),
                        context_lens=torch.tensor(lens, device=DEVICE), page_size=page, max_query_len=1,
                        max_context=width * page, backend="triton")
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)  # noqa: E731
    query = rand(1, heads, len(lens), head_dim)
    keys, values = rand(total * page, kv_heads, head_dim), rand(total * page, kv_heads, head_dim)
    return query, keys, values, meta, table


def grouped(meta: StepMetadata, table: np.ndarray) -> StepMetadata:
    groups = shared_prefix_groups(table, meta.context_lens.cpu().numpy(), len(table), meta.page_size)
    assert groups is not None
    meta.group_start, meta.group_rows, meta.shared_len = (torch.from_numpy(a).to(DEVICE) for a in groups[:3])
    return meta


# -- the host's groups ---------------------------------------------------------------------------

def test_rows_without_shared_pages_are_not_grouped():
    lists, lens, _ = pages_of([(-1, 9), (-1, 12), (-1, 10)], 16)
    assert shared_prefix_groups(block_table(lists, lens, 16, 16), np.array(lens), 3, 16) is None


def test_adjacent_rows_with_the_same_first_pages_form_groups():
    page = 16
    lists, lens, _ = pages_of([(0, 2), (0, 3), (0, 1), (-1, 9), (1, 2), (1, 2)], page)
    table = block_table(lists, lens, page, 16)
    group_start, group_rows, shared, saved = shared_prefix_groups(table, np.array(lens), 6, page)
    groups = [sorted(group_rows[a:b].tolist()) for a, b in zip(group_start[:-1], group_start[1:]) if b > a]
    assert sorted(groups) == [[0, 1, 2], [3], [4, 5]]
    assert shared.tolist() == [MIN_SHARED_TOKENS] * 3 + [0] + [MIN_SHARED_TOKENS + page] * 2
    assert saved == 2 * MIN_SHARED_TOKENS + (MIN_SHARED_TOKENS + page)  # each group's rows after its first
    assert_groups_read_their_first_rows_pages(table, lens, page, group_start, group_rows, shared)


def assert_groups_read_their_first_rows_pages(table, lens, page, group_start, group_rows, shared):
    assert sorted(group_rows.tolist()) == list(range(len(group_rows)))  # every row once
    for begin, end in zip(group_start[:-1], group_start[1:]):
        if begin == end:  # past the last group
            continue
        lead = group_rows[begin]
        for row in group_rows[begin:end]:
            pages = shared[row] // page
            assert shared[row] == shared[lead]
            assert (table[row, :pages] == table[lead, :pages]).all()
            assert shared[row] < lens[row]  # never the page of the row's newest token


def test_rows_of_one_prompt_apart_in_the_batch_are_grouped_together():
    """Rows as the async loop may admit them (a group's first row before its copies, another
    prompt's rows between): each prompt's rows still form one group."""
    page = 16
    lists, lens, _ = pages_of([(0, 1), (1, 1), (0, 2), (0, 1), (1, 2), (-1, 9), (1, 1)], page)
    table = block_table(lists, lens, page, 16)
    group_start, group_rows, shared, _ = shared_prefix_groups(table, np.array(lens), 7, page)
    groups = [sorted(group_rows[a:b].tolist()) for a, b in zip(group_start[:-1], group_start[1:]) if b > a]
    assert sorted(groups) == [[0, 2, 3], [1, 4, 6], [5]]
    assert_groups_read_their_first_rows_pages(table, lens, page, group_start, group_rows, shared)


def test_padding_rows_stand_alone_and_groups_stop_at_the_row_limit():
    page = 16
    rows = MAX_GROUP_ROWS + 3
    lists, lens, _ = pages_of([(0, 1)] * rows, page)
    table = block_table(lists + [[0]] * 2, lens + [1, 1], page, 16)  # two padding rows on one page
    group_start, group_rows, shared, _ = shared_prefix_groups(table, np.array(lens + [1, 1]), rows, page)
    assert group_start.tolist()[:5] == [0, MAX_GROUP_ROWS, rows, rows + 1, rows + 2]
    assert group_rows.tolist() == list(range(rows + 2)) and shared[rows:].tolist() == [0, 0]


def test_short_or_rare_sharing_is_left_to_the_plain_kernel():
    page = 16
    few = MIN_SHARED_TOKENS // page - 1  # a prefix of fewer keys than pays
    lists = [list(range(few)) + [100 + r] for r in range(4)]
    lens = [(few + 1) * page] * 4
    assert shared_prefix_groups(block_table(lists, lens, page, 16), np.array(lens), 4, page) is None
    # Two rows of sixteen share a prefix: less than an eighth of the keys read is saved.
    lists, lens, _ = pages_of([(0, 1), (0, 1)] + [(-1, 60)] * 14, page)
    assert shared_prefix_groups(block_table(lists, lens, page, 64), np.array(lens), 16, page) is None


# -- the kernels -----------------------------------------------------------------------------------

LAYOUTS = {
    "two groups and a row alone": [(0, 2), (0, 3), (0, 1), (-1, 9), (1, 2), (1, 1)],
    "one group of every row": [(0, 1)] * 5,
    "a group larger than a tile": [(0, 1)] * 12,
    "groups interleaved": [(0, 1), (1, 2), (-1, 5), (0, 2), (1, 1), (0, 1)],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (14, 2)])  # one head per tile row; 7 per KV head: 2 programs
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("psplits", [1, 2])  # one: the prefix program joins the partials itself; two: the merge
def test_grouped_decode_matches_reference(name, heads, kv_heads, splits, psplits, monkeypatch):
    page = 16
    monkeypatch.setattr(shared_kernel, "prefix_splits", lambda *args: psplits)
    lists, lens, total = pages_of(LAYOUTS[name], page, seed=splits)
    query, keys, values, meta, table = decode_step(lists, lens, page, total, heads, kv_heads, 32)
    expected = paged_attention_reference(query, keys, values, meta, None)
    merges = []
    real_merge = triton_paged._merge_splits_kernel
    monkeypatch.setattr(triton_paged, "_merge_splits_kernel", _Counted(real_merge, merges))
    got = triton_paged.paged_attention_triton(query, keys, values, grouped(meta, table), None, num_splits=splits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(merges) == (psplits > 1)  # one prefix split: no merge launched


# (query heads, KV heads, head size) of real models: Llama-3-8B, Llama-3.2-1B, Qwen2.5-7B (7 per KV head),
# Qwen2-0.5B, Gemma-2-9B and Gemma-7B (256), Phi-3-mini (96, one KV head each), Phi-2 (80), GPT-BigCode
# (48 on one), Falcon-7B (71 on one).
REAL_SHAPES = [(32, 8, 128), (32, 8, 64), (28, 4, 128), (14, 2, 64), (16, 8, 256), (16, 16, 256), (32, 32, 96),
               (32, 32, 80), (48, 1, 128), (71, 1, 64)]


@pytest.mark.parametrize("heads, kv_heads, head_dim", REAL_SHAPES, ids=[f"{h}q{k}kv{d}" for h, k, d in REAL_SHAPES])
def test_grouped_decode_of_real_head_shapes_matches_reference(heads, kv_heads, head_dim):
    page = 16
    lists, lens, total = pages_of(LAYOUTS["two groups and a row alone"], page, seed=2)
    query, keys, values, meta, table = decode_step(lists, lens, page, total, heads, kv_heads, head_dim)
    expected = paged_attention_reference(query, keys, values, meta, None)
    got = triton_paged.paged_attention_triton(query, keys, values, grouped(meta, table), None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, head_dim", [(72, 16), (40, 256), (64, 16), (32, 256)])
def test_groups_of_more_query_heads_than_a_prefix_tile_holds(heads, head_dim, monkeypatch):
    """One KV head for 72 query heads (Falcon-7B has 71) or 40 of size 256: more than a prefix tile
    holds (64; 32 over 128), so the paged kernel takes the whole context; 64 and 32 still group."""
    page = 16
    lists, lens, total = pages_of(LAYOUTS["two groups and a row alone"], page, seed=1)
    query, keys, values, meta, table = decode_step(lists, lens, page, total, heads, 1, head_dim)
    expected = paged_attention_reference(query, keys, values, meta, None)
    launches = []
    monkeypatch.setattr(shared_kernel, "_shared_prefix_kernel", _Counted(shared_kernel._shared_prefix_kernel, launches))
    got = triton_paged.paged_attention_triton(query, keys, values, grouped(meta, table), None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bool(launches) == shared_kernel.holds_group(heads, head_dim) == (heads in (64, 32))


class _Counted:
    """A kernel whose launches (`kernel[grid](...)`) are counted into `launches`."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("variant", ["softcap", "sinks", "new_kv"])
def test_grouped_decode_keeps_the_kernels_variants(variant):
    """Softcap on both parts, a sink counted once (the rows' own split 0), the step's new K/V
    stored by the rows' kernel and attended with (the prefix never holds a newest token)."""
    page, heads, kv_heads = 8, 8, 2
    lists, lens, total = pages_of(LAYOUTS["two groups and a row alone"], page, seed=3)
    query, keys, values, meta, table = decode_step(lists, lens, page, total, heads, kv_heads, 16)
    kwargs = {}
    full_k, full_v = keys, values
    if variant == "softcap":
        kwargs["softcap"] = 2.0
    elif variant == "sinks":
        kwargs["sinks"] = torch.randn(heads, device=DEVICE)
    else:
        ends = [n - 1 for n in lens]
        slots = [lists[r][e // page] * page + e % page for r, e in enumerate(ends)]
        meta.slot_mapping = torch.tensor(slots, device=DEVICE)
        new_k, new_v = torch.randn(2, 1, kv_heads, len(lens), 16, device=DEVICE)
        full_k, full_v = keys.clone(), values.clone()
        full_k[slots], full_v[slots] = new_k[0].transpose(0, 1), new_v[0].transpose(0, 1)
        keys[slots], values[slots] = float("nan"), float("nan")
        kwargs["new_kv"] = (new_k, new_v)
    expected = paged_attention_reference(query, full_k, full_v, meta, None, softcap=kwargs.get("softcap"),
                                         sinks=kwargs.get("sinks"))
    got = triton_paged.paged_attention_triton(query, keys, values, grouped(meta, table), None, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys, full_k) and torch.equal(values, full_v)


@settings(max_examples=10, deadline=None)
@given(data=st.data(), page=st.sampled_from([8, 16]))
def test_random_groups_match_reference(data, page):
    """Random runs of rows sharing prefixes, rows alone between them: whatever groups the host
    chooses (or none), the result is the reference's."""
    rows = data.draw(st.integers(2, 10))
    layout = [(data.draw(st.integers(-1, 2)), data.draw(st.integers(1, 4))) for _ in range(rows)]
    lists, lens, total = pages_of(layout, page, seed=rows)
    query, keys, values, meta, table = decode_step(lists, lens, page, total, 8, 2, 16)
    groups = shared_prefix_groups(table, np.array(lens), rows, page)
    if groups is not None:
        meta.group_start, meta.group_rows, meta.shared_len = (torch.from_numpy(a).to(DEVICE) for a in groups[:3])
    expected = paged_attention_reference(query, keys, values, meta, None)
    got = triton_paged.paged_attention_triton(query, keys, values, meta, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- the engine ------------------------------------------------------------------------------------

@pytest.mark.skipif(CUDA, reason="the CPU end-to-end run of the interpreted kernels (CUDA runs test_gpu.py)")
def test_repeated_prompts_read_their_prefix_once_and_give_stock_tokens(monkeypatch):
    """A GRPO-shaped batch (each prompt repeated as adjacent rows) on the Triton kernels, async with
    CUDA graphs (the sync loop builds its steps the same way): prefix caching shares the prompts'
    pages, decode steps read each shared prefix once per group, and every token is stock's."""
    model = tiny_model("llama")
    monkeypatch.setattr(groups_module, "MIN_SHARED_TOKENS", 16)  # short prompts: the interpreter is slow
    prompts = [p for p in random_prompts(2, 36, 50, seed=5) for _ in range(3)]
    expected = stock_generate(model, prompts, max_new_tokens=6, eos_token_id=[2], pad_token_id=0)
    launches = []
    real = shared_kernel.launch_shared_prefix

    def counted(*args, **kwargs):
        launches.append(args[7].shared_len.max().item())  # (meta)
        return real(*args, **kwargs)

    monkeypatch.setattr(shared_kernel, "launch_shared_prefix", counted)
    with Engine(model, BatchingConfig(mode="async", attention="triton", cuda_graphs=True, page_size=8,
                                      num_pages=96)) as engine:
        outs = engine.generate(prompts, max_new_tokens=6, eos_token_ids=(2,))
        stats = engine.prefix_cache_stats()
    assert [o.output_token_ids for o in outs] == generated_rows(expected, max(map(len, prompts)), 0, (2,))
    assert launches and min(launches) >= 16
    # Counted: each grouped step's copies skip their prefix (2 of 3 rows per prompt, at most).
    assert stats["grouped_decode_steps"] > 0 and stats["keys_read_once"] >= 16 * stats["grouped_decode_steps"]
    assert stats["keys_read_once"] <= stats["grouped_decode_steps"] * 4 * max(map(len, prompts))


@pytest.mark.skipif(CUDA, reason="the CPU end-to-end run of the interpreted kernels (CUDA runs test_gpu.py)")
def test_a_model_whose_query_groups_no_prefix_tile_holds_groups_no_step(monkeypatch):
    """72 query heads on one KV head (a Falcon-7B-like group): repeated prompts on the Triton kernels
    give stock's tokens, and no decode step is built with groups nor counted as one."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=144, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=72, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = scaled(transformers.LlamaForCausalLM(config).eval())
    monkeypatch.setattr(groups_module, "MIN_SHARED_TOKENS", 16)
    prompts = [p for p in random_prompts(2, 36, 50, seed=5) for _ in range(3)]
    expected = stock_generate(model, prompts, max_new_tokens=4, eos_token_id=[2], pad_token_id=0)
    with Engine(model, BatchingConfig(mode="async", attention="triton", page_size=8, num_pages=96)) as engine:
        outs = engine.generate(prompts, max_new_tokens=4, eos_token_ids=(2,))
        stats = engine.prefix_cache_stats()
    assert [o.output_token_ids for o in outs] == generated_rows(expected, max(map(len, prompts)), 0, (2,))
    assert stats["hit_tokens"] > 0 and stats["grouped_decode_steps"] == 0


def test_prefix_kernel_compiles_for_sm90_and_fits_an_h200():
    """The prefix kernel's bf16 tiles (head sizes 128 and 256, groups of 4 and 8 query heads, joining
    the rows' partials itself or not) compile for an H200 without a GPU (CI has none) and fit its shared memory."""
    from sm90 import assert_compiles_for_sm90

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
    pointers.update({n: "*fp32" for n in ("part_ptr", "m_ptr", "l_ptr")})
    pointers.update({n: "*i64" for n in ("block_table_ptr", "group_start_ptr", "group_rows_ptr", "shared_len_ptr")})
    scalars = {"qk_scale": "fp32", "cap_log2": "fp32", "slot0": "i32", "num_psplits": "i32"}
    strides = {n: "i64" for n in ("stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ps stride_pt "
                                  "stride_ph stride_ms stride_mt stride_bt stride_ot stride_oh").split()}
    kernels = [("hf_async_cb.kernels.shared_prefix_attention", "_shared_prefix_kernel", {**pointers, **scalars, **strides},
                shared_kernel._constexprs(group, head_dim, head_dim, 16, softcap, False, merge), shared_kernel.LAUNCH)
               for group, head_dim, softcap in ((4, 128, False), (8, 256, True)) for merge in (True, False)]
    sizes = assert_compiles_for_sm90(kernels)
    assert max(sizes) <= 232448, sizes  # the H200's shared memory per block
