"""Kernel sweeps on the GPU, timed inside CUDA graphs (as the engine runs them, without the launch
cost of Python): the paged decode attention's launch parameters at the bench shapes, and the
one-pass greedy pick and the K/V store against the torch ops they replace.

    python benchmarks/tune_kernels.py [--attention | --prefill]
"""

from __future__ import annotations

import itertools

import torch

from hf_async_cb.kernels import graph_timing
from hf_async_cb.kernels.draw_greedy import greedy_packed
from hf_async_cb.kernels.attention_launch import choose_splits
from hf_async_cb.kernels.paged_attention import paged_attention_triton
from hf_async_cb.kernels.store_kv import store_kv
from hf_async_cb.model.step_metadata import StepMetadata, block_table
from hf_async_cb.sampling.sampler import pack


def graph_ms(fn) -> float:
    """ms per call of fn(), replayed from a CUDA graph (as the engine runs it)."""
    return graph_timing.graph_ms(lambda i: fn(), calls=50)


def _pool(slots: int, kv_heads: int, head_dim: int, head_major: bool) -> torch.Tensor:
    """[slots, KVH, D] as the engine lays it out, or (head_major) a view of [KVH, slots, D]: each
    head's page then lies in one run of page x D values instead of rows at a KVH x D stride."""
    if head_major:
        return torch.randn(kv_heads, slots, head_dim, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    return torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)


def decode_case(requests: int, ctx: int, heads: int, kv_heads: int, head_dim: int, page: int = 16,
                head_major: bool = False):
    """A decode step's attention inputs as the engine passes them (scattered pages, ragged contexts,
    the new token's K/V stored by the kernel), with enough copies of the pools to rotate through
    that no call finds its K/V in L2 (a decode step reads each layer's K/V once, cold)."""
    g = torch.Generator().manual_seed(ctx)
    per = -(-ctx // page)
    pages = requests * per
    kv_bytes_all = 2 * pages * page * kv_heads * head_dim * 2
    pools = [(_pool(pages * page, kv_heads, head_dim, head_major), _pool(pages * page, kv_heads, head_dim, head_major))
             for _ in range(graph_timing.cold_copies(kv_bytes_all))]
    order = torch.randperm(pages, generator=g).view(requests, per).tolist()  # scattered pages
    lens = [max(1, ctx - int(x)) for x in torch.randint(0, 64, (requests,), generator=g)]  # ragged
    width = -(-ctx // 64) * 64 // page
    last = [order[r][(n - 1) // page] * page + (n - 1) % page for r, n in enumerate(lens)]  # the new token's slot
    meta = StepMetadata(slot_mapping=torch.tensor(last, device="cuda"),
                        block_table=torch.from_numpy(block_table(order, lens, page, width)).cuda(),
                        query_start=torch.arange(requests + 1, device="cuda"),
                        context_lens=torch.tensor(lens, device="cuda"), page_size=page, max_query_len=1,
                        max_context=width * page)
    q = torch.randn(1, heads, requests, head_dim, device="cuda", dtype=torch.bfloat16)
    new_kv = (torch.randn(1, kv_heads, requests, head_dim, device="cuda", dtype=torch.bfloat16),
              torch.randn(1, kv_heads, requests, head_dim, device="cuda", dtype=torch.bfloat16))
    kv_bytes = 2 * sum(lens) * kv_heads * head_dim * 2
    return q, pools, new_kv, meta, kv_bytes


CASES = {"1B x 64, ctx 256": (64, 256, 32, 8, 64), "1B x 256, ctx 640": (256, 640, 32, 8, 64),
         "8B x 32, ctx 256": (32, 256, 32, 8, 128), "8B x 32, ctx 1152": (32, 1152, 32, 8, 128),
         "8B x 32, ctx 8192": (32, 8192, 32, 8, 128), "8B x 256, ctx 640": (256, 640, 32, 8, 128)}


def sweep_attention(names: list[str] | None = None) -> None:
    """Every launch shape and split count at each case, cold L2, with the in-kernel K/V store as the
    engine runs decode; the default's time beside the fastest."""
    for name, shape in CASES.items():
        if names and name not in names:
            continue
        q, pools, new_kv, meta, kv_bytes = decode_case(*shape)

        def timed(**kw) -> float:
            return graph_timing.graph_ms(lambda i: paged_attention_triton(
                q, *pools[i % len(pools)], meta, None, new_kv=new_kv, **kw), calls=40)

        default_splits = choose_splits(meta, shape[3], q.device)
        base = timed()
        results = []
        for block_n, warps, stages, splits, early in itertools.product(
                (64, 128), (2, 4), (2, 3), (1, 2), (True, False)):
            tuning = dict(block_n=block_n, num_warps=warps, num_stages=stages, early_loads=early)
            try:
                ms = timed(num_splits=splits, tuning=tuning)
            except Exception as e:  # noqa: BLE001 (a config that does not compile)
                print(f"  skip {tuning} splits {splits}: {type(e).__name__}")
                continue
            results.append((ms, block_n, warps, stages, splits, early))
        results.sort()
        print(f"\n{name} ({len(pools)} pool copies): default (splits {default_splits}) {base * 1e3:.1f} us = "
              f"{kv_bytes / base / 1e6:,.0f} GB/s")
        first = timed(tuning=dict(heads_first=True))
        print(f"heads-first grid (a request's KV heads launched side by side), default launch: {first * 1e3:.1f} us "
              f"= {kv_bytes / first / 1e6:,.0f} GB/s")
        for ms, block_n, warps, stages, splits, early in results[:2]:
            tuning = dict(block_n=block_n, num_warps=warps, num_stages=stages, early_loads=early, heads_first=True)
            again = timed(num_splits=splits, tuning=tuning)
            print(f"heads-first grid, {tuning} splits {splits}: {again * 1e3:.1f} us (row-first {ms * 1e3:.1f})")
        q2, pools2, new_kv2, meta2, _ = decode_case(*shape, head_major=True)  # the same step, head-major pools
        major = graph_timing.graph_ms(lambda i: paged_attention_triton(
            q2, *pools2[i % len(pools2)], meta2, None, new_kv=new_kv2), calls=40)
        print(f"head-major pools, default launch: {major * 1e3:.1f} us = {kv_bytes / major / 1e6:,.0f} GB/s")
        del q2, pools2, new_kv2, meta2
        print("| us | GB/s | block_n | warps | stages | splits | early loads |\n|---|---|---|---|---|---|---|")
        for ms, *cfg in results[:5]:
            print(f"| {ms * 1e3:.1f} | {kv_bytes / ms / 1e6:,.0f} | " + " | ".join(map(str, cfg)) + " |")
        for label, keep in (("splits", 3), ("early loads", 4)):
            best = {}
            for r in results:
                best.setdefault(r[keep + 1], r[0])
            print(f"best by {label}: " + ", ".join(f"{k}: {ms * 1e3:.1f} us" for k, ms in best.items()))


PREFILL_CASES = {"8B, one 8192-token prompt": ([8192], [8192]), "8B, 16 prompts of 512": ([512] * 16, [512] * 16),
                 "8B, a 2048-token chunk after 6144 cached": ([2048], [8192]),
                 "8B, 256 decodes at 640 + a 2048-token prompt": ([1] * 256 + [2048], [640] * 256 + [2048])}


def sweep_prefill(names: list[str] | None = None) -> None:
    """Chunked-prefill attention (Llama-3-8B heads: 32 query, 8 KV, d 128, bf16) at several query
    tiles (block_q tokens x 4 heads per program) and launch shapes, in TFLOP/s of causal attention,
    beside torch's scaled_dot_product_attention (FlashAttention-2 on Hopper) on the same tokens
    where they are a fresh prompt."""
    import torch.nn.functional as F

    from tests.test_triton_attention import make_step

    for name, (query_lens, context_lens) in PREFILL_CASES.items():
        if names and name not in names:
            continue
        q, kp, vp, meta = make_step(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
        pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(query_lens, context_lens))
        flops = 4 * 128 * 32 * pairs

        def timed(**kw) -> float:
            return graph_timing.graph_ms(lambda i: paged_attention_triton(q, kp, vp, meta, None, **kw), calls=5, replays=3)

        rows = [("default", timed()),
                ("16 rows (block_q 4, block_n 128, 4 warps, 2 stages)",
                 timed(tuning=dict(block_q=4, block_n=128, num_warps=4, num_stages=2)))]
        for block_q, block_n, warps, stages in itertools.product((16, 32), (64, 128), (4, 8), (2, 3)):
            tuning = dict(block_q=block_q, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                rows.append((f"block_q {block_q}, block_n {block_n}, {warps} warps, {stages} stages", timed(tuning=tuning)))
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                print(f"  skip {tuning}: {type(e).__name__}")
        if context_lens == query_lens:  # fresh prompts: FlashAttention-2 through SDPA, one call per prompt
            per = [(torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16),
                    torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)) for n in query_lens]
            rows.append(("torch SDPA (causal, GQA)", graph_timing.graph_ms(lambda i: [
                F.scaled_dot_product_attention(x, k, k, is_causal=True, enable_gqa=True) for x, k in per],
                calls=5, replays=3)))
        print(f"\n{name}: {flops / 1e9:,.0f} GFLOP of causal attention")
        print("| kernel | ms | TFLOP/s |\n|---|---|---|")
        sdpa = rows[-1:] if rows[-1][0].startswith("torch") else []
        best = sorted(rows[2:len(rows) - len(sdpa)], key=lambda r: r[1])[:4]
        for label, ms in [*rows[:2], *best, *sdpa]:
            print(f"| {label} | {ms:.3f} | {flops / ms / 1e9:,.0f} |")


def compare_small_kernels() -> None:
    print("\n| op | shape | torch us | triton us |\n|---|---|---|---|")
    for rows in (32, 64, 256):
        logits = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)

        def torch_greedy():
            x = logits.float()
            t = x.argmax(-1)
            return pack(t, x.log_softmax(-1).gather(1, t[:, None]).squeeze(1))

        assert torch.equal(torch_greedy()[0], greedy_packed(logits)[0])
        print(f"| greedy pick | {rows} x 128256 bf16 | {graph_ms(torch_greedy) * 1e3:.1f} | "
              f"{graph_ms(lambda: greedy_packed(logits)) * 1e3:.1f} |")
    for tokens, heads, dim in ((64, 8, 64), (32, 8, 128), (2048, 8, 128)):
        pools = [torch.zeros(40000, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        k = torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn_like(k)
        slots = torch.randperm(40000, device="cuda")[:tokens]

        def torch_store():
            pools[0].index_copy_(0, slots, k[0].transpose(0, 1))
            pools[1].index_copy_(0, slots, v[0].transpose(0, 1))

        print(f"| K/V store | {tokens} tokens x {heads} x {dim} | {graph_ms(torch_store) * 1e3:.1f} | "
              f"{graph_ms(lambda: store_kv(pools[0], pools[1], k, v, slots)) * 1e3:.1f} |")


if __name__ == "__main__":
    import sys

    names = [a for a in sys.argv[1:] if not a.startswith("--")] or None
    if "--prefill" in sys.argv:
        sweep_prefill(names)
    else:
        if "--attention" not in sys.argv:
            compare_small_kernels()
        sweep_attention(names)
