"""Triton INT8 quantize/dequantize of K/V rows with one fp32 scale per row of D values.

Same semantics as the reference, bit for bit: the scale is absmax * (1/127) (at least 1e-8)
and values round half to even, as torch.round does. A program handles ROWS rows so a
launch over a few thousand (token, head) rows is not a few thousand tiny programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_device, head_block

INV_127 = tl.constexpr(1.0 / 127.0)  # rounded to fp32 in the kernel, as torch rounds it
ROW_TILE = 4096  # elements per program: ROWS * BLOCK_D, a few KiB of registers


@triton.jit
def round_half_even(y):
    # torch.round rounds halves to even; floor(y + 0.5) would round 2.5 to 3, not 2.
    f = tl.floor(y)
    frac = y - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr,  # x, q: (R, D) contiguous; scale: (R,)
    n_rows, head_dim,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask = (r[:, None] < n_rows) & (d[None, :] < head_dim)  # (ROWS, BLOCK_D)
    offs = r[:, None].to(tl.int64) * head_dim + d[None, :]  # (ROWS, BLOCK_D)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    # Masked lanes load 0, so they never raise the absmax.
    absmax = tl.max(tl.abs(x), axis=1)  # (ROWS,)
    scale = tl.maximum(absmax * INV_127, 1e-8)  # (ROWS,), the reference's fp32 product
    # div_rn: IEEE division, as torch does; the default GPU division is approximate
    # and would move values that sit at a rounding boundary.
    y = tl.math.div_rn(x, scale[:, None])  # (ROWS, BLOCK_D) / (ROWS, 1)
    q = tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + r, scale, mask=r < n_rows)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, out_ptr,  # q, out: (R, D) contiguous; scale: (R,)
    n_rows, head_dim,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask = (r[:, None] < n_rows) & (d[None, :] < head_dim)  # (ROWS, BLOCK_D)
    offs = r[:, None].to(tl.int64) * head_dim + d[None, :]  # (ROWS, BLOCK_D)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)  # (ROWS, BLOCK_D)
    scale = tl.load(scale_ptr + r, mask=r < n_rows, other=0.0)  # (ROWS,)
    tl.store(out_ptr + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)  # (ROWS, BLOCK_D)


def _grid(n_rows: int, block_d: int) -> tuple[int, tuple[int]]:
    rows = max(1, ROW_TILE // block_d)
    return rows, (triton.cdiv(n_rows, rows),)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """contract.QuantizeInt8."""
    check_device(x)
    d = x.shape[-1]
    block_d = head_block(d)
    x = x.contiguous()  # (..., D), rows of D values back to back: the kernel sees (R, D)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)  # (..., D)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)  # (...,)
    n_rows = scale.numel()
    if n_rows:
        rows, grid = _grid(n_rows, block_d)
        _quantize_kernel[grid](x, q, scale, n_rows, d, ROWS=rows, BLOCK_D=block_d)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """contract.DequantizeInt8."""
    check_device(q, scale)
    d = q.shape[-1]
    block_d = head_block(d)
    q = q.contiguous()  # (..., D): the kernel sees (R, D)
    scale = scale.to(torch.float32).contiguous()  # (...,): the kernel sees (R,)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # (..., D)
    n_rows = scale.numel()
    if n_rows:
        rows, grid = _grid(n_rows, block_d)
        _dequantize_kernel[grid](q, scale, out, n_rows, d, ROWS=rows, BLOCK_D=block_d)
    return out
