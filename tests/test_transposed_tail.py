"""The transposed tail: a last panel's few used columns as dot products along ``K``.

Packed weights keep a copy of the last panel's used columns, transposed into the columns the
GEMM drops, and the tail's microkernel multiplies rows of ``A`` with it (one FMA for ``run``
``k`` of each column) instead of broadcasting every ``k`` into a vector of which a few lanes
are used (``microkernels/transposed_tail.py``). Tiles of few accumulators (1-row tiles, ``M``
prime) sum in several partial sums. The layouts and instructions are checked for named CPUs
(any host); the numeric tests run the host's kernels and the AVX2 code.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import numpy_helper
from tvm import te

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.microkernels import ensure_tensor_intrin, microkernel_by_name, tensor_intrin
from tvm_hybrid.microkernels.tiles import RowTail, Tail, split_sets
from tvm_hybrid.microkernels.transposed_tail import (
    accumulator_sets,
    copy_period,
    copy_row,
    transposed_layout,
    write_transposed_copy,
)
from tvm_hybrid.passes.packed_gemm import pack_weight, tail_columns_distinct
from tvm_hybrid.testing.onnx_checks import linear_relu

ZMM_1x32 = microkernel_by_name("hybrid_gemm_avx512_float32_1x32")
ZMM_11x32 = microkernel_by_name("hybrid_gemm_avx512_float32_11x32")
YMM_1x32 = microkernel_by_name("hybrid_gemm_avx2_float32_1x32")
YMM_4x24 = microkernel_by_name("hybrid_gemm_avx2_float32_4x24")
ZNVER4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}
HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}


def assert_close(got, want, tol: float) -> None:
    """Within ``tol`` of the output's scale."""
    want = np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol * scale)


def _details(model) -> list[str]:
    return [info.detail for info in model.kernels.values() if "microkernel" in info.detail]


def test_the_copy_takes_the_widest_vector_beside_the_used_columns():
    # (width, run, per_column): 16 lanes of zmm beside 1-8 of 32 columns, a power of two of
    # columns each; where that leaves 2 k a column, 16 k of one column per vector instead
    assert transposed_layout(16, 32, 1) == (16, 16, False)
    assert transposed_layout(16, 32, 2) == (16, 8, False)
    assert transposed_layout(16, 32, 3) == (16, 4, False)
    assert transposed_layout(16, 32, 4) == (16, 4, False)
    assert transposed_layout(16, 32, 5) == (16, 16, True)
    assert transposed_layout(16, 32, 8) == (16, 16, True)
    assert transposed_layout(16, 32, 9) is None  # 16 columns a vector: one k, no gain
    assert transposed_layout(16, 16, 1) == (8, 8, False)  # a 1-vector panel: a ymm beside it
    assert transposed_layout(16, 16, 5) is None
    assert transposed_layout(8, 24, 2) == (8, 4, False)  # AVX2
    assert transposed_layout(8, 24, 3) == (8, 8, True)
    assert transposed_layout(8, 24, 4) == (8, 8, True)
    assert transposed_layout(8, 24, 5) is None
    assert transposed_layout(8, 8, 1) == (4, 4, False)
    assert transposed_layout(8, 8, 3) is None


def test_the_copy_leaves_every_kept_column_as_packed(rng):
    """The copy is written into the dropped columns of the last panel only: the packed
    weights still hold the GEMM in every column the consumer reads."""
    w = rng.standard_normal((333, 97)).astype("float32")
    plain = pack_weight(w, 32)
    packed = write_transposed_copy(pack_weight(w, 32), w, 16, 16)
    np.testing.assert_array_equal(packed[:3], plain[:3])
    np.testing.assert_array_equal(packed[3, :, :1], plain[3, :, :1])
    # 20 whole groups of 16 k (333 = 20 * 16 + 13): group t in columns 16-31 of row 16 t, one
    # row lower for every 32 rows (4 KiB) before it: rows 0, 16, 33, 49, 66, ...
    rows = [16 * t + (16 * t // 32) % 16 for t in range(20)]
    assert rows[:5] == [0, 16, 33, 49, 66]
    np.testing.assert_array_equal(packed[3, rows, 16:], w[:320, 96].reshape(20, 16))
    rest = packed[3].copy()
    rest[rows, 16:] = 0
    np.testing.assert_array_equal(rest[:, 1:], 0)
    # 3 columns on 4 k per vector: lane 4 c + j holds B[k0 + j, c]; the 4th column is zero
    w3 = w[:, :67]
    packed = write_transposed_copy(pack_weight(w3, 32), w3, 16, 4)
    group = packed[2, 8, 16:]  # k = 8 ... 11, the third group (its first row, 8 < 32)
    for c in range(3):
        np.testing.assert_array_equal(group[4 * c: 4 * c + 4], w3[8:12, 64 + c])
    assert not group[12:].any()


def test_a_per_column_copy_holds_one_column_per_row_of_a_group(rng):
    """7 columns on 16 ``k`` of one column per vector: column ``c`` of group ``t`` in row ``c``
    of the group's 16 rows, 8 rows lower (the columns rounded up to a power of two) for every
    32 rows (4 KiB) before the group; the other rows' dropped columns stay zero."""
    w = rng.standard_normal((333, 7)).astype("float32")
    plain = pack_weight(w, 32)
    packed = write_transposed_copy(pack_weight(w, 32), w, 16, 16, per_column=True)
    np.testing.assert_array_equal(packed[..., :16], plain[..., :16])
    written = np.zeros(333, bool)
    for t in range(20):  # 333 = 20 * 16 + 13
        for c in range(7):
            row = copy_row(t, 16, 32, c, 8)
            assert row == 16 * t + (c + 8 * (t // 2)) % 16
            np.testing.assert_array_equal(packed[0, row, 16:], w[16 * t: 16 * t + 16, c])
            written[row] = True
    assert not packed[0, ~written, 16:].any()
    assert copy_period(16, 32, 8) == 64  # groups 0-3: 0, 0, 8, 8 rows down, then again


@pytest.mark.parametrize("run", [2, 4, 8, 16])
def test_the_copy_spreads_over_the_l1_sets(run):
    """The copy's vectors (16 lanes, columns 16-31 of a 32-column panel: the second 64-byte
    line of a row) fall into every one of the 32 L1 sets such lines map to, evenly, so that
    ``K`` = 512 x 2 / ``run`` groups (16 KiB for ``run`` 2) fit the 8 ways: in each group's
    first row they would use ``32 / run`` sets and ``K`` = 333 with ``run`` 2 (167 vectors, 10.7
    KiB) would not fit."""
    groups = 256
    rows = copy_row(np.arange(groups), run, 32)
    assert np.all((rows >= np.arange(groups) * run) & (rows < (np.arange(groups) + 1) * run))
    sets = (rows * 32 + 16) * 4 // 64 % 64  # 64 sets of 64-byte lines
    assert np.bincount(sets, minlength=64).max() == 8
    assert len(set(sets.tolist())) == 32
    plain = (np.arange(167) * 2 * 32 + 16) * 4 // 64 % 64  # run 2 at each group's first row
    assert np.bincount(plain).max() > 8
    # A panel whose rows do not divide 4 KiB (24 columns, AVX2) keeps each group's first row.
    np.testing.assert_array_equal(copy_row(np.arange(8), 2, 24), np.arange(8) * 2)
    assert copy_period(2, 32) == 64 and copy_period(16, 32) == 512 and copy_period(2, 24) == 2


@pytest.mark.parametrize("target,n,detail", [
    (ZNVER4, 1, "last panel 1 of 32 columns, transposed (16 k per vector)"),
    (ZNVER4, 4, "last panel 4 of 32 columns, transposed (4 k per vector)"),
    (ZNVER4, 7, "last panel 7 of 32 columns, transposed (16 k of one column per vector)"),
    (ZNVER4, 8, "last panel 8 of 32 columns, transposed (16 k of one column per vector)"),
    (HASWELL, 1, "last panel 1 of 32 columns, transposed (8 k per vector)"),
    (HASWELL, 2, "last panel 2 of 32 columns, transposed (4 k per vector)"),
    (HASWELL, 3, "last panel 3 of 32 columns, transposed (8 k of one column per vector)"),
], ids=["zmm-1", "zmm-4", "zmm-7", "zmm-8", "ymm-1", "ymm-2", "ymm-3"])
def test_narrow_gemms_run_transposed(target, n, detail):
    model = tvm_hybrid.compile(workloads.gemm(197, n, 333).model, target)
    assert any(detail in d for d in _details(model)), _details(model)


def test_wider_tails_keep_the_broadcast_update():
    """9 columns (16 a vector) or 5 on AVX2: the copy would hold one ``k`` per vector, no
    better than the broadcast."""
    for target, n in ((ZNVER4, 9), (HASWELL, 5), (ZNVER4, 777)):
        details = _details(tvm_hybrid.compile(workloads.gemm(197, n, 333).model, target))
        assert any("last panel" in d for d in details), details
        assert not any("transposed" in d for d in details), details


@pytest.mark.parametrize("target,n,detail", [
    (ZNVER4, 97, "11x32 microkernel, order nm, K=333, last panel 1 of 32 columns, transposed "
                 "(16 k per vector), last row tile 10 of 11 rows"),
    (ZNVER4, 257, "last panel 1 of 32 columns, transposed (16 k per vector)"),
    (HASWELL, 97, "4x24 microkernel, order nm, K=333, last panel 1 of 24 columns, transposed "
                  "(8 k per vector), last row tile 1 of 4 rows"),
    (HASWELL, 98, "last panel 2 of 24 columns, transposed (4 k per vector)"),
], ids=["zmm-97", "zmm-257", "ymm-97", "ymm-98"])
def test_the_last_of_several_panels_runs_transposed(target, n, detail):
    """197 x 97: the last of four panels keeps one column, which costs a full vector FMA per
    row and ``k`` broadcast, as much as 16 columns; transposed, one FMA per 16 ``k`` (the
    GEMM ran 1.14x faster, 94% of 197 x 96's GFLOP/s against 85%). Beside the last row
    tile's (M = 197), whose ``x`` needs no padding copy."""
    model = tvm_hybrid.compile(workloads.gemm(197, n, 333).model, target)
    assert any(detail in d for d in _details(model)), _details(model)
    assert "pad" not in " ".join(model.kernels), list(model.kernels)


def _gemm_with_weights(m: int, w: np.ndarray):
    """``workloads.gemm(m, N, K)``'s model with the weights ``w[K, N]``."""
    proto = workloads.gemm(m, w.shape[1], w.shape[0]).model
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, proto.graph.initializer[0].name))
    return proto


def _last_column_as_sixth(rng) -> np.ndarray:
    """333 x 97 weights whose last column (the last panel's only one) equals column 5."""
    w = rng.standard_normal((333, 97)).astype("float32")
    w[:, 96] = w[:, 5]
    return w


@pytest.mark.parametrize("target", [ZNVER4, HASWELL], ids=["znver4", "haswell"])
def test_a_last_panel_column_equal_to_another_keeps_the_broadcast(target, rng):
    """Weights whose last panel's column equals a full panel's column (element for element):
    no copy, so the two output columns are summed in the same order."""
    details = _details(tvm_hybrid.compile(_gemm_with_weights(197, _last_column_as_sixth(rng)),
                                          target))
    assert any("last panel 1 of" in d for d in details), details
    assert not any("transposed" in d for d in details), details


def test_a_last_panel_column_equal_to_another_gives_an_equal_output_column(rng):
    """...and the host's code gives the two output columns bit-equal."""
    model = tvm_hybrid.compile(_gemm_with_weights(197, _last_column_as_sixth(rng)))
    got = np.asarray(model(rng.standard_normal((197, 333)).astype("float32")))
    np.testing.assert_array_equal(got[:, 96], got[:, 5])


def test_tail_columns_distinct():
    """The rule: a used column of the last panel equal to one outside it, even with another
    sign of zero, rules the copy out; equal columns within the last panel do not."""
    w = np.arange(40, dtype="float32").reshape(4, 10)
    assert tail_columns_distinct(w, 2)
    same = w.copy()
    same[:, 9] = same[:, 3]
    assert not tail_columns_distinct(same, 2)
    zeros = np.zeros((4, 10), "float32")
    zeros[:, :8] = 1.0
    zeros[:, 8] = -0.0
    assert tail_columns_distinct(zeros, 2)  # the two zero columns are both in the tail
    zeros[:, 0] = 0.0
    assert not tail_columns_distinct(zeros, 2)
    assert not tail_columns_distinct(np.ones((4, 10), "float32"), 1)


@pytest.mark.parametrize("target,full", [(ZNVER4, "zmm"), (HASWELL, "ymm")],
                         ids=["znver4", "haswell"])
def test_one_column_takes_full_vector_fmas(target, full):
    """197 x 1 x 333: the one panel's only column as dot products on the ISA's full vectors
    (16 or 8 ``k`` of a row of ``A`` at once), no narrower vector FMA (the broadcast tail put
    it in an xmm, one FMA per ``k``); the 13 (or 5) last ``k`` in scalar FMAs."""
    model = tvm_hybrid.compile(workloads.gemm(197, 1, 333).model, target)
    asm = model.inspect_source("asm")
    assert re.search(rf"vfmadd\d+ps\s[^\n]*%{full}", asm)
    assert not re.search(r"vfmadd\d+ps\s[^\n]*%xmm", asm)
    assert re.search(r"vfmadd\d+ss\s", asm)


def test_a_copy_of_four_columns_repeats_four_k_of_a():
    """Four columns on 4 ``k`` per vector: ``A[i, k0 : k0 + 4]`` loaded once into all four
    128-bit lanes of a zmm (a subvector broadcast)."""
    model = tvm_hybrid.compile(workloads.gemm(197, 4, 333).model, ZNVER4)
    assert re.search(r"vbroadcastf(32x4|64x2)\s[^\n]*%zmm", model.inspect_source("asm"))


def _check_against_numpy(m: int, n: int, k: int, target, rng) -> None:
    """An fp32 GEMM with bias and ReLU compiled for ``target`` (None: the host) runs its
    narrow last panel transposed, within 1e-5 of the output scale of float64 numpy."""
    proto, w, b = linear_relu(m, n, k, rng)
    model = tvm_hybrid.compile(proto, target) if target else tvm_hybrid.compile(proto)
    assert any("transposed" in d for d in _details(model)), _details(model)
    x = rng.standard_normal((m, k)).astype("float32")
    assert_close(model(x), np.maximum(x.astype("float64") @ w + b, 0), 1e-5)


@pytest.mark.requires("avx512f")
@pytest.mark.parametrize("m,n,k", [
    (197, 1, 333), (197, 2, 333), (197, 3, 333), (197, 4, 333), (197, 8, 333),
    (64, 1, 3072), (3, 2, 7), (200, 2, 37), (24, 3, 16), (1, 1, 333),
    (197, 5, 333), (197, 7, 333), (197, 6, 4096), (7, 8, 15), (1, 8, 768),
    (197, 97, 333), (197, 257, 333), (64, 33, 768), (1, 1000, 512), (30, 66, 100),
])
def test_transposed_tails_match_numpy(m, n, k, rng):
    """The host's AVX-512 tiles: whole groups of ``K`` and a rest, none (K = 7 under 8 per
    vector, 15 under 16), 1-row tiles (``M`` prime), several rows a tile; 5-8 columns on
    the per-column copy; the last of several panels (beside a row tail: M = 197, 30)."""
    _check_against_numpy(m, n, k, None, rng)


@pytest.mark.parametrize("m,n,k", [
    (197, 1, 333), (197, 2, 333), (197, 4, 333), (64, 1, 3072), (3, 2, 7), (1, 1, 333),
    (7, 1, 1024), (200, 2, 37), (197, 3, 333), (197, 3, 7), (197, 4, 1000),
    (197, 97, 333), (197, 98, 333), (61, 49, 512),
])
def test_avx2_transposed_tails_match_numpy(m, n, k, rng):
    """The AVX2 code (runs on any host): 8-lane copies beside 32-column panels, a 4-lane one
    beside the 8-column panel of a 7x8 tile; 3 and 4 columns on the per-column copy; the last
    of several panels (beside a row tail: M = 197, 61)."""
    _check_against_numpy(m, n, k, HASWELL, rng)


@pytest.mark.requires("avx2", "fma")
@pytest.mark.parametrize("n", [2, 3], ids=["4k-of-2-columns", "8k-of-one-column"])
@pytest.mark.parametrize("k,k_block,transposed", [(4096, 256, True), (4096, 64, False),
                                                   (3000, 375, False)])
def test_k_blocks_run_the_copy_where_they_start_on_its_groups(n, k, k_block, transposed, rng):
    """K blocks given as knobs (narrow weights never stream from memory, so the heuristic's
    rule 3 never splits them; a tuner may): blocks of 256 start where the copy's row rotation
    does (on a 16-column panel every 256 rows for 2 columns of 4 ``k`` a vector, every 128 for
    3 columns of 8 ``k``, one column a vector) and run it; blocks of 64 (whole groups, but
    mid-rotation) and of 375 do not and keep the broadcast update. The packed GEMM as the
    packing pass emits it, on Haswell code run here, against numpy."""
    from tvm_hybrid.passes.packed_gemm import packed_gemm
    from tvm_hybrid.schedules import GemmTemplate
    from tvm_hybrid.schedules.gemm.heuristics import GemmKnobs
    from tvm_hybrid.schedules.template import apply_template

    tile = microkernel_by_name("hybrid_gemm_avx2_float32_4x16")
    m = 24
    w = rng.standard_normal((k, n)).astype("float32")
    width, run, per_column = transposed_layout(tile.lanes, 16, n)
    assert per_column == (n == 3)
    assert copy_period(run, 16, 4 if per_column else 1) == (128 if per_column else 256)
    packed = write_transposed_copy(pack_weight(w, 16), w, width, run, per_column)
    x_t = te.placeholder((m, k), name="x")
    packed_t = te.placeholder(packed.shape, name="packed")
    func = te.create_prim_func([x_t, packed_t, packed_gemm(
        x_t, packed_t, n, "float32", "float32", transposed_run=run, per_column=per_column)])
    target = tvm_hybrid.make_target(HASWELL)
    sch, _ = apply_template(GemmTemplate(), func, target,
                            knobs=[GemmKnobs(tile, 3, 1, "nm", k_block)])
    script = sch.mod.script()
    assert f"K blocks of {k_block}" in script
    copy = f"transposed ({run} k{' of one column' if per_column else ''} per vector)"
    assert (copy in script) == transposed, script[-2000:]
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                      target=target)
    x = rng.standard_normal((m, k)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((m, n), "float32"))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(packed), out)
    assert_close(out.numpy(), x.astype("float64") @ w, 1e-5)


@pytest.mark.parametrize("n", [3, pytest.param(7, marks=pytest.mark.requires("avx512f"))])
def test_a_non_finite_row_stays_in_its_row(n, rng):
    """Each row's partial sums and halving steps (a per-column copy's shuffle tree too: 7
    columns with AVX-512) stay within the row: an infinity or NaN in one row of ``x`` reaches
    that row's output only."""
    wl = workloads.gemm(197, n, 333)
    model = tvm_hybrid.compile(wl.model)
    assert any("transposed" in d for d in _details(model)), _details(model)
    x = wl.inputs["a"].copy()
    x[5, 100], x[6, 7] = np.inf, np.nan
    got = model(x)
    w = numpy_helper.to_array(wl.model.graph.initializer[0]).astype(np.float64)
    want = x.astype(np.float64) @ w
    assert np.isnan(got[6]).all()
    np.testing.assert_array_equal(np.isinf(got[5]), np.isinf(want[5]))
    keep = np.ones(197, bool)
    keep[[5, 6]] = False
    assert_close(got[keep], want[keep], 1e-5)


def test_thin_tiles_sum_in_several_partial_sums():
    """8 independent accumulators at least, within the registers: a 1x32 zmm tile (2
    vectors) in 4 partial sums (its tail as well), the 1x32 ymm tile (4 vectors) has registers
    for 2; tiles of 8 accumulators or more, 1; the copy's rows too."""
    assert split_sets(ZMM_1x32, 333) == 4
    assert split_sets(YMM_1x32, 333) == 2
    assert split_sets(ZMM_11x32, 333) == 1 and split_sets(YMM_4x24, 333) == 1
    assert split_sets(ZMM_1x32, 3) == 1  # at least two k a partial sum
    assert accumulator_sets(ZMM_1x32, 20) == 8 and accumulator_sets(ZMM_11x32, 20) == 1
    assert accumulator_sets(ZMM_1x32, 3) == 3


@pytest.mark.parametrize("n", [1, 4, 16, 97])
def test_thin_integer_gemms_are_exact(n):
    """u8 x s8 GEMMs of 197 rows, narrow ones padded to full tiles like wide ones, on the
    host's integer kernels (VNNI, or AVX2's s16 or vpmaddubsw): bit-exact against the integer
    reference."""
    wl = workloads.matmul_integer(197, n, 332, zero_point=3)
    model = tvm_hybrid.compile(wl.model)
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


def test_transposed_intrinsic_names_round_trip():
    """A trace names the intrinsic with its copy's run; replaying it registers it again."""
    name = tensor_intrin(ZMM_11x32, 333, tail=Tail(31968, 1, 16))
    assert name == "hybrid_gemm_avx512_float32_11x32_k333_t1at31968d16"
    assert ensure_tensor_intrin(name)
    with pytest.raises(ValueError, match="no transposed tail"):
        tensor_intrin(ZMM_11x32, 333, tail=Tail(31968, 9, 2))  # 32 lanes: wider than a zmm
    assert not ensure_tensor_intrin("hybrid_gemm_avx2_float32_4x24_k333_t1at31968d16")
    # a per-column copy: its own name; on a tile whose rows x columns overflow the registers
    # (11 x 8 accumulators) refused
    name = tensor_intrin(ZMM_1x32, 333, tail=Tail(0, 8, 16, per_column=True))
    assert name == "hybrid_gemm_avx512_float32_1x32_k333_t8at0d16c"
    assert ensure_tensor_intrin(name)
    assert not ensure_tensor_intrin("hybrid_gemm_avx512_float32_11x32_k333_t8at0d16c")
    # beside a row tail (the last row tile's 10 rows of 11), with the prefetch of the full panels
    name = tensor_intrin(ZMM_11x32, 333, tail=Tail(31968, 1, 16), prefetch=True,
                         row_tail=RowTail(186 * 333, 10))
    assert name == "hybrid_gemm_avx512_float32_11x32_k333_t1at31968d16_r10at61938_p"
    assert ensure_tensor_intrin(name)


@pytest.mark.parametrize("m,n,k", [(1, 1000, 4096), (197, 97, 333), (3, 40, 1000),
                                   (197, 7, 333), (197, 3, 333)])
def test_equal_weight_columns_give_equal_output_columns(m, n, k, rng):
    """Every output column is summed in the same order, the tail's (and a 1-row tile's
    partial sums, a copy's shuffle tree) as the full panels': columns of equal weights give
    bit-equal outputs. (The light AlexNet and ZFNet of onnx's backend data have 1000
    classifier logits of 7.9e11 equal to rounding; summed in two orders they differed by 7e6,
    and the softmax put 0 on the last panel's 8 classes.)"""
    w = np.repeat(rng.standard_normal((k, 1)).astype("float32"), n, axis=1)
    model = tvm_hybrid.compile(_gemm_with_weights(m, w))
    x = rng.standard_normal((m, k)).astype("float32")
    got = np.asarray(model(x))
    np.testing.assert_array_equal(got, np.repeat(got[:, :1], n, axis=1))


def test_the_profile_counts_the_kept_columns():
    """GFLOP/s of a narrow GEMM count its kept column, not the padded panel's 32."""
    model = tvm_hybrid.compile(workloads.gemm(197, 1, 333).model)
    gemm = next(info for info in model.kernels.values() if "microkernel" in info.detail)
    assert gemm.flops == 2.0 * 197 * 1 * 333
