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

A :class:`Tail` makes an implementation branch once per call: on the last panel of the packed
weights, of which the GEMM keeps only the first ``columns`` (``N`` padded to whole panels),
it updates only the vectors covering them (fp32: whole vectors, then one of 4 or 8 lanes for
the rest), so the padded columns cost no FMAs. Which panel a call reads is known from ``B``'s
offset. The description is unchanged: the skipped accumulators stay zero, as the update with
the panel's zero padding would leave them, and nothing reads them. An fp32 tail whose packed
weights hold its columns transposed (``Tail.run``) runs dot products along ``K`` instead
(``transposed_tail.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tvm.script import tirx as T

from .kernel import STACK_BYTES, Microkernel
from .transposed_tail import MIN_CHAINS, transposed_dot


@dataclasses.dataclass(frozen=True)
class Tail:
    """The last panel of the packed weights, partly used: it starts at element ``offset`` of
    ``B`` (``(N_padded / panel - 1) * K * panel``) and the GEMM keeps its first ``columns``."""

    offset: int
    columns: int
    #: ``k`` per vector of the transposed copy of the used columns the panel holds
    #: (``transposed_tail.py``); 0: none, the broadcast update of the used columns.
    run: int = 0
    #: Whether that copy holds one column per vector (else ``run`` ``k`` of every column).
    per_column: bool = False

    @property
    def key(self) -> str:
        """The intrinsic name's suffix."""
        copy = f"d{self.run}" + ("c" if self.per_column else "") if self.run else ""
        return f"_t{self.columns}at{self.offset}{copy}"


@dataclasses.dataclass(frozen=True)
class RowTail:
    """The last row tile of a GEMM whose ``A`` has fewer rows than whole tiles (``M`` padded to
    a better tile, ``heuristics.padded_rows``): it starts at element ``offset`` of ``A``
    (``(M_padded - mr) * K``) and only its first ``rows`` rows exist."""

    offset: int
    rows: int

    @property
    def key(self) -> str:
        """The intrinsic name's suffix."""
        return f"_r{self.rows}at{self.offset}"


def _row_branch(row_tail: RowTail | None, full, partial):
    """``full``, or with ``row_tail`` a macro running ``partial`` (the tile's first rows only)
    when ``A`` is the last row tile: the rows past ``A``'s are never read, so ``A`` needs no
    zero rows (``passes/row_padding.py`` drops the copy that added them)."""
    if row_tail is None:
        return full
    return _from_offset(lambda A, B: A, row_tail.offset, full, partial)


def _branch(tail: Tail | None, full, partial):
    """``full`` (a ``T.macro`` over ``A, B, C``), or with ``tail`` a macro running ``partial``
    when ``B`` is the last panel and ``full`` otherwise; ``partial`` alone when the last panel
    is the only one (offset 0: the full branch could never run, and TVM drops it)."""
    if tail is None:
        return full
    if tail.offset == 0:
        return partial
    return _from_offset(lambda A, B: B, tail.offset, full, partial)


def _from_offset(operand, offset: int, full, partial):
    """A macro over ``A, B, C`` running ``partial`` where ``operand(A, B)`` starts at element
    ``offset`` or later, else ``full`` (one branch per call)."""

    @T.macro
    def body(A, B, C):
        if operand(A, B).elem_offset >= offset:
            partial(A, B, C)
        else:
            full(A, B, C)

    return body


def tail_pieces(kernel: Microkernel, columns: int, narrow: bool = True,
                exact: bool = False) -> tuple[int, int]:
    """``(whole vectors, lanes of one narrower vector or 0)`` covering ``columns`` of a panel:
    the rest after whole vectors takes a vector of 4 or 8 lanes where ``narrow`` (fp32: an
    xmm or ymm in a zmm kernel) and narrower than the kernel's, else one more whole vector.
    ``exact``: a vector of exactly the rest's lanes (operands not padded to a panel, which
    must not be read past ``columns``; LLVM splits such a vector into legal ones)."""
    whole, rest = divmod(min(columns, kernel.nr), kernel.lanes)
    if not rest or exact:
        return whole, rest
    piece = max(4, 1 << (rest - 1).bit_length())
    if not narrow or piece >= kernel.lanes:
        return whole + 1, 0
    return whole, piece


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


def zero_block_functions(acc: str, mb: int, nb: int):
    """``(description, implementation)`` of zeroing a per-block kernel's accumulators
    ``C[mb, nb]`` of type ``acc``: the description is the reduction's init, ``C = 0``, the
    implementation no code at all. A per-block kernel ignores ``C`` on entry (it starts its
    accumulators from zero: ``kernel.Family``), so the pass over the accumulators before each
    block that the init would cost is left out.

    Measured on a 2-core Emerald Rapids VM, the AMX block loop alone, accumulators zeroed by
    vector stores and loaded by the first ``K`` block against started by ``tilezero``: u8 x s8
    64x64x64 blocks 1.56x, 64x64x256 1.15x, 64x64x768 1.08x, 128x128x768 1.16x, 256x256x1024
    1.18x faster."""

    @T.macro
    def zero(C):
        for i, j in T.grid(mb, nb):
            with T.sblock("init"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = T.Cast(acc, 0)

    @T.macro
    def nothing(C):
        T.evaluate(0)

    def function(body):
        @T.prim_func(s_tir=True)
        def func(c: T.handle):
            ldc = T.int32()
            C = T.match_buffer(c, (mb, nb), acc, offset_factor=1, strides=[ldc, 1],
                               scope="local")
            with T.sblock("root"):
                T.reads()
                T.writes(C[0:mb, 0:nb])
                body(C)

        return func

    return function(zero), function(nothing)


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


def broadcast_fma(kernel: Microkernel, kc: int, columns: int | None = None,
                  exact: bool = False, sets: int = 1, rows: int | None = None):
    """The vector body of an ``mr x nr`` fp32 tile over ``kc`` steps, a ``T.macro`` over
    ``A[mr, kc]``, ``B[kc, nr]`` and ``C[mr, nr]`` (any strides): per ``k`` and row, one
    element of ``A`` broadcast and ``nr / lanes`` FMAs with ``B``'s row. The tile intrinsics
    below and the fused attention kernel (``schedules/attention``) share it.

    ``columns``: only the vectors covering the first ``columns`` (:func:`tail_pieces`, with
    ``exact``). ``sets``: the ``k`` steps go round-robin into that many partial sums, added
    into ``C`` at the end (:func:`split_sets`: a tile of few accumulators, whose FMAs would
    otherwise wait on each other). ``rows``: only the tile's first ``rows`` rows (a
    :class:`RowTail`; the others' accumulators are left as they are)."""
    mr, lanes = rows or kernel.mr, kernel.lanes
    vectors, piece = ((kernel.nr // lanes, 0) if columns is None
                      else tail_pieces(kernel, columns, exact=exact))
    start = vectors * lanes

    @T.macro
    def update(D, d, A, B, i, kk):  # row d of D += row i of A at k times B's row k
        for v in T.unroll(vectors):
            D[d, T.ramp(v * lanes, 1, lanes)] = D[
                d, T.ramp(v * lanes, 1, lanes)
            ] + T.broadcast(A[i, kk], lanes) * B[kk, T.ramp(v * lanes, 1, lanes)]
        if piece == 1:  # one column (an exact rest of one)
            D[d, start] = D[d, start] + A[i, kk] * B[kk, start]
        elif piece > 1:  # one vector of ``piece`` lanes
            D[d, T.ramp(start, 1, piece)] = D[d, T.ramp(start, 1, piece)] + T.broadcast(
                A[i, kk], piece) * B[kk, T.ramp(start, 1, piece)]

    @T.macro
    def body(A, B, C):
        for kk in T.serial(kc):
            for i in T.unroll(mr):
                update(C, i, A, B, i, kk)

    if sets == 1:
        return body
    rounds, rest = divmod(kc, sets)
    extra = (sets - 1) * mr

    @T.macro
    def split(A, B, C):
        P = T.alloc_buffer((extra, kernel.nr), "float32")
        for z in T.unroll(extra):
            for v in T.unroll(kernel.nr // lanes):
                P[z, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.float32(0), lanes)
        for kk in T.serial(rounds):
            for i in T.unroll(mr):
                update(C, i, A, B, i, kk * sets)
            for u in T.unroll(sets - 1):
                for i in T.unroll(mr):
                    update(P, u * mr + i, A, B, i, kk * sets + u + 1)
        for kk in T.unroll(rest):
            for i in T.unroll(mr):
                update(C, i, A, B, i, rounds * sets + kk)
        for u in T.unroll(sets - 1):
            for i in T.unroll(mr):
                for v in T.unroll(kernel.nr // lanes):
                    C[i, T.ramp(v * lanes, 1, lanes)] = C[i, T.ramp(v * lanes, 1, lanes)] + \
                        P[u * mr + i, T.ramp(v * lanes, 1, lanes)]

    return split


#: Bytes of ``B`` a software prefetch covers (a cache line).
LINE_BYTES = 64
#: Stack arrays :func:`prefetching_fma` may split its accumulators into.
PREFETCH_GROUPS = 3


def prefetch_rows(kernel: Microkernel) -> int:
    """Rows of accumulators per stack array of :func:`prefetching_fma` (each under
    :data:`STACK_BYTES`)."""
    return (STACK_BYTES - 1) // (kernel.nr * 4)


def prefetch_fits(kernel: Microkernel, kc: int) -> bool:
    """Whether :func:`prefetching_fma` can run ``kernel`` over ``kc`` steps: an fp32 tile whose
    accumulators fit :data:`PREFETCH_GROUPS` stack arrays, summed as one set
    (:func:`split_sets`). A tile that splits its sums must sum its full panels as its tail
    does, in the same sets: with the prefetching body (one set) on the full panels of 1-row
    tiles, AlexNet's and ZFNet's 1000 logits, equal to rounding, differed between the panels."""
    rows = prefetch_rows(kernel)
    return (kernel.in_dtype == "float32" and not kernel.per_block and rows >= 1
            and -(-kernel.mr // rows) <= PREFETCH_GROUPS and split_sets(kernel, kc) == 1)


def prefetching_fma(kernel: Microkernel, kc: int):
    """:func:`broadcast_fma`'s body (whole vectors, one set) that also prefetches into L2, per
    ``k``, the cache lines of ``B`` ``kc`` rows ahead: on packed weights (panels of ``K x nr``,
    one after the other) the next panel, or with ``K`` blocks the panel's next block.

    Without it the first row tile's pass over each panel of weights larger than L2 ran at the
    pace of L3 or memory: a 128x3072x768 GEMM took 2.67 ms with its weights cold (four such
    GEMMs called in turn) against 2.24 ms warm, 2.42 ms prefetched; the BERT-base layer ran
    1.09x (batch 1) and 1.07x (batch 8) faster (2-core Emerald Rapids, same process, 9 rounds,
    outputs identical). The row tiles after the first find
    the lines in L2; the prefetches cost a load slot each.

    The prefetch is a call LLVM cannot see into, and LLVM keeps no accumulator in a register
    across it unless the accumulator is a stack array of its own: so the tile's rows are
    accumulated in up to :data:`PREFETCH_GROUPS` stack arrays (each under
    :data:`STACK_BYTES`), copied from and back to ``C`` around the ``k`` loop. The last panel's
    prefetches point past the weights: a prefetch never faults and reads nothing the program
    sees."""
    mr, lanes, nr = kernel.mr, kernel.lanes, kernel.nr
    rows = prefetch_rows(kernel)
    first = min(mr, rows)
    second = min(mr - first, rows)
    third = mr - first - second
    vectors = nr // lanes
    lines = -(-nr * 4 // LINE_BYTES)
    per_line = LINE_BYTES // 4

    @T.macro
    def update(D, d, A, B, i, kk):
        for v in T.unroll(vectors):
            D[d, T.ramp(v * lanes, 1, lanes)] = D[
                d, T.ramp(v * lanes, 1, lanes)
            ] + T.broadcast(A[i, kk], lanes) * B[kk, T.ramp(v * lanes, 1, lanes)]

    @T.macro
    def move(dst, d0, src, s0, count):
        for i in T.unroll(count):
            for v in T.unroll(vectors):
                dst[d0 + i, T.ramp(v * lanes, 1, lanes)] = src[s0 + i, T.ramp(v * lanes, 1, lanes)]

    @T.macro
    def body(A, B, C):
        R0 = T.alloc_buffer((first, nr), "float32")
        R1 = T.alloc_buffer((max(second, 1), nr), "float32")
        R2 = T.alloc_buffer((max(third, 1), nr), "float32")
        move(R0, 0, C, 0, first)
        move(R1, 0, C, first, second)
        move(R2, 0, C, first + second, third)
        for kk in T.serial(kc):
            for line in T.unroll(lines):
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.prefetch.p0", T.address_of(B[kk + kc, line * per_line]),
                    T.int32(0), T.int32(2), T.int32(1)))
            for i in T.unroll(first):
                update(R0, i, A, B, i, kk)
            for i in T.unroll(second):
                update(R1, i, A, B, first + i, kk)
            for i in T.unroll(third):
                update(R2, i, A, B, first + second + i, kk)
        move(C, 0, R0, 0, first)
        move(C, first, R1, 0, second)
        move(C, first + second, R2, 0, third)

    return body


def split_sets(kernel: Microkernel, kc: int) -> int:
    """Partial sums for :func:`broadcast_fma`: enough for :data:`MIN_CHAINS` independent
    accumulators where the tile has fewer (1-row tiles: ``M`` prime), within the registers
    (``B``'s vectors and a broadcast of ``A`` besides) and at least two ``k`` each. One count
    for a tile's full panels and its tail, so that every output column is summed in the same
    order (a model whose columns are equal gives equal columns)."""
    vectors = kernel.nr // kernel.lanes
    accumulators = kernel.mr * vectors
    if accumulators >= MIN_CHAINS:
        return 1
    fit = (kernel.num_registers - vectors - 2) // accumulators
    return max(1, min(-(-MIN_CHAINS // accumulators), fit, kc // 2))


def plain_tile_functions(kernel: Microkernel, kc: int, tail: Tail | None = None,
                         prefetch: bool = False, row_tail: RowTail | None = None):
    """The (description, implementation) pair of an ``mr x nr`` fp32 tile over ``kc`` steps
    (with ``tail``: the last panel's used columns only, module docstring; ``prefetch``: the
    next ``kc`` rows of ``B`` prefetched, :func:`prefetching_fma`; ``row_tail``: the last row
    tile's existing rows only, :class:`RowTail`, each summed in the same order as a full
    tile's)."""
    mr, nr, dtype = kernel.mr, kernel.nr, kernel.in_dtype
    buffers = ((mr, kc), (kc, nr), (1,), (dtype, dtype, dtype), (mr, nr))
    desc = reference_update(mr, nr, kc, dtype, lambda B, j, k: B[k, j], cast=False)
    sets = split_sets(kernel, kc)

    def partial(rows=None):  # the last panel's used columns, on the tile's first rows
        if tail is None:
            return None
        if tail.run:
            return transposed_dot(kernel, kc, tail.columns, tail.run, tail.per_column, rows)
        # as many partial sums as the full panels: every column summed in the same order
        return broadcast_fma(kernel, kc, tail.columns, sets=sets, rows=rows)

    full = prefetching_fma(kernel, kc) if prefetch else broadcast_fma(kernel, kc, sets=sets)
    impl = _branch(tail, full, partial())
    if row_tail is not None:
        rows = row_tail.rows
        impl = _row_branch(row_tail, impl, _branch(
            tail, broadcast_fma(kernel, kc, sets=sets, rows=rows), partial(rows)))
    return tile_function(*buffers, desc), tile_function(*buffers, impl)


def grouped_updates(kernel: Microkernel, kc: int, update, annotations=None,
                    columns: int | None = None):
    """The vector body of an ``mr x nr`` tile of a grouped family over ``kc`` steps, a
    ``T.macro`` over ``A[mr, kc]``, ``B[kc / group, nr, group]`` and ``C[mr, nr]`` (any
    strides): per group of ``k``, row and vector, ``C = update(C, A, B, i, g, v)``. The tile
    intrinsics below and the quantized attention kernel (``schedules/attention``) share it.

    ``columns``: only the whole vectors covering the first ``columns`` (an ISA's ``update``
    is written for its full vector)."""
    mr, lanes = kernel.mr, kernel.lanes
    rows = kc // kernel.k_step
    vectors = kernel.nr // lanes if columns is None else \
        tail_pieces(kernel, columns, narrow=False)[0]

    @T.macro
    def body(A, B, C):
        for g in T.serial(rows, annotations=annotations):
            for i in T.unroll(mr):
                for v in T.unroll(vectors):
                    C[i, T.ramp(v * lanes, 1, lanes)] = update(
                        C[i, T.ramp(v * lanes, 1, lanes)], A, B, i, g, v)

    return body


def grouped_tile_functions(kernel: Microkernel, kc: int, b_dtype: str, update,
                           annotations=None, tail: Tail | None = None):
    """The (description, implementation) pair of a tile whose ``B`` is packed with ``group =
    kernel.k_step`` consecutive ``k``::

        C[mr, nr] (acc) += acc(A[mr, kc]) * acc(B[kc / group, nr, group])

    The implementation runs, per group of ``k``, row and vector of ``lanes`` accumulators,
    ``C = update(C, A, B, i, g, v)``, where ``update`` returns the vector expression of one
    ISA's instructions (VNNI: group 4; s16 and bf16: 2). With ``tail``, the last panel's used
    columns only (module docstring).
    """
    mr, nr, group = kernel.mr, kernel.nr, kernel.k_step
    rows = kc // group
    # The annotations (an LLVM import) once per function: the full branch carries them, or the
    # tail alone where the last panel is the only one (a dead branch's import is dropped with
    # it, and the call to the imported function is left unresolved: bf16 with N = 17).
    alone = tail is not None and tail.offset == 0
    vector_updates = _branch(
        tail, grouped_updates(kernel, kc, update, annotations),
        grouped_updates(kernel, kc, update, annotations if alone else None, tail.columns)
        if tail else None)
    buffers = ((mr, kc), (rows, nr, group), (group, 1),
               (kernel.in_dtype, b_dtype, kernel.acc_dtype), (mr, nr))
    desc = reference_update(mr, nr, kc, kernel.acc_dtype,
                            lambda B, j, k: B[k // group, j, k % group])
    return tile_function(*buffers, desc), tile_function(*buffers, vector_updates)
