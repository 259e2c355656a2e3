"""One packed GEMM for every dtype: constant weights packed at compile time in the layout of the
microkernel chosen for the GEMM.

:func:`emit_packed_gemm` asks :func:`~tvm_hybrid.schedules.gemm.heuristics.select` for the
best kernel of the GEMM's operand dtype (``N`` and ``K`` padded by the packing), packs the
weights in that kernel's :attr:`~tvm_hybrid.microkernels.Microkernel.weight_layout` with numpy
and emits one compute, :func:`packed_gemm`, whatever the dtype::

    acc[..., j] = sum_k acc_t(x[..., k]) * acc_t(W_packed[j // p, k // g, j % p, k % g])
    y[..., j]   = out_t(acc[..., j] - compensation[j])          (j < N; padding sliced off)

with panels of ``p`` columns and groups of ``g`` consecutive ``k`` (``W_packed[N / p, K, p]``
when ``g`` is 1: fp32). The front-ends only prepare the operands: fp32 and bf16 GEMMs
(``prepack.py``), integer GEMMs with zero-point compensation (``integer_gemm.py``, used by the
QDQ and ``MatMulInteger`` paths). Every packed GEMM's kernel name contains
:data:`PACKED_GEMM`, which the fusion patterns anchor on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from tvm import relax, te
from tvm.target import Target

from ..microkernels import best_vector_family
from ..microkernels.transposed_tail import (
    TRANSPOSED_PER_COLUMN,
    TRANSPOSED_TAIL,
    transposed_layout,
    write_transposed_copy,
)
from ..schedules.gemm.heuristics import GemmShape, packing_kernel, padded_nk, padded_rows

#: Part of every packed GEMM's kernel name (the fusion patterns' anchor).
PACKED_GEMM = "packed_matmul"
#: Kernel names by operand dtype (what the profile report and ``kernel_names()`` show).
KERNEL_NAMES = {
    "float32": f"hybrid_{PACKED_GEMM}",
    "bfloat16": f"hybrid_bf16_{PACKED_GEMM}",
    "uint8": f"hybrid_int8_{PACKED_GEMM}",
    "int16": f"hybrid_int8_{PACKED_GEMM}",
}


def pack_weight(weight: np.ndarray, panel: int, group: int = 1, dtype=None,
                padded: tuple[int, int] | None = None) -> np.ndarray:
    """``W[K, N]`` to ``W_packed[ceil(N / panel), ceil(K / group), panel, group]`` in ``dtype``
    (``[ceil(N / panel), K, panel]`` when ``group`` is 1); ``K`` and ``N`` zero-padded, to
    ``padded = (N, K)`` when given (whole tiles of a per-block kernel: ``heuristics.padded_nk``)."""
    dtype = weight.dtype if dtype is None else dtype
    k, n = weight.shape
    n_pad, k_pad = padded or (-(-n // panel) * panel, -(-k // group) * group)
    full = np.zeros((k_pad, n_pad), dtype)
    full[:k, :n] = weight.astype(dtype)
    if group == 1:
        return np.ascontiguousarray(full.reshape(k_pad, n_pad // panel, panel).transpose(1, 0, 2))
    return np.ascontiguousarray(
        full.reshape(k_pad // group, group, n_pad // panel, panel).transpose(2, 0, 3, 1))


def packed_gemm(x: te.Tensor, packed: te.Tensor, n: int, acc_dtype: str, out_dtype: str,
                compensation: te.Tensor | None = None,
                zero_point: te.Tensor | None = None, out_rows: int | None = None,
                transposed_run: int = 0, per_column: bool = False) -> te.Tensor:
    """``x[..., M, K] @ W`` with ``W`` packed (module docstring); the output has ``n`` columns
    (and its first ``out_rows`` rows when ``x``'s ``M`` was padded: ``padded_rows``).

    ``compensation[N]`` (integer GEMMs) is subtracted, times the 0-d ``zero_point`` when one
    is given (a zero point known only at run time). ``transposed_run``: the last panel holds
    a transposed copy of its used columns with that many ``k`` per vector
    (``microkernels/transposed_tail.py``), which the GEMM block's annotation says;
    ``per_column``: one column per vector.
    """
    grouped = len(packed.shape) == 4
    panels, rows, panel = (int(d) for d in packed.shape[:3])
    group = int(packed.shape[3]) if grouped else 1
    batch = tuple(x.shape[:-1])
    k = te.reduce_axis((0, rows * group), name="k")

    def weight(j, kk):
        if grouped:
            return packed[j // panel, kk // group, j % panel, kk % group]
        return packed[j // panel, kk, j % panel]

    acc = te.compute(
        (*batch, panels * panel),
        lambda *idx: te.sum(x[(*idx[:-1], k)].astype(acc_dtype)
                            * weight(idx[-1], k).astype(acc_dtype), axis=k),
        name=PACKED_GEMM,
        attrs=({TRANSPOSED_TAIL: transposed_run, TRANSPOSED_PER_COLUMN: int(per_column)}
               if transposed_run else None),
    )
    out = (*batch[:-1], batch[-1] if out_rows is None else out_rows, n)
    if compensation is None:
        if tuple(out) == tuple(acc.shape) and out_dtype == acc_dtype:
            return acc
        return te.compute(out, lambda *idx: acc[idx].astype(out_dtype), name="unpad")
    if zero_point is None:
        return te.compute(out, lambda *idx: acc[idx] - compensation[idx[-1]],
                          name="compensate")
    return te.compute(out, lambda *idx: acc[idx] - zero_point[()] * compensation[idx[-1]],
                      name="compensate")


def transposed_copy(target: Target, in_dtype: str, packed: np.ndarray, weight: np.ndarray,
                    rows: int = 1) -> tuple[int, int, bool] | None:
    """``(width, run, per_column)`` of the transposed copy of the last panel's used columns to
    write into fp32 ``packed`` weights (of ``weight[K, N]``; ``microkernels/transposed_tail.py``),
    on the vectors of ``target``'s fp32 tiles; None when the panel is full or has no room, or
    when one of its used columns equals a column of the full panels (the copy sums in another
    order than their broadcast update, and columns of equal weights must give equal outputs:
    :func:`tail_columns_distinct`). ``rows``: of the tile expected to run it (a per-column
    copy needs an accumulator per row and column)."""
    family = best_vector_family(target, in_dtype)
    if in_dtype != "float32" or packed.ndim != 3 or family is None:
        return None
    panels, _, panel = packed.shape
    n = weight.shape[1]
    used = n - (panels - 1) * panel
    if not 0 < used < panel or not tail_columns_distinct(weight, used):
        return None
    return transposed_layout(family.first.lanes, panel, used, rows, family.first.num_registers)


def tail_columns_distinct(weight: np.ndarray, used: int) -> bool:
    """Whether none of the ``used`` last columns of ``weight[K, N]`` equals one of the others
    (element for element; ``-0.0`` equals ``0.0``): only then may the last panel sum its
    columns in another order than the full panels (``microkernels/transposed_tail.py``: onnx's
    light AlexNet and ZFNet have equal columns). Columns of other weights differ in their
    results anyway."""
    others = weight[:, : weight.shape[1] - used]
    for column in weight[:, weight.shape[1] - used:].T:
        candidates = others[:, others[0] == column[0]]  # the first row rules out most
        if candidates.size and bool((candidates == column[:, None]).all(axis=0).any()):
            return False
    return True


def emit_packed_gemm(builder: relax.BlockBuilder, target: Target, x: relax.Expr,
                     weight: np.ndarray, *, weight_dtype, acc_dtype: str, out_dtype: str,
                     compensation: np.ndarray | None = None,
                     zero_point: relax.Expr | None = None,
                     pad_rows: bool = True,
                     row_padder: Callable[[int], relax.Expr] | None = None
                     ) -> relax.Expr | None:
    """The call of ``x @ weight`` as a packed GEMM (padding and packing emitted), or None when
    ``target`` has no kernel for it (then nothing is emitted).

    Parameters
    ----------
    builder
        The block builder of the rewriting mutator.
    x
        The activations ``[..., M, K]``, static shape, already in the kernel's operand dtype.
    weight
        The constant ``W[K, N]``; packed as ``weight_dtype``.
    acc_dtype, out_dtype
        Accumulator and output dtypes.
    compensation, zero_point
        For integer GEMMs: see :func:`packed_gemm`.
    pad_rows
        Whether ``x`` may be padded with zero rows (``padded_rows``); not for the output of a
        hand-written kernel (im2col), whose buffer FuseTIR cannot share with the padding.
    row_padder
        Where ``x`` may be padded but not by a padding op: emits ``x`` with the given number
        of rows appended (an fp32 im2col writing zero rows itself, ``prepack.py``); their
        results are sliced off in the kernel.
    """
    in_dtype = str(x.ty.dtype)
    k, n = (int(d) for d in weight.shape)
    *batch, m = (int(d) for d in x.ty.shape.values[:-1])
    extra_rows = padded_rows(target, in_dtype, GemmShape(math.prod(batch), m, n, k)) \
        if pad_rows or row_padder else 0
    kernel = packing_kernel(target, in_dtype, m + extra_rows, n, k)
    if kernel is not None and row_padder is not None and extra_rows \
            and padded_nk(kernel, n, k)[1] != k:
        # K needs a padding op too, which would follow the padder's kernel: keep the rows
        extra_rows, kernel = 0, packing_kernel(target, in_dtype, m, n, k)
    if kernel is None:
        return None
    panel, group = kernel.weight_layout
    n_padded, k_padded = padded_nk(kernel, n, k)
    pad = k_padded - k  # zero columns of x times zero rows of W add nothing
    if row_padder is not None and extra_rows:
        x = row_padder(extra_rows)
    elif pad or extra_rows:  # zero rows of x give rows the kernel slices off
        x = builder.emit(relax.op.nn.pad(x, [0, 0] * (x.ty.ndim - 2) + [0, extra_rows, 0, pad]))
    packed = pack_weight(weight, panel, group, weight_dtype, (n_padded, k_padded))
    copy = transposed_copy(target, in_dtype, packed, weight, kernel.mr)
    if copy is not None:
        write_transposed_copy(packed, weight, *copy)
    packed = relax.const(packed)
    extra = [] if compensation is None else [relax.const(compensation)]
    if zero_point is not None:
        extra.append(zero_point)

    def compute(x, packed, *rest):
        comp = rest[0] if rest else None
        zp = rest[1] if len(rest) > 1 else None
        return packed_gemm(x, packed, n, acc_dtype, out_dtype, comp, zp,
                           out_rows=m if extra_rows else None,
                           transposed_run=copy[1] if copy else 0,
                           per_column=bool(copy and copy[2]))

    return builder.call_te(compute, x, packed, *extra, primfunc_name_hint=KERNEL_NAMES[in_dtype])
