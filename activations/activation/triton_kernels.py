"""Triton kernels (forward + backward) for RMSNorm / fused-add RMSNorm and dense / fused / grouped PolyNorm.

Imported only on the CUDA path (it imports triton). All math is fp32; inputs/outputs keep their dtype.
Layout: 2-D row views with unit stride along the feature dim D. RMSNorm forward: one program per row
(BLOCK_D = next power of two >= D). RMSNorm backward: dx one program per row, then dL/dweight by a
column-sliced kernel writing fp32 partials per block of rows (summed with torch: no atomics, deterministic).
PolyNorm: one program per row, in registers when the row fits POLY_CHUNK features, else walked in chunks.

PolyNorm kernels serve three ops through compile-time flags: HAS_UP (fused multiply by `up`), GROUPED
(per-row expert index -> per-expert coefficients; rows whose index == num_experts are padding: they load
nothing, output 0 and get zero gradients) and APPLY_SCALE (output_scale applied after the down-cast).
The PolyNorm backward writes per-row fp32 statistics [T, 4] (contributions to dL/dw0, dw1, dw2, db of the
effective coefficients), reduced to [E, 4] by a torch sum (dense) or by `_segment_sum_kernel` (grouped:
per-block, per-expert partials, then a fixed-order sum over blocks; deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import expert_of_row


def _launch_config(d: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) for a row of d features: 16 fp32 elements per thread from 2048 features on.

    Up to 32 warps (16384 features, e.g. mHC's RMSNorm over n*H) so a whole fp32 row and its
    temporaries stay within the register budget."""
    block_d = triton.next_power_of_2(d)
    return block_d, max(4, min(32, block_d // 512))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # TRITON_INTERPRET=1 runs on CPU tensors


# ------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_fwd_kernel(
    X,
    RES,
    H,
    Y,
    W,
    RSTD,
    stride_x,
    stride_res,
    stride_h,
    stride_y,
    D,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < D
    h = tl.load(X + row * stride_x + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        # add in the input dtype (rounded like torch's x + residual), then normalise the rounded sum
        res = tl.load(RES + row * stride_res + cols, mask=in_row, other=0.0)
        h = (h.to(tl.float32) + res.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h, mask=in_row)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=in_row)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd_dx_kernel(
    DY,
    DH,
    H,
    W,
    RSTD,
    DX,
    stride_dy,
    stride_dh,
    stride_h,
    stride_dx,
    D,
    HAS_DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dx of one row: rstd * g w - rstd^3 mean(g w h) h (+ dh, the gradient of the x + residual output)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < D
    h = tl.load(H + row * stride_h + cols, mask=in_row, other=0.0).to(tl.float32)
    gw = tl.load(DY + row * stride_dy + cols, mask=in_row, other=0.0).to(tl.float32)
    gw *= tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    mean_gwh = tl.sum(gw * h, axis=0) / D
    dx = rstd * gw - (rstd * rstd * rstd * mean_gwh) * h
    if HAS_DH:
        dx += tl.load(DH + row * stride_dh + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=in_row)


@triton.jit
def _rms_bwd_dw_kernel(
    DY,
    H,
    RSTD,
    DW_PARTIAL,
    stride_dy,
    stride_h,
    n_rows,
    D,
    rows_per_program,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Partial dL/dweight = sum over a block of rows of g h rstd, for one slice of BLOCK_C columns.

    Grid (column slices, row blocks); rows_per_program is a multiple of BLOCK_R."""
    col_block = tl.program_id(0)
    row_block = tl.program_id(1).to(tl.int64)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = cols < D
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(0, rows_per_program, BLOCK_R):
        rows = row_block * rows_per_program + start + tl.arange(0, BLOCK_R)
        in_rows = rows < n_rows
        mask = in_rows[:, None] & in_cols[None, :]
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=in_rows, other=0.0)
        acc += g * h * rstd[:, None]
    tl.store(DW_PARTIAL + row_block * D + cols, tl.sum(acc, axis=0), mask=in_cols)


def rms_norm_fwd(x_ND, residual_ND, weight_D, eps):
    """Returns (y_ND, h_ND (x + residual, or an empty tensor without residual), rstd_N fp32)."""
    x_ND = _unit_stride(x_ND)
    n, d = x_ND.shape
    y = x_ND.new_empty((n, d))
    rstd = x_ND.new_empty((n,), dtype=torch.float32)
    has_residual = residual_ND is not None
    h = x_ND.new_empty((n, d)) if has_residual else x_ND.new_empty((0,))
    if n == 0:
        return y, h, rstd
    res = _unit_stride(residual_ND) if has_residual else x_ND
    block_d, num_warps = _launch_config(d)
    _rms_fwd_kernel[(n,)](
        x_ND,
        res,
        h if has_residual else y,
        y,
        weight_D.contiguous(),
        rstd,
        x_ND.stride(0),
        res.stride(0),
        d if has_residual else 0,
        y.stride(0),
        d,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return y, h, rstd


# RMSNorm weight-gradient kernel tiles: BLOCK_R rows x BLOCK_C columns (128 bf16 columns = 256 B per row).
RMS_DW_BLOCK_R = 32
RMS_DW_BLOCK_C = 128


def rms_norm_bwd(dy_ND, dh_ND, h_ND, weight_D, rstd_N):
    """Returns (dx_ND in h's dtype, dweight fp32 [D]); dh_ND (grad of the x + residual output) is added.

    Two kernels, as inductor does it: dx one row per program (only the row and the weight in registers),
    then dweight as a column-sliced reduction that re-reads h and dy, written as fp32 partials per row
    block and summed by torch (deterministic). A single kernel that also accumulated a whole-row dweight
    partial per program held 4 row-sized fp32 vectors in registers: ~2 resident programs per SM at
    4096 features, register spills at 16384."""
    dy_ND = _unit_stride(dy_ND)
    h_ND = _unit_stride(h_ND)
    n, d = h_ND.shape
    dx = h_ND.new_empty((n, d))
    if n == 0:
        return dx, weight_D.new_zeros((d,), dtype=torch.float32)
    has_dh = dh_ND is not None
    dh = _unit_stride(dh_ND) if has_dh else dy_ND
    block_d, num_warps = _launch_config(d)
    _rms_bwd_dx_kernel[(n,)](
        dy_ND,
        dh,
        h_ND,
        weight_D.contiguous(),
        rstd_N,
        dx,
        dy_ND.stride(0),
        dh.stride(0),
        h_ND.stride(0),
        dx.stride(0),
        d,
        HAS_DH=has_dh,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    col_blocks = triton.cdiv(d, RMS_DW_BLOCK_C)
    # about 4 programs per SM in all; every program walks a multiple of RMS_DW_BLOCK_R rows
    row_blocks = max(1, min(triton.cdiv(4 * _num_sms(h_ND.device), col_blocks), triton.cdiv(n, RMS_DW_BLOCK_R)))
    rows_per_program = triton.cdiv(triton.cdiv(n, row_blocks), RMS_DW_BLOCK_R) * RMS_DW_BLOCK_R
    row_blocks = triton.cdiv(n, rows_per_program)
    dw_partial = h_ND.new_empty((row_blocks, d), dtype=torch.float32)
    _rms_bwd_dw_kernel[(col_blocks, row_blocks)](
        dy_ND,
        h_ND,
        rstd_N,
        dw_partial,
        dy_ND.stride(0),
        h_ND.stride(0),
        n,
        d,
        rows_per_program,
        BLOCK_R=RMS_DW_BLOCK_R,
        BLOCK_C=RMS_DW_BLOCK_C,
        num_warps=4,
    )
    return dx, dw_partial.sum(0)


# ------------------------------------------------------------------------------------------ PolyNorm
# Rows of at most POLY_CHUNK features (Motif's 1280-wide experts) are read once and kept in registers
# (ONE_CHUNK). Longer rows are processed in column chunks with two passes over the row (moments, then
# outputs): a whole 12288-wide fp32 row with its temporaries does not fit in registers. The second pass
# re-reads the row, normally from L1/L2.
POLY_CHUNK = 4096


@triton.jit
def _row_coefficients(EXPERT, W, B, row, num_experts, GROUPED: tl.constexpr):
    """(w0, w1, w2, b, valid) of one row; padding rows of the grouped op get zeros and valid = False."""
    if GROUPED:
        expert = tl.load(EXPERT + row)
        valid = expert < num_experts
        expert = tl.minimum(expert, num_experts - 1)
        w0 = tl.where(valid, tl.load(W + expert * 3 + 0).to(tl.float32), 0.0)
        w1 = tl.where(valid, tl.load(W + expert * 3 + 1).to(tl.float32), 0.0)
        w2 = tl.where(valid, tl.load(W + expert * 3 + 2).to(tl.float32), 0.0)
        b = tl.where(valid, tl.load(B + expert).to(tl.float32), 0.0)
    else:
        valid = row >= 0
        w0 = tl.load(W + 0).to(tl.float32)
        w1 = tl.load(W + 1).to(tl.float32)
        w2 = tl.load(W + 2).to(tl.float32)
        b = tl.load(B).to(tl.float32)
    return w0, w1, w2, b, valid


@triton.jit
def _poly_fwd_chunk(
    x,
    cols,
    in_row,
    valid,
    row,
    UP,
    Y,
    stride_up,
    stride_y,
    c1,
    c2,
    c3,
    b,
    output_scale,
    HAS_UP: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
):
    """Store out = (P(x) [* up]).to(dtype) [* output_scale] for one chunk of a row (x already fp32)."""
    p = ((c3 * x + c2) * x + c1) * x + b
    if HAS_UP:
        p = p * tl.load(UP + row * stride_up + cols, mask=in_row & valid, other=0.0).to(tl.float32)
    out = p.to(Y.dtype.element_ty)
    if APPLY_SCALE:
        out = (out.to(tl.float32) * output_scale).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, out, mask=in_row)


@triton.jit
def _poly_fwd_kernel(
    X,
    UP,
    W,
    B,
    EXPERT,
    Y,
    RSTD,
    stride_x,
    stride_up,
    stride_y,
    D,
    num_experts,
    eps,
    output_scale,
    HAS_UP: tl.constexpr,
    GROUPED: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    CHUNK: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    w0, w1, w2, b, valid = _row_coefficients(EXPERT, W, B, row, num_experts, GROUPED)
    # moments mean(x^2), mean(x^4), mean(x^6): from registers when the row fits one chunk, else pass 1
    if ONE_CHUNK:
        in_row = offs < D
        x = tl.load(X + row * stride_x + offs, mask=in_row & valid, other=0.0).to(tl.float32)
        x2 = x * x
        s2 = tl.sum(x2, axis=0)
        s4 = tl.sum(x2 * x2, axis=0)
        s6 = tl.sum(x2 * x2 * x2, axis=0)
    else:
        acc2 = tl.zeros([CHUNK], dtype=tl.float32)
        acc4 = tl.zeros([CHUNK], dtype=tl.float32)
        acc6 = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, D, CHUNK):
            cols = start + offs
            x = tl.load(X + row * stride_x + cols, mask=(cols < D) & valid, other=0.0).to(tl.float32)
            x2 = x * x
            acc2 += x2
            acc4 += x2 * x2
            acc6 += x2 * x2 * x2
        s2 = tl.sum(acc2, axis=0)
        s4 = tl.sum(acc4, axis=0)
        s6 = tl.sum(acc6, axis=0)
    r1 = tl.rsqrt(s2 / D + eps)
    r2 = tl.rsqrt(s4 / D + eps)
    r3 = tl.rsqrt(s6 / D + eps)
    c3 = w0 * r3
    c2 = w1 * r2
    c1 = w2 * r1
    # outputs; padding rows have zero coefficients -> 0
    if ONE_CHUNK:
        _poly_fwd_chunk(
            x, offs, in_row, valid, row, UP, Y, stride_up, stride_y, c1, c2, c3, b, output_scale, HAS_UP, APPLY_SCALE
        )
    else:
        for start in range(0, D, CHUNK):  # pass 2 re-reads the row (normally from L2)
            cols = start + offs
            in_row = cols < D
            x = tl.load(X + row * stride_x + cols, mask=in_row & valid, other=0.0).to(tl.float32)
            _poly_fwd_chunk(
                x,
                cols,
                in_row,
                valid,
                row,
                UP,
                Y,
                stride_up,
                stride_y,
                c1,
                c2,
                c3,
                b,
                output_scale,
                HAS_UP,
                APPLY_SCALE,
            )
    tl.store(RSTD + row * 3 + 0, r1)
    tl.store(RSTD + row * 3 + 1, r2)
    tl.store(RSTD + row * 3 + 2, r3)


@triton.jit
def _poly_bwd_load_chunk(
    X, DY, UP, row, cols, mask, stride_x, stride_dy, stride_up, output_scale, HAS_UP: tl.constexpr
):
    """(x, g_out = dL/dout * output_scale, g = dL/dP) of one chunk, fp32 (g = g_out * up with `up`)."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g_out = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32) * output_scale
    g = g_out
    if HAS_UP:
        g = g_out * tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    return x, g_out, g


@triton.jit
def _poly_bwd_store_chunk(
    x,
    g_out,
    g,
    cols,
    in_row,
    row,
    DX,
    DUP,
    stride_dx,
    stride_dup,
    c1,
    c2,
    c3,
    b,
    k1,
    k2,
    k3,
    HAS_UP: tl.constexpr,
):
    """Store dx (and d up = g_out * P(x)) of one chunk."""
    if HAS_UP:
        p = ((c3 * x + c2) * x + c1) * x + b
        tl.store(DUP + row * stride_dup + cols, (g_out * p).to(DUP.dtype.element_ty), mask=in_row)
    x2 = x * x
    dx = g * ((3.0 * c3 * x + 2.0 * c2) * x + c1) - x * (k1 + x2 * (k2 + x2 * k3))
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=in_row)


@triton.jit
def _poly_bwd_kernel(
    DY,
    X,
    UP,
    W,
    B,
    EXPERT,
    RSTD,
    DX,
    DUP,
    STATS,
    stride_dy,
    stride_x,
    stride_up,
    stride_dx,
    stride_dup,
    D,
    num_experts,
    output_scale,
    HAS_UP: tl.constexpr,
    GROUPED: tl.constexpr,
    CHUNK: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    w0, w1, w2, b, valid = _row_coefficients(EXPERT, W, B, row, num_experts, GROUPED)
    r1 = tl.load(RSTD + row * 3 + 0)
    r2 = tl.load(RSTD + row * 3 + 1)
    r3 = tl.load(RSTD + row * 3 + 2)
    c3 = w0 * r3
    c2 = w1 * r2
    c1 = w2 * r1
    # with g = dL/dP, the row sums t_p = sum(g x^p) and sum(g): from registers when the row fits one
    # chunk (the row is then read once), else in a first pass over the chunks
    if ONE_CHUNK:
        in_row = offs < D
        x, g_out, g = _poly_bwd_load_chunk(
            X, DY, UP, row, offs, in_row & valid, stride_x, stride_dy, stride_up, output_scale, HAS_UP
        )
        gx = g * x
        t1 = tl.sum(gx, axis=0)
        t2 = tl.sum(gx * x, axis=0)
        t3 = tl.sum(gx * x * x, axis=0)
        t0 = tl.sum(g, axis=0)
    else:
        acc1 = tl.zeros([CHUNK], dtype=tl.float32)
        acc2 = tl.zeros([CHUNK], dtype=tl.float32)
        acc3 = tl.zeros([CHUNK], dtype=tl.float32)
        acc_g = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, D, CHUNK):
            cols = start + offs
            x, g_out, g = _poly_bwd_load_chunk(
                X, DY, UP, row, cols, (cols < D) & valid, stride_x, stride_dy, stride_up, output_scale, HAS_UP
            )
            gx = g * x
            acc_g += g
            acc1 += gx
            acc2 += gx * x
            acc3 += gx * x * x
        t1 = tl.sum(acc1, axis=0)
        t2 = tl.sum(acc2, axis=0)
        t3 = tl.sum(acc3, axis=0)
        t0 = tl.sum(acc_g, axis=0)
    # d/dx [w x^p r_p] = w r_p p x^(p-1) g - w r_p^3 mean(g x^p) p x^(2p-1)   (docs/model-spec.md §1.1), so
    # dx = g (c1 + 2 c2 x + 3 c3 x^2) - (k1 x + 2 k2 x^3 + 3 k3 x^5) with k_p = c_p r_p^2 t_p / D
    k1 = c1 * r1 * r1 * t1 / D
    k2 = 2.0 * c2 * r2 * r2 * t2 / D
    k3 = 3.0 * c3 * r3 * r3 * t3 / D
    if ONE_CHUNK:
        _poly_bwd_store_chunk(
            x, g_out, g, offs, in_row, row, DX, DUP, stride_dx, stride_dup, c1, c2, c3, b, k1, k2, k3, HAS_UP
        )
    else:
        for start in range(0, D, CHUNK):  # pass 2 re-reads the row chunks (normally from L2)
            cols = start + offs
            in_row = cols < D
            x, g_out, g = _poly_bwd_load_chunk(
                X, DY, UP, row, cols, in_row & valid, stride_x, stride_dy, stride_up, output_scale, HAS_UP
            )
            _poly_bwd_store_chunk(
                x, g_out, g, cols, in_row, row, DX, DUP, stride_dx, stride_dup, c1, c2, c3, b, k1, k2, k3, HAS_UP
            )
    tl.store(STATS + row * 4 + 0, r3 * t3)
    tl.store(STATS + row * 4 + 1, r2 * t2)
    tl.store(STATS + row * 4 + 2, r1 * t1)
    tl.store(STATS + row * 4 + 3, t0)


@triton.jit
def _segment_sum_kernel(
    STATS,
    EXPERT,
    PARTIAL,
    n_rows,
    num_experts,
    BLOCK_R: tl.constexpr,
    K: tl.constexpr,
):
    """Per-expert sums of the [n_rows, K] per-row stats over one block of BLOCK_R rows.

    Rows are grouped by expert (contiguous, ascending), so a block holds experts first..last only; the
    program writes PARTIAL[block, e, :] for those and leaves the other (zero-initialised) entries alone.
    Padding rows (expert == num_experts) are skipped."""
    block = tl.program_id(0).to(tl.int64)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, K)
    in_range = rows < n_rows
    expert = tl.load(EXPERT + rows, mask=in_range, other=num_experts)
    valid = expert < num_experts
    stats = tl.load(STATS + rows[:, None] * K + cols[None, :], mask=valid[:, None], other=0.0)
    first = tl.min(tl.where(valid, expert, num_experts), axis=0)
    last = tl.max(tl.where(valid, expert, -1), axis=0)
    for e in range(first, last + 1):  # empty when the block holds only padding
        sums = tl.sum(tl.where((expert == e)[:, None], stats, 0.0), axis=0)
        tl.store(PARTIAL + (block * num_experts + e) * K + cols, sums)


# Rows per program of the per-expert reduction: 2048 rows x 4 fp32 stats = 32 KiB per program.
SEGMENT_BLOCK_ROWS = 2048


def per_expert_sums(stats_NK: torch.Tensor, expert_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """fp32 [num_experts, K]: per-expert sums of the rows of `stats_NK` (rows grouped by expert).

    Deterministic two-level reduction, no atomics: one program per block of SEGMENT_BLOCK_ROWS rows
    writes per-expert partials [num_blocks, E, K], then a fixed-order torch sum over the blocks. Work is
    O(rows + num_blocks * E), unlike a prefix sum over the rows (a sequential scan on the GPU)."""
    n, k = stats_NK.shape
    num_blocks = triton.cdiv(n, SEGMENT_BLOCK_ROWS)
    partial = stats_NK.new_zeros((num_blocks, num_experts, k), dtype=torch.float32)
    if n == 0:
        return partial.sum(0)
    _segment_sum_kernel[(num_blocks,)](
        stats_NK.contiguous(),
        expert_N,
        partial,
        n,
        num_experts,
        BLOCK_R=SEGMENT_BLOCK_ROWS,
        K=k,
        num_warps=8,
    )
    return partial.sum(0)


def _poly_launch_config(d: int) -> tuple[int, int]:
    """(CHUNK, num_warps) for the PolyNorm kernels."""
    return _launch_config(min(d, POLY_CHUNK))


def _expert_index(offs_E, n):
    """(expert index tensor or None, number of experts as int) for the kernels' GROUPED flag."""
    if offs_E is None:
        return None, 1
    return expert_of_row(offs_E, n), offs_E.shape[0]


def poly_norm_fwd(x_ND, up_ND, weight_E3, bias_E1, offs_E, eps, output_scale):
    """Returns (out_ND in x's dtype, rstd_N3 fp32 with columns r_1, r_2, r_3)."""
    x_ND = _unit_stride(x_ND)
    n, d = x_ND.shape
    y = x_ND.new_empty((n, d))
    rstd = x_ND.new_empty((n, 3), dtype=torch.float32)
    if n == 0:
        return y, rstd
    expert_N, num_experts = _expert_index(offs_E, n)
    up = _unit_stride(up_ND) if up_ND is not None else x_ND
    chunk, num_warps = _poly_launch_config(d)
    _poly_fwd_kernel[(n,)](
        x_ND,
        up,
        weight_E3.contiguous(),
        bias_E1.contiguous(),
        expert_N if expert_N is not None else rstd,
        y,
        rstd,
        x_ND.stride(0),
        up.stride(0),
        y.stride(0),
        d,
        num_experts,
        eps,
        output_scale,
        HAS_UP=up_ND is not None,
        GROUPED=offs_E is not None,
        APPLY_SCALE=output_scale != 1.0,
        CHUNK=chunk,
        ONE_CHUNK=d <= chunk,
        num_warps=num_warps,
    )
    return y, rstd


def poly_norm_bwd(dy_ND, x_ND, up_ND, weight_E3, bias_E1, offs_E, rstd_N3, output_scale):
    """Returns (dx_ND, dup_ND (empty without up), stats_E4 fp32): stats columns are dL/d(w0, w1, w2, b) of
    the effective coefficients, one row per expert (E = 1 for the dense op)."""
    dy_ND = _unit_stride(dy_ND)
    x_ND = _unit_stride(x_ND)
    n, d = x_ND.shape
    dx = x_ND.new_empty((n, d))
    dup = up_ND.new_empty((n, d)) if up_ND is not None else x_ND.new_empty((0,))
    num_param_sets = weight_E3.shape[0]
    stats = x_ND.new_empty((n, 4), dtype=torch.float32)
    if n == 0:
        return dx, dup, stats.new_zeros((num_param_sets, 4))
    expert_N, num_experts = _expert_index(offs_E, n)
    up = _unit_stride(up_ND) if up_ND is not None else x_ND
    chunk, num_warps = _poly_launch_config(d)
    _poly_bwd_kernel[(n,)](
        dy_ND,
        x_ND,
        up,
        weight_E3.contiguous(),
        bias_E1.contiguous(),
        expert_N if expert_N is not None else rstd_N3,
        rstd_N3,
        dx,
        dup if up_ND is not None else dx,
        stats,
        dy_ND.stride(0),
        x_ND.stride(0),
        up.stride(0),
        dx.stride(0),
        d,
        d,
        num_experts,
        output_scale,
        HAS_UP=up_ND is not None,
        GROUPED=offs_E is not None,
        CHUNK=chunk,
        ONE_CHUNK=d <= chunk,
        num_warps=num_warps,
    )
    if expert_N is None:
        return dx, dup, stats.sum(0, keepdim=True)
    return dx, dup, per_expert_sums(stats, expert_N, num_experts)
