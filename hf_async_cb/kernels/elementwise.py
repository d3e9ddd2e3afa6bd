"""Element-wise Triton kernels: RMSNorm (alone or after a residual add), rotary embeddings and SiLU-mul
(or GELU-tanh-mul),
each rounding as torch does.

Each computes in fp32 and rounds every intermediate that torch rounds to the model dtype, so results
match the torch code they replace bit for bit, or rarely by an ulp or two where a reduction order
(RMSNorm's mean) or a transcendental's implementation (exp) differs. Their torch references are the
model's own modules (LlamaRMSNorm, apply_rotary_pos_emb, the MLP's act_fn(gate) * up); the model
patching that swaps them in is model/elementwise_fusion.py. add_rms_norm writes a decoder layer's
`residual + x` (rounded as torch's add) and the RMSNorm of that sum, computed exactly as rms_norm
computes it (same arithmetic, same launch shape, so the same reduction): one kernel where the layer
ran two; model/residual_fusion.py patches it in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hf_async_cb.kernels.variant import Variant

_LAUNCH = dict(enable_fp_fusion=False)  # no FMA contraction: torch rounds each product

# Row strides come from the model's tensors (views of a fused projection, a [1, T, ...] activation whose
# leading sizes change with the step) and are not specialised, so that every step of a model launches
# the variants compiled at its first; ALIGNED (every such stride a multiple of 16, as it is for widths
# that are) tells the loads they may vectorise, which the specialisation used to.
_ROW_STRIDES = ["n_rows", "inner", "stride_outer", "stride_inner"]


# Every value torch rounds to a 16-bit dtype is rounded the same way here, inline (helper calls are
# slow in Triton's interpreter): fp16 by a cast, bf16 by hand, since the interpreter's fp32->bf16 cast
# truncates. The bf16 rounding is round-to-nearest-even on the bits (what cvt.rn.bf16.f32 does),
# keeping NaNs; after it, the cast to bf16 is exact.


@triton.jit(do_not_specialize=_ROW_STRIDES)
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, inner, stride_outer, stride_inner, inv_n, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, X_BF16: tl.constexpr, Y_BF16: tl.constexpr,
                     LIBDEVICE: tl.constexpr, UNIT_OFFSET: tl.constexpr, ALIGNED: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    if ALIGNED:
        src = tl.multiple_of(src, 16)
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) * inv_n + eps
    if LIBDEVICE:
        h = x * libdevice.rsqrt(var)[:, None]
    else:
        h = x * tl.math.rsqrt(var)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if UNIT_OFFSET:  # Gemma: h * (1 + weight), all in fp32, rounded once at the end
        y = h * (1.0 + w)
    else:
        if X_BF16:  # h.to(input dtype)
            bits = h.to(tl.uint32, bitcast=True)
            h = tl.where(h != h, h, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = w * h
    if Y_BF16:  # weight * h
        bits = y.to(tl.uint32, bitcast=True)
        y = tl.where(y != y, y, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_ROW_STRIDES + ["r_outer", "r_inner"])
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, n_rows, n_cols, inner, stride_outer, stride_inner,
                         r_outer, r_inner, inv_n, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr, X_BF16: tl.constexpr,
                         Y_BF16: tl.constexpr, LIBDEVICE: tl.constexpr, ALIGNED: tl.constexpr):
    """s = x + residual rounded to x's dtype (torch's add), then y = _rms_norm_kernel's result for s."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    src_r = (rows // inner).to(tl.int64) * r_outer + (rows % inner).to(tl.int64) * r_inner
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        src_r = tl.multiple_of(src_r, 16)
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x += tl.load(r_ptr + src_r[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if X_BF16:  # (x + residual).to(dtype)
        bits = x.to(tl.uint32, bitcast=True)
        x = tl.where(x != x, x, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    x = x.to(x_ptr.dtype.element_ty)
    dst = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    tl.store(s_ptr + dst, x, mask=mask)
    x = x.to(tl.float32)
    # From here on, _rms_norm_kernel's arithmetic on the rounded sum.
    var = tl.sum(x * x, axis=1) * inv_n + eps
    if LIBDEVICE:
        h = x * libdevice.rsqrt(var)[:, None]
    else:
        h = x * tl.math.rsqrt(var)[:, None]
    if X_BF16:  # h.to(input dtype)
        bits = h.to(tl.uint32, bitcast=True)
        h = tl.where(h != h, h, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :] * h
    if Y_BF16:  # weight * h
        bits = y.to(tl.uint32, bitcast=True)
        y = tl.where(y != y, y, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(y_ptr + dst, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seq_len", "sqb", "sqh", "sqt", "skb", "skh", "skt", "scb", "sct", "sob", "soh", "sot",
                               "skob", "skoh", "skot"])
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_q, n_heads, half,
                   sqb, sqh, sqt, skb, skh, skt, scb, sct, sob, soh, sot, skob, skoh, skot,
                   HEADS: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr, ALIGNED: tl.constexpr,
                   ROUND_TERMS: tl.constexpr = True, TOKENS: tl.constexpr = 1):
    """One program per (token, block of HEADS heads), q's heads first, then k's, one head per row.
    ROUND_TERMS: each product rounded to the output dtype before the sum (apply_rotary_pos_emb in the
    model's dtype); without it all in fp32, rounded once (the vision towers' apply_rotary_pos_emb_vision).
    TOKENS > 1 (one batch row only, as vision_rotary's): that many tokens per program, a row per (token,
    head), for Triton's interpreter, whose time goes with the number of programs; the GPU's launches take 1."""
    pid = tl.program_id(0)
    dt = qo_ptr.dtype.element_ty
    d = tl.arange(0, DIM)
    d_mask = d < 2 * half
    first = d < half
    d_rot = tl.where(first, d + half, d - half)  # rotate_half(x) = cat(-x2, x1): x[d_rot] * sign
    sign = tl.where(first, -1.0, 1.0)[None, :]
    if TOKENS == 1:
        b = (pid // seq_len).to(tl.int64)
        t = (pid % seq_len).to(tl.int64)
        cs = b * scb + t * sct + d
        if ALIGNED:
            cs = tl.multiple_of(cs, 16)
        c = tl.load(cos_ptr + cs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + cs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        rows = h < n_heads
    else:
        r = tl.arange(0, TOKENS * HEADS)
        b = 0
        t = (pid * TOKENS + r // HEADS).to(tl.int64)
        cs = t[:, None] * sct + d[None, :]
        in_seq = (t < seq_len)[:, None] & d_mask[None, :]
        c = tl.load(cos_ptr + cs, mask=in_seq, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cs, mask=in_seq, other=0.0).to(tl.float32)
        h = tl.program_id(1) * HEADS + r % HEADS
        rows = (h < n_heads) & (t < seq_len)
    is_q = (h < n_q)[:, None]
    mask = rows[:, None] & d_mask[None, :]
    at_q = b * sqb + t * sqt + h * sqh
    at_k = b * skb + t * skt + (h - n_q) * skh
    out_q = b * sob + t * sot + h * soh
    out_k = b * skob + t * skot + (h - n_q) * skoh
    if ALIGNED:
        at_q = tl.multiple_of(at_q, 16)
        at_k = tl.multiple_of(at_k, 16)
        out_q = tl.multiple_of(out_q, 16)
        out_k = tl.multiple_of(out_k, 16)
    row = tl.where(is_q, q_ptr + at_q[:, None], k_ptr + at_k[:, None])
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(row + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    p = x * c  # q * cos
    r = xr * s  # rotate_half(q) * sin, up to the sign (exact)
    if ROUND_TERMS:
        if BF16:
            bits = p.to(tl.uint32, bitcast=True)
            p = tl.where(p != p, p, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
            bits = r.to(tl.uint32, bitcast=True)
            r = tl.where(r != r, r, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
        o = p.to(dt).to(tl.float32) + sign * r.to(dt).to(tl.float32)
    else:
        o = p + sign * r
    if BF16:
        bits = o.to(tl.uint32, bitcast=True)
        o = tl.where(o != o, o, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(tl.where(is_q, qo_ptr + out_q[:, None], ko_ptr + out_k[:, None]) + d[None, :], o.to(dt), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _silu_mul_kernel(y_ptr, o_ptr, n_rows, n_cols, stride_y,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr, LIBDEVICE: tl.constexpr,
                     GELU_TANH: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    src = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + n_cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
        if LIBDEVICE:  # torch's CUDA formula, with the same tanh
            a = 0.5 * gate * (1.0 + libdevice.tanh(inner))
        else:  # the interpreter has no tanh: 2 sigmoid(2u) - 1, whose fp32 rounding near -1 is tanh's
            a = 0.5 * gate * (1.0 + (tl.math.div_rn(2.0, 1.0 + tl.exp(-2.0 * inner)) - 1.0))
    elif LIBDEVICE:  # torch's CUDA silu: x / (1 + expf(-x)) with IEEE division
        a = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:
        a = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    dt = o_ptr.dtype.element_ty
    if BF16:
        bits = a.to(tl.uint32, bitcast=True)
        a = tl.where(a != a, a, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    o = a.to(dt).to(tl.float32) * up
    if BF16:
        bits = o.to(tl.uint32, bitcast=True)
        o = tl.where(o != o, o, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], o.to(dt), mask=mask)


def _row_layout(x: torch.Tensor):
    """(rows, inner, stride_outer, stride_inner): row r of x starts at (r // inner) * stride_outer +
    (r % inner) * stride_inner; None if x's leading dims need more than two strides."""
    dims = []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:  # collapses into the previous dim
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 2:
        return None
    if len(dims) == 2:
        (n0, s0), (n1, s1) = dims
        return n0 * n1, n1, s0, s1
    n, stride = dims[0] if dims else (1, 0)
    return n, 1, stride, 0


def _aligned(*strides: int) -> bool:
    """Whether every stride is a multiple of 16 elements (the kernels' ALIGNED)."""
    return all(stride % 16 == 0 for stride in strides)


def _rms_launch(rows: int, n: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK, num_warps) of an RMSNorm over `rows` rows of width n (add_rms_norm uses
    rms_norm's, so that their reductions, and so their results, are the same)."""
    block = triton.next_power_of_2(n)
    per = max(1, min(triton.next_power_of_2(rows), 4096 // block))
    return per, block, min(16, max(1, per * block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)` in one kernel (Llama's
    RMSNorm), or with `unit_offset` Gemma's: `(x.float() * rsqrt(...) * (1 + weight.float())).to(x.dtype)`."""
    if x.stride(-1) != 1 or _row_layout(x) is None:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows, inner, stride_outer, stride_inner = _row_layout(x)
    n = x.shape[-1]
    dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    per, block, warps = _rms_launch(rows, n)
    _rms_norm_kernel[(triton.cdiv(rows, per),)](
        x, weight, out, rows, n, inner, stride_outer, stride_inner, 1.0 / n, eps,
        ROWS=per, BLOCK=block, X_BF16=x.dtype == torch.bfloat16, Y_BF16=out.dtype == torch.bfloat16,
        LIBDEVICE=not triton.knobs.runtime.interpret, UNIT_OFFSET=unit_offset,
        ALIGNED=_aligned(stride_outer, stride_inner), num_warps=warps, **_LAUNCH)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """`s = residual + x; (s, rms_norm(s, weight, eps))` in one kernel: the sum rounded to the dtype as
    torch's add rounds it, the norm bit for bit rms_norm's of that sum. x and residual: one shape and
    dtype. Returns (s, normed), both contiguous."""
    assert x.shape == residual.shape and x.dtype == residual.dtype and x.device == residual.device
    if x.stride(-1) != 1 or _row_layout(x) is None:
        x = x.contiguous()
    if residual.stride(-1) != 1 or _row_layout(residual) is None:
        residual = residual.contiguous()
    if _row_layout(x)[:2] != _row_layout(residual)[:2]:  # rows grouped differently: one layout for both
        x, residual = x.contiguous(), residual.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (rows, inner, stride_outer, stride_inner), (_, _, r_outer, r_inner) = _row_layout(x), _row_layout(residual)
    n = x.shape[-1]
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    per, block, warps = _rms_launch(rows, n)
    _add_rms_norm_kernel[(triton.cdiv(rows, per),)](
        x, residual, weight, total, out, rows, n, inner, stride_outer, stride_inner, r_outer, r_inner, 1.0 / n, eps,
        ROWS=per, BLOCK=block, X_BF16=x.dtype == torch.bfloat16, Y_BF16=out.dtype == torch.bfloat16,
        LIBDEVICE=not triton.knobs.runtime.interpret, ALIGNED=_aligned(stride_outer, stride_inner, r_outer, r_inner),
        num_warps=warps, **_LAUNCH)
    return total, out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin) for q [B, H, T, D], k [B, KVH, T, D], cos/sin
    [B or 1, T, D]; returns [B, T, heads, D] buffers transposed to [B, heads, T, D], like the usual inputs."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    (batch, n_q, seq, dim), n_k = q.shape, k.shape[1]
    cos, sin = cos.expand(batch, seq, dim), sin.expand(batch, seq, dim)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(batch, seq, n_q, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    ko = torch.empty(batch, seq, n_k, dim, dtype=k.dtype, device=k.device).transpose(1, 2)
    block_d = triton.next_power_of_2(dim)
    heads = min(triton.next_power_of_2(n_q + n_k), max(1, 2048 // block_d))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
               qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2))
    _rotary_kernel[(batch * seq, triton.cdiv(n_q + n_k, heads))](
        q, k, cos, sin, qo, ko, seq, n_q, n_q + n_k, dim // 2, *strides,
        HEADS=heads, DIM=block_d, BF16=q.dtype == torch.bfloat16, ALIGNED=_aligned(*strides), num_warps=4, **_LAUNCH)
    return qo, ko


def vision_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: int | None = None):
    """A vision tower's apply_rotary_pos_emb_vision(q, k, cos, sin) for q [T, H, D], k [T, KVH, D] (last
    stride 1) and cos/sin [T, D]: computed in fp32, rounded once to q's dtype; returns contiguous
    [T, H, D] and [T, KVH, D], as the torch code does (ten full-size fp32 passes there, one here).
    tokens: per program, a power of two (None: 1 on the GPU, up to a whole tower's tokens in Triton's
    interpreter, where a program per token made this kernel most of a tiny VLM test's time)."""
    (seq, n_q, dim), n_k = q.shape, k.shape[1]
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    qo, ko = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)
    block_d = triton.next_power_of_2(dim)
    heads = min(triton.next_power_of_2(n_q + n_k), max(1, 2048 // block_d))
    if tokens is None:
        tokens = min(triton.next_power_of_2(seq), max(1, 2 ** 16 // (heads * block_d))) \
            if triton.knobs.runtime.interpret else 1
    strides = (0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, cos.stride(0),
               0, qo.stride(1), qo.stride(0), 0, ko.stride(1), ko.stride(0))
    _rotary_kernel[(triton.cdiv(seq, tokens), triton.cdiv(n_q + n_k, heads))](
        q, k, cos, sin, qo, ko, seq, n_q, n_q + n_k, dim // 2, *strides,
        HEADS=heads, DIM=block_d, BF16=q.dtype == torch.bfloat16, ROUND_TERMS=False,
        ALIGNED=_aligned(*strides) and all(t.data_ptr() % (16 * t.element_size()) == 0 for t in (q, k, cos, sin)),
        TOKENS=tokens, num_warps=4, **_LAUNCH)
    return qo, ko


def silu_mul(y: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """`silu(gate) * up` for y = [..., gate | up] (last dim 2I), rounded like torch; returns [..., I].
    With `gelu_tanh`, `gelu(gate, approximate="tanh") * up` (Gemma's MLP) instead."""
    n = y.shape[-1] // 2
    y2 = y.reshape(-1, 2 * n)
    y2 = y2 if y2.stride(-1) == 1 else y2.contiguous()
    rows = y2.shape[0]
    out = torch.empty(*y.shape[:-1], n, dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(n), 1024)
    per = max(1, min(triton.next_power_of_2(rows), 1024 // block))
    _silu_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(n, block))](
        y2, out, rows, n, y2.stride(0), ROWS=per, BLOCK=block, BF16=y.dtype == torch.bfloat16,
        LIBDEVICE=not triton.knobs.runtime.interpret, GELU_TANH=gelu_tanh, num_warps=4, **_LAUNCH)
    return out


def _row_buckets(widest: int) -> list[int]:
    """The rows per program a launch can take: the powers of two up to `widest` (at least 1)."""
    return [1 << i for i in range(max(1, widest).bit_length())]


def rms_variants(width: int, x_dtype: torch.dtype, weight_dtype: torch.dtype, unit_offset: bool = False,
                 add: bool = False, aligned: bool | None = None, use_libdevice: bool = True) -> list[Variant]:
    """rms_norm's (or, with `add`, add_rms_norm's) compiled variants for rows of `width`: one per
    rows-per-program bucket (_rms_launch), whatever the row count and layout. `aligned`: the rows'
    strides are multiples of 16 (by default: `width` is, as the strides of a model's activations
    and of views of its projections are multiples of their width)."""
    block = triton.next_power_of_2(width)
    out = x_dtype if unit_offset else torch.promote_types(weight_dtype, x_dtype)
    aligned = width % 16 == 0 if aligned is None else aligned
    found = []
    for per in _row_buckets(4096 // block):
        _, _, warps = _rms_launch(per, width)
        flags = dict(ROWS=per, BLOCK=block, X_BF16=x_dtype == torch.bfloat16, Y_BF16=out == torch.bfloat16,
                     LIBDEVICE=use_libdevice)
        options = dict(num_warps=warps, **_LAUNCH)
        if add:
            found.append(Variant(_add_rms_norm_kernel, (x_dtype, x_dtype, weight_dtype, x_dtype, out, 2, width, 2, 0, 0,
                                                        0, 0, 0.5, 1e-6), dict(flags, ALIGNED=aligned), options))
        else:
            found.append(Variant(_rms_norm_kernel, (x_dtype, weight_dtype, out, 2, width, 2, 0, 0, 0.5, 1e-6),
                                 dict(flags, UNIT_OFFSET=unit_offset, ALIGNED=aligned), options))
    return found


def rotary_variants(q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype) -> list[Variant]:
    """rotary's compiled variant for these heads (one, whatever the tokens and layout): strides are
    multiples of the head size, so aligned when it is a multiple of 16."""
    block_d = triton.next_power_of_2(head_dim)
    heads = min(triton.next_power_of_2(q_heads + k_heads), max(1, 2048 // block_d))
    args = (dtype,) * 6 + (2, q_heads, q_heads + k_heads, head_dim // 2) + (0,) * 14
    return [Variant(_rotary_kernel, args, dict(HEADS=heads, DIM=block_d, BF16=dtype == torch.bfloat16,
                                               ALIGNED=head_dim % 16 == 0, ROUND_TERMS=True, TOKENS=1),
                    dict(num_warps=4, **_LAUNCH))]


def vision_rotary_variants(heads: int, head_dim: int, dtype: torch.dtype, cos_dtype: torch.dtype) -> list[Variant]:
    """vision_rotary's compiled variant for a tower of `heads` heads of `head_dim` (q and k alike)."""
    block_d = triton.next_power_of_2(head_dim)
    per = min(triton.next_power_of_2(2 * heads), max(1, 2048 // block_d))
    args = (dtype, dtype, cos_dtype, cos_dtype, dtype, dtype, 2, heads, 2 * heads, head_dim // 2) + (0,) * 14
    return [Variant(_rotary_kernel, args, dict(HEADS=per, DIM=block_d, BF16=dtype == torch.bfloat16,
                                               ALIGNED=head_dim % 16 == 0, ROUND_TERMS=False, TOKENS=1),
                    dict(num_warps=4, **_LAUNCH))]


def silu_mul_variants(width: int, dtype: torch.dtype, gelu_tanh: bool = False,
                      use_libdevice: bool = True) -> list[Variant]:
    """silu_mul's compiled variants for an MLP of `width` (I; y is [.., 2I]): one per rows-per-program
    bucket."""
    block = min(triton.next_power_of_2(width), 1024)
    return [Variant(_silu_mul_kernel, (dtype, dtype, 2, width, 2 * width),
                    dict(ROWS=per, BLOCK=block, BF16=dtype == torch.bfloat16, LIBDEVICE=use_libdevice, GELU_TANH=gelu_tanh),
                    dict(num_warps=4, **_LAUNCH))
            for per in _row_buckets(1024 // block)]
