"""The TIR of register tiles: descriptions and implementations the vector families share.

Two shapes of ``B``: plain panels ``B[k, nr]`` (fp32, :func:`plain_tile_functions`) and panels
with ``group`` consecutive ``k`` per 32-bit lane ``B[k / group, nr, group]`` (VNNI 4, s16 and bf16
2: :func:`grouped_desc` with :func:`grouped_impl`, the latter taking the ISA's vector update).
The implementation broadcasts one element (or group) of ``A`` per row and issues ``nr / lanes``
vector updates per row and ``k`` step; LLVM keeps the ``mr * nr / lanes`` accumulators in
registers across the ``k`` loop (the assembly tests check: no spills).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .kernel import Microkernel


def plain_tile_functions(kernel: Microkernel, kc: int):
    """The (description, implementation) pair of an ``mr x nr`` fp32 tile over ``kc`` steps."""
    mr, nr, lanes, dtype = kernel.mr, kernel.nr, kernel.lanes, kernel.in_dtype
    vectors = nr // lanes

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (kc, nr), dtype, offset_factor=1, strides=[ldb, 1])
        C = T.match_buffer(c, (mr, nr), dtype, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:kc, 0:nr])
            T.writes(C[0:mr, 0:nr])
            for i, j, kk in T.grid(mr, nr, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (kc, nr), dtype, offset_factor=1, strides=[ldb, 1])
        C = T.match_buffer(c, (mr, nr), dtype, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:kc, 0:nr])
            T.writes(C[0:mr, 0:nr])
            for kk in T.serial(kc):
                for i in T.unroll(mr):
                    for v in T.unroll(vectors):
                        C[i, T.ramp(v * lanes, 1, lanes)] = C[
                            i, T.ramp(v * lanes, 1, lanes)
                        ] + T.broadcast(A[i, kk], lanes) * B[kk, T.ramp(v * lanes, 1, lanes)]

    @T.prim_func(s_tir=True)
    def desc_one_row(a: T.handle, b: T.handle, c: T.handle):
        # With mr == 1 blockize keeps the unit row loop but drops its block var: match that.
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (kc, nr), dtype, offset_factor=1, strides=[ldb, 1])
        C = T.match_buffer(c, (mr, nr), dtype, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:kc, 0:nr])
            T.writes(C[0:mr, 0:nr])
            for _i, j, kk in T.grid(1, nr, kc):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, kk])
                    C[0, vj] = C[0, vj] + A[0, vk] * B[vk, vj]

    return (desc_one_row if mr == 1 else desc), impl


def grouped_desc(mr: int, nr: int, kc: int, a_dtype: str, b_dtype: str, acc: str, group: int):
    """The description of a tile whose ``B`` is packed with ``group`` consecutive ``k``::

        C[mr, nr] (acc) += acc(A[mr, kc]) * acc(B[kc / group, nr, group])

    shared by the VNNI (group 4), s16 (2) and bf16 (2) microkernels.
    """
    rows = kc // group

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (rows, nr, group), b_dtype, offset_factor=1,
                           strides=[ldb, group, 1])
        C = T.match_buffer(c, (mr, nr), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:rows, 0:nr, 0:group])
            T.writes(C[0:mr, 0:nr])
            for i, j, kk in T.grid(mr, nr, kc):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + T.Cast(acc, A[vi, vk]) * T.Cast(
                        acc, B[vk // group, vj, vk % group])

    @T.prim_func(s_tir=True)
    def desc_one_row(a: T.handle, b: T.handle, c: T.handle):
        # With mr == 1 blockize keeps the unit row loop but drops its block var: match that.
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (rows, nr, group), b_dtype, offset_factor=1,
                           strides=[ldb, group, 1])
        C = T.match_buffer(c, (mr, nr), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:rows, 0:nr, 0:group])
            T.writes(C[0:mr, 0:nr])
            for _i, j, kk in T.grid(1, nr, kc):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, kk])
                    C[0, vj] = C[0, vj] + T.Cast(acc, A[0, vk]) * T.Cast(
                        acc, B[vk // group, vj, vk % group])

    return desc_one_row if mr == 1 else desc


def grouped_impl(mr: int, nr: int, kc: int, a_dtype: str, b_dtype: str, acc: str,
                  group: int, lanes: int, update, annotations=None):
    """The implementation of a tile whose ``B`` is packed with ``group`` consecutive ``k``
    (matching :func:`grouped_desc`): per group of ``k``, row and vector of ``lanes``
    accumulators, ``C = update(C, A, B, i, g, v)``, where ``update`` returns the vector
    expression of one ISA's instructions."""
    rows = kc // group
    vectors = nr // lanes

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        lda = T.int32()
        ldb = T.int32()
        ldc = T.int32()
        A = T.match_buffer(a, (mr, kc), a_dtype, offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (rows, nr, group), b_dtype, offset_factor=1,
                           strides=[ldb, group, 1])
        C = T.match_buffer(c, (mr, nr), acc, offset_factor=1, strides=[ldc, 1], scope="local")
        with T.sblock("root"):
            T.reads(C[0:mr, 0:nr], A[0:mr, 0:kc], B[0:rows, 0:nr, 0:group])
            T.writes(C[0:mr, 0:nr])
            for g in T.serial(rows, annotations=annotations):
                for i in T.unroll(mr):
                    for v in T.unroll(vectors):
                        C[i, T.ramp(v * lanes, 1, lanes)] = update(
                            C[i, T.ramp(v * lanes, 1, lanes)], A, B, i, g, v)

    return impl
