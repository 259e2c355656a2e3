"""The TIR of tile intrinsics: one PrimFunc skeleton, the reference update, the vector bodies.

A tensor intrinsic is a (description, implementation) pair of PrimFuncs over the same strided
buffers ``A``, ``B`` and a local accumulator ``C``: :func:`tile_function` builds either from a
``T.macro`` body. :func:`reference_update` is the description every family shares (what the
template's block must match), ``C[i, j] += acc(A[i, k]) * acc(B at (j, k))`` with ``B`` in the
family's packed layout. Two layouts of vector families are here: plain panels ``B[k, nr]``
(fp32, :func:`plain_tile_functions`) and panels with ``group`` consecutive ``k`` per 32-bit lane
``B[k / group, nr, group]`` (VNNI 4, s16 and bf16 2: :func:`grouped_tile_functions`, taking the
ISA's vector update). Their implementations broadcast one element (or group) of ``A`` per row
and issue ``nr / lanes`` vector updates per row and ``k`` step; LLVM keeps the
``mr * nr / lanes`` accumulators in registers across the ``k`` loop (the assembly tests check:
no spills).
"""

from __future__ import annotations

from collections.abc import Callable

from tvm.script import tirx as T

from .kernel import Microkernel


def tile_function(a_shape: tuple, b_shape: tuple, b_strides: tuple, dtypes: tuple[str, ...],
                  c_shape: tuple, body):
    """A PrimFunc over ``A[a_shape]``, ``B[b_shape]`` (row stride free, then ``b_strides``) and
    a local ``C[c_shape]`` of ``dtypes`` (A, B, C), whose root block reads all three, writes
    ``C`` and runs ``body(A, B, C)`` (a ``T.macro``)."""
    a_dtype, b_dtype, acc = dtypes
    a_region = tuple(slice(0, d) for d in a_shape)
    b_region = tuple(slice(0, d) for d in b_shape)
    c_region = tuple(slice(0, d) for d in c_shape)

    @T.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, a_shape, a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, b_shape, b_dtype, offset_factor=1, strides=[ldb, *b_strides])
        C = T.match_buffer(c, c_shape, acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[c_region], A[a_region], B[b_region])
            T.writes(C[c_region])
            body(A, B, C)

    return func


def reference_update(mr: int, nr: int, kc: int, acc: str, b_at: Callable, cast: bool = True):
    """The description's body: ``C[i, j] += acc(A[i, k]) * acc(b_at(B, j, k))``, the
    operands cast to the accumulator's ``acc`` when ``cast`` (the template's block has no cast
    when they are ``acc`` already).

    With ``mr == 1`` blockize keeps the unit row loop but drops its block var: so does this.
    """

    def _as(dtype: str, value):
        return T.Cast(dtype, value) if cast else value
    @T.macro
    def body(A, B, C):
        for i, j, kk in T.grid(mr, nr, kc):
            with T.sblock("update"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                C[vi, vj] = C[vi, vj] + _as(acc, A[vi, vk]) * _as(acc, b_at(B, vj, vk))

    @T.macro
    def one_row(A, B, C):
        for _i, j, kk in T.grid(1, nr, kc):
            with T.sblock("update"):
                vj, vk = T.axis.remap("SR", [j, kk])
                C[0, vj] = C[0, vj] + _as(acc, A[0, vk]) * _as(acc, b_at(B, vj, vk))

    return one_row if mr == 1 else body


def broadcast_fma(kernel: Microkernel, kc: int):
    """The vector body of an ``mr x nr`` fp32 tile over ``kc`` steps, a ``T.macro`` over
    ``A[mr, kc]``, ``B[kc, nr]`` and ``C[mr, nr]`` (any strides): per ``k`` and row, one
    element of ``A`` broadcast and ``nr / lanes`` FMAs with ``B``'s row. The tile intrinsics
    below and the fused attention kernel (``schedules/attention``) share it."""
    mr, lanes = kernel.mr, kernel.lanes
    vectors = kernel.nr // lanes

    @T.macro
    def body(A, B, C):
        for kk in T.serial(kc):
            for i in T.unroll(mr):
                for v in T.unroll(vectors):
                    C[i, T.ramp(v * lanes, 1, lanes)] = C[
                        i, T.ramp(v * lanes, 1, lanes)
                    ] + T.broadcast(A[i, kk], lanes) * B[kk, T.ramp(v * lanes, 1, lanes)]

    return body


def plain_tile_functions(kernel: Microkernel, kc: int):
    """The (description, implementation) pair of an ``mr x nr`` fp32 tile over ``kc`` steps."""
    mr, nr, dtype = kernel.mr, kernel.nr, kernel.in_dtype
    buffers = ((mr, kc), (kc, nr), (1,), (dtype, dtype, dtype), (mr, nr))
    desc = reference_update(mr, nr, kc, dtype, lambda B, j, k: B[k, j], cast=False)
    return tile_function(*buffers, desc), tile_function(*buffers, broadcast_fma(kernel, kc))


def grouped_updates(kernel: Microkernel, kc: int, update, annotations=None):
    """The vector body of an ``mr x nr`` tile of a grouped family over ``kc`` steps, a
    ``T.macro`` over ``A[mr, kc]``, ``B[kc / group, nr, group]`` and ``C[mr, nr]`` (any
    strides): per group of ``k``, row and vector, ``C = update(C, A, B, i, g, v)``. The tile
    intrinsics below and the quantized attention kernel (``schedules/attention``) share it."""
    mr, lanes = kernel.mr, kernel.lanes
    rows, vectors = kc // kernel.k_step, kernel.nr // lanes

    @T.macro
    def body(A, B, C):
        for g in T.serial(rows, annotations=annotations):
            for i in T.unroll(mr):
                for v in T.unroll(vectors):
                    C[i, T.ramp(v * lanes, 1, lanes)] = update(
                        C[i, T.ramp(v * lanes, 1, lanes)], A, B, i, g, v)

    return body


def grouped_tile_functions(kernel: Microkernel, kc: int, b_dtype: str, update,
                           annotations=None):
    """The (description, implementation) pair of a tile whose ``B`` is packed with ``group =
    kernel.k_step`` consecutive ``k``::

        C[mr, nr] (acc) += acc(A[mr, kc]) * acc(B[kc / group, nr, group])

    The implementation runs, per group of ``k``, row and vector of ``lanes`` accumulators,
    ``C = update(C, A, B, i, g, v)``, where ``update`` returns the vector expression of one
    ISA's instructions (VNNI: group 4; s16 and bf16: 2).
    """
    mr, nr, group = kernel.mr, kernel.nr, kernel.k_step
    rows = kc // group
    vector_updates = grouped_updates(kernel, kc, update, annotations)
    buffers = ((mr, kc), (rows, nr, group), (group, 1),
               (kernel.in_dtype, b_dtype, kernel.acc_dtype), (mr, nr))
    desc = reference_update(mr, nr, kc, kernel.acc_dtype,
                            lambda B, j, k: B[k // group, j, k % group])
    return tile_function(*buffers, desc), tile_function(*buffers, vector_updates)
