"""Triton kernels of :mod:`sat.edge_messages` (imported only where Triton is installed).

The functions are left undecorated: :func:`sat.edge_messages._kernels` wraps them with
``triton.jit``, compiled for CUDA or, for CPU tensors, in Triton's interpreter.

Each program owns one output row and a ``BLOCK_D`` slice of its columns, and walks that row's
edges (a CSR segment ``seg[row]:seg[row + 1]`` of ``perm``) ``BLOCK_E`` at a time, summing in
``ACC`` precision. Every output row is written exactly once, so no atomics are needed.
"""
import triton.language as tl


def aggregate_kernel(
    a_ptr, b_ptr, ia_ptr, ib_ptr, norm_ptr, perm_ptr, seg_ptr, out_ptr, D,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """out[v] = sum over edges j into v of norm[j] * relu(a[ia[j]] + b[ib[j]])."""
    row = tl.program_id(0).to(tl.int64)  # row * D may pass 2**31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    start = tl.load(seg_ptr + row)
    end = tl.load(seg_ptr + row + 1)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for first in range(start, end, BLOCK_E):
        slots = first + tl.arange(0, BLOCK_E)
        edge_mask = slots < end
        edge = tl.load(perm_ptr + slots, mask=edge_mask, other=0)
        ra = tl.load(ia_ptr + edge, mask=edge_mask, other=0)
        rb = tl.load(ib_ptr + edge, mask=edge_mask, other=0)
        weight = tl.load(norm_ptr + edge, mask=edge_mask, other=0.0).to(ACC)
        tile_mask = edge_mask[:, None] & col_mask[None, :]
        xa = tl.load(a_ptr + ra[:, None] * D + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
        xb = tl.load(b_ptr + rb[:, None] * D + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
        acc += tl.sum(tl.maximum(xa + xb, 0.0) * weight[:, None], axis=0)
    tl.store(out_ptr + row * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def input_grad_kernel(
    own_ptr, other_ptr, i_other_ptr, dst_ptr, norm_ptr, grad_out_ptr, perm_ptr, seg_ptr, grad_ptr, D,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """grad[r] = sum over edges j reading row r of ``own`` of
    norm[j] * grad_out[dst[j]] * (own[r] + other[i_other[j]] > 0): the gradient of the aggregate
    with respect to one of its two inputs (``own``), the other being ``other``."""
    row = tl.program_id(0).to(tl.int64)  # row * D may pass 2**31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    start = tl.load(seg_ptr + row)
    end = tl.load(seg_ptr + row + 1)
    own = tl.load(own_ptr + row * D + cols, mask=col_mask, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for first in range(start, end, BLOCK_E):
        slots = first + tl.arange(0, BLOCK_E)
        edge_mask = slots < end
        edge = tl.load(perm_ptr + slots, mask=edge_mask, other=0)
        r_other = tl.load(i_other_ptr + edge, mask=edge_mask, other=0)
        r_dst = tl.load(dst_ptr + edge, mask=edge_mask, other=0)
        weight = tl.load(norm_ptr + edge, mask=edge_mask, other=0.0).to(ACC)
        tile_mask = edge_mask[:, None] & col_mask[None, :]
        other = tl.load(other_ptr + r_other[:, None] * D + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
        grad = tl.load(grad_out_ptr + r_dst[:, None] * D + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
        active = (own[None, :] + other) > 0.0
        acc += tl.sum(tl.where(active, grad * weight[:, None], 0.0), axis=0)
    tl.store(grad_ptr + row * D + cols, acc.to(grad_ptr.dtype.element_ty), mask=col_mask)
