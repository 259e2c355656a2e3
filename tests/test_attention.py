"""The fused attention template (``schedules/attention``) and its graph pass (``FuseAttention``).

Numerics against a float64 numpy reference (tolerance 1e-5 of the output scale, the issue's
bar for fused against unfused), for the host's best ISA and for AVX2 (``haswell``, which every
x86 host this project runs on executes); layouts, tails, masks (padding, per-query/causal, none)
and rank-3 attention; the graph pass structurally and end to end on ONNX models against ONNX
Runtime; no ``q_len x kv_len`` buffer anywhere in the compiled model.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax

import tvm_hybrid
from tvm_hybrid import passes
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import host_target
from tvm_hybrid.microkernels import best_vector_family
from tvm_hybrid.passes.fuse_attention import FUSED_ATTENTION
from tvm_hybrid.schedules.attention import (
    ATTENTION_ATTR,
    AttentionShape,
    attention_kernel,
    choose_knobs,
)
from tvm_hybrid.schedules.attention.heuristics import (
    COPY_BYTES,
    KEY_BLOCK,
    STACK_BYTES,
    TILE_BYTES,
    fits,
    knobs_from_dict,
    variants,
)
from tvm_hybrid.schedules.attention.kernel import exp2_nonpositive
from tvm_hybrid.testing.relax_modules import relax_function

HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
ZNVER4 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
RNG = np.random.default_rng(0)


def _reference(q, k, v, mask, scale, keep=None, fill=None):
    """softmax(where(keep, scale * q k^T, fill) + mask) v in float64 (operands [.., s, d])."""
    s = np.einsum("...id,...jd->...ij", q.astype(np.float64), k.astype(np.float64)) * scale
    if keep is not None:
        s = np.where(keep, s, fill)
    if mask is not None:
        s = s + mask
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v.astype(np.float64)


def _padding_mask(batch, kv_len):
    mask = np.zeros((batch, 1, 1, kv_len), "float32")
    for b in range(batch):
        mask[b, ..., kv_len - 1 - b * 3:] = -10000.0
    return mask


def _to_layout(a, layout):
    return np.ascontiguousarray({"bhsd": a, "bshd": a.transpose(0, 2, 1, 3),
                                 "bhds": a.transpose(0, 1, 3, 2)}[layout])


def _run_kernel(shape: AttentionShape, target, mask, cond=None, knobs=None):
    knobs = knobs or choose_knobs(target, shape)
    assert knobs is not None, shape.describe()
    func = attention_kernel(shape, knobs).with_attr("global_symbol", "attention")
    ex = tvm.compile(tvm.IRModule({"attention": func}), target=target)
    b, h, d = shape.batch, shape.heads, shape.head_dim
    q, k, v = (RNG.standard_normal((b, h, n, d)).astype("float32")
               for n in (shape.q_len, shape.kv_len, shape.kv_len))
    args = [_to_layout(q, shape.q_layout), _to_layout(k, shape.k_layout),
            _to_layout(v, shape.v_layout)]
    if mask is not None:
        args.append(mask)
    if cond is not None:
        args.append(cond)
    out = np.full(shape.tensor_shape(shape.out_layout, shape.q_len), np.nan, "float32")
    tensors = [tvm.runtime.tensor(a) for a in [*args, out]]
    ex["attention"](*tensors)
    got = tensors[-1].numpy()
    if shape.out_layout == "bshd":
        got = got.transpose(0, 2, 1, 3)
    if cond is not None:  # where(cond, scores, fill) before the additive mask
        keep = cond if shape.keep_if else ~cond
        return got, _reference(q, k, v, mask, shape.scale or 1.0, keep, shape.fill), ex
    return got, _reference(q, k, v, mask, shape.scale or 1.0), ex


CASES = [
    # (batch, heads, q_len, kv_len, head_dim, layouts (q, k, v, out), mask)
    (1, 2, 128, 128, 64, ("bhsd",) * 4, "padding"),          # whole blocks
    (2, 3, 197, 197, 64, ("bhsd",) * 4, "padding"),          # ViT tokens: both tails
    (2, 2, 50, 300, 32, ("bshd", "bhds", "bshd", "bshd"), "padding"),  # head split, K^T
    (1, 2, 33, 77, 64, ("bshd", "bshd", "bhsd", "bshd"), None),
    (1, 2, 40, 40, 32, ("bhsd",) * 4, "causal"),             # a per-query mask
    # Head dimensions no vector divides: the channel tail (AVX-512: 15 lanes, 32 + 8, 16 + 4,
    # one column; AVX2: 8 + 7, whole vectors, 16 + 4, one column).
    (1, 3, 40, 40, 15, ("bshd", "bhds", "bshd", "bshd"), "padding"),
    (2, 2, 50, 77, 40, ("bhsd",) * 4, None),
    (1, 2, 33, 70, 20, ("bshd", "bshd", "bhsd", "bshd"), "causal"),
    (1, 2, 20, 30, 1, ("bhsd",) * 4, None),
]


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "haswell"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"_{c[6]}")
def test_fused_attention_kernel_matches_numpy(case, target):
    batch, heads, q_len, kv_len, d, layouts, mask_kind = case
    mask, mask_shape = None, None
    if mask_kind == "padding":
        mask = _padding_mask(batch, kv_len)
    elif mask_kind == "causal":
        mask = np.triu(np.full((q_len, kv_len), -np.inf, "float32"), 1)[None, None]
    if mask is not None:
        mask_shape = mask.shape
    shape = AttentionShape(batch, heads, q_len, kv_len, d, *layouts, mask_shape=mask_shape,
                           scale=1 / math.sqrt(d))
    got, want, _ = _run_kernel(shape, target or host_target(), mask)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


COPIED = [
    # Head splits read in place (rows heads * d apart), K transposed, every tail: a last
    # partial query block, a short key block, 15 and 40 channels, one head per task.
    (2, 2, 150, 300, 32, ("bshd", "bhds", "bshd", "bshd"), "padding"),
    (1, 4, 130, 77, 40, ("bshd",) * 4, "causal"),
    (2, 2, 70, 70, 15, ("bshd", "bshd", "bhsd", "bshd"), None),
]


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "haswell"])
@pytest.mark.parametrize("case", COPIED, ids=lambda c: "x".join(map(str, c[:5])))
def test_heads_copied_into_consecutive_rows_match_numpy(case, target):
    """``copy_heads``: one task per head copies K and V into consecutive rows and runs all
    the head's query blocks on them; the same numerics as reading them in place."""
    batch, heads, q_len, kv_len, d, layouts, mask_kind = case
    mask = _padding_mask(batch, kv_len) if mask_kind == "padding" else (
        np.triu(np.full((q_len, kv_len), -np.inf, "float32"), 1)[None, None]
        if mask_kind == "causal" else None)
    shape = AttentionShape(batch, heads, q_len, kv_len, d, *layouts,
                           mask_shape=None if mask is None else mask.shape,
                           scale=1 / math.sqrt(d))
    target = target or host_target()
    knobs = dataclasses.replace(choose_knobs(target, shape), copy_heads=True)
    assert fits(shape, knobs) and "K and V copied per head" in knobs.describe()
    got, want, _ = _run_kernel(shape, target, mask, knobs=knobs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_heads_are_copied_where_rows_lie_apart_and_every_thread_has_whole_tasks():
    """Rule 5 on 2 threads: a BERT head split (rows 768 floats apart) copies, as does a
    transposed K; heads already [b, h, s, d] do not, nor one query block, nor 3 heads on 2
    threads, nor K and V over :data:`COPY_BYTES`; records round-trip the knob."""
    def knobs(batch, heads, seq, layouts, kv=None):
        shape = AttentionShape(batch, heads, seq, kv or seq, 64, *layouts,
                               mask_shape=(batch, 1, 1, kv or seq), scale=0.125)
        return shape, choose_knobs(HASWELL, shape)

    split = ("bshd",) * 4
    assert knobs(8, 12, 128, split)[1].copy_heads
    assert knobs(1, 16, 512, split)[1].copy_heads
    assert knobs(1, 2, 200, ("bhsd", "bhds", "bhsd", "bhsd"))[1].copy_heads
    assert not knobs(8, 12, 128, ("bhsd",) * 4)[1].copy_heads
    assert not knobs(8, 12, 32, split)[1].copy_heads  # one query block of 32
    assert not knobs(1, 3, 128, split)[1].copy_heads
    shape, long = knobs(1, 2, 128, split, kv=COPY_BYTES // (2 * 64 * 4) + 1)
    assert not long.copy_heads
    assert not fits(shape, dataclasses.replace(long, copy_heads=True))
    shape, copied = knobs(8, 12, 128, split)
    assert knobs_from_dict(HASWELL, copied.as_dict(), shape) == copied
    assert sum(k.copy_heads != copied.copy_heads for k in variants(HASWELL, shape)) == 1
    record = copied.as_dict()
    del record["copy_heads"]  # a record from before the knob: reads in place
    assert not knobs_from_dict(HASWELL, record, shape).copy_heads


@pytest.mark.parametrize("keep_if", [True, False])
def test_boolean_and_additive_masks(keep_if):
    """``where(cond, scores, fill)`` (either way round) then an additive padding mask."""
    q_len = kv_len = 70
    causal = np.tril(np.ones((q_len, kv_len), bool))[None, None]
    cond = causal if keep_if else ~causal
    mask = _padding_mask(2, kv_len)
    shape = AttentionShape(2, 2, q_len, kv_len, 32, mask_shape=mask.shape, scale=0.2,
                           cond_shape=cond.shape, fill=-np.inf, keep_if=keep_if)
    got, want, _ = _run_kernel(shape, HASWELL, mask, cond)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "haswell"])
def test_softmax_exp2_is_within_1e_7_of_exact_and_keeps_nan(target):
    """The kernels' ``2**x`` (scores in base 2), vectorised as in the kernels: within 1e-7
    relative of the exact value from 0 down to -126, where it stops (a masked score: -1e4,
    -inf and the lowest float give ``2**-126``); a NaN stays NaN."""
    from tvm.script import tirx as T

    @T.prim_func
    def exps(A: T.Buffer((4096,), "float32"), B: T.Buffer((4096,), "float32")):
        for i in range(64):
            for j in T.vectorized(64):
                B[i * 64 + j] = exp2_nonpositive(A[i * 64 + j])

    x = np.concatenate([-np.linspace(0, 126, 3968), -RNG.random(64) * 1e-6,
                        [-126.4, -127, -1e4, -np.inf, -3.4e38, np.nan, -0.0, -0.5] * 8])
    x = x.astype("float32")
    ex = tvm.compile(tvm.IRModule({"main": exps}), target=target or host_target())
    out = tvm.runtime.empty((4096,), "float32")
    ex["main"](tvm.runtime.tensor(x), out)
    got = out.numpy().astype(np.float64)
    want = np.exp2(np.maximum(x.astype(np.float64), -126.0))
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all()
    assert np.abs(got[~nan] / want[~nan] - 1).max() <= 1e-7


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "haswell"])
def test_lowest_float_masks_stay_finite_in_base_2(target):
    """Masks of ``finfo(float32).min`` (Hugging Face's padding), additive or as the fill of a
    boolean mask, times ``log2(e)`` in the kernel (the fill kept a float32, the additive mask
    -inf): a query whose every key is masked averages all values, as the unfused graph does,
    and is not NaN."""
    lowest = float(np.finfo("float32").min)
    q_len = kv_len = 40
    mask = np.zeros((2, 1, q_len, kv_len), "float32")
    mask[0, :, :, 30:] = lowest  # padding
    mask[1, :, 5] = lowest  # query 5 of batch 1 sees no key
    target = target or host_target()
    shape = AttentionShape(2, 2, q_len, kv_len, 32, mask_shape=mask.shape, scale=0.2)
    got, want, _ = _run_kernel(shape, target, mask)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    cond = np.ones((1, 1, q_len, kv_len), bool)
    cond[..., 7, :] = False  # query 7 sees no key
    cond[..., :, 33:] = False
    shape = AttentionShape(2, 2, q_len, kv_len, 32, scale=0.2, cond_shape=cond.shape,
                           fill=lowest)
    got, want, _ = _run_kernel(shape, target, None, cond)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "haswell"])
def test_a_nan_query_gives_nan_in_its_own_row_only(target):
    """A NaN in one query (and -inf padding in the mask) as the unfused graph has it: that
    query's output row is NaN, every other row matches numpy."""
    shape = AttentionShape(1, 2, 70, 130, 64, mask_shape=(1, 1, 1, 130), scale=0.125)
    target = target or host_target()
    func = attention_kernel(shape, choose_knobs(target, shape)).with_attr("global_symbol",
                                                                          "attention")
    ex = tvm.compile(tvm.IRModule({"attention": func}), target=target)
    q, k, v = (RNG.standard_normal((1, 2, n, 64)).astype("float32") for n in (70, 130, 130))
    q[0, 1, 5, 3] = np.nan
    mask = np.zeros((1, 1, 1, 130), "float32")
    mask[..., 100:] = -np.inf
    tensors = [tvm.runtime.tensor(a) for a in (q, k, v, mask, np.zeros_like(q))]
    ex["attention"](*tensors)
    got = tensors[-1].numpy()
    want = _reference(q, k, v, mask, 0.125)
    assert np.isnan(got[0, 1, 5]).all()
    got[0, 1, 5] = want[0, 1, 5] = 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_knobs_come_from_the_registry_and_keep_accumulators_on_the_stack():
    for target, lanes in ((HASWELL, 8), (ZNVER4, 16)):
        family = best_vector_family(target, "float32")
        knobs = choose_knobs(target, AttentionShape(1, 12, 384, 384, 64))
        for tile in (knobs.qk, knobs.pv):  # the family's description, another tile shape
            assert (tile.isa, tile.features, tile.lanes) == (
                family.first.isa, family.first.features, lanes)
            assert tile.mr * tile.nr * 4 <= TILE_BYTES and tile.fits_registers()
        assert knobs.qk.mr * knobs.qk.nr * 4 < STACK_BYTES
        assert knobs.q_block == 4 * lanes and 384 % knobs.k_block == 0
        assert knobs.k_block <= KEY_BLOCK and 64 % knobs.pv.nr == 0
        # Key blocks: 128 keys with AVX-512; 64 with AVX2, whose scores and V rows then share
        # the L1 (384 keys: 3 or 6 blocks; 200 keys: 2 blocks of 100 or 4 of 50).
        assert knobs.k_block == (128 if lanes == 16 else 64)
        assert choose_knobs(target, AttentionShape(1, 2, 200, 200, 64)).k_block == \
            (100 if lanes == 16 else 50)
        # P.V: 4 x 64 on AVX-512; on AVX2 the GEMM ranking ties 4 x 16 with 2 x 32, and the
        # taller tile (fewer rows of V loaded per key) wins the tie.
        assert (knobs.pv.mr, knobs.pv.nr) == (4, 4 * lanes if lanes == 16 else 2 * lanes)
        # 197 queries: blocks of two vectors pad fewer rows than blocks of four.
        assert choose_knobs(target, AttentionShape(1, 12, 197, 197, 64)).q_block == 2 * lanes
    # Head dimensions no tile divides: P.V's tiles no wider than the head (whole tiles, then
    # the channel tail), else the narrowest.
    for d, nr in ((20, 16), (40, 32), (8, 16), (72, 64)):
        assert choose_knobs(ZNVER4, AttentionShape(1, 2, 16, 16, d)).pv.nr == nr, d
    assert choose_knobs(HASWELL, AttentionShape(1, 2, 16, 16, 15)).pv.nr == 8


@pytest.mark.parametrize("target", [HASWELL, ZNVER4], ids=["haswell", "znver4"])
def test_fused_attention_assembly_keeps_tiles_in_registers(target):
    """The register tiles' accumulators stay in vector registers across the reduction (no
    store after an FMA), whether TVM placed the array on the stack or in workspace."""
    shape = AttentionShape(1, 2, 64, 100, 64, mask_shape=(1, 1, 1, 100), scale=0.125)
    func = attention_kernel(shape, choose_knobs(target, shape)).with_attr(
        "global_symbol", "attention")
    ex = tvm.compile(tvm.IRModule({"attention": func}), target=target)
    # Heap workspace for Q^T, the scores and the output rows (and a 1 KiB P.V tile).
    ll = ex.mod.inspect_source("ll")
    assert len(re.findall(r"load ptr, ptr @__TVMBackendAllocWorkspace", ll)) <= 4
    asm = ex.mod.inspect_source("s")
    register = "zmm" if target is ZNVER4 else "ymm"
    fmas = re.findall(rf"vfmadd231ps\s+[^\n]*%{register}", asm)
    assert len(fmas) >= 8
    # Accumulators stay in registers across the k loop: no FMA result is stored right away.
    lines = asm.splitlines()
    stored = sum(1 for i, line in enumerate(lines[:-1])
                 if "vfmadd231ps" in line and "vmovups" in lines[i + 1]
                 and line.split(",")[-1].strip() in lines[i + 1])
    assert stored <= len(fmas) // 4, f"{stored} of {len(fmas)} FMAs stored at once"


@pytest.mark.parametrize("target", [HASWELL, ZNVER4], ids=["haswell", "znver4"])
def test_query_block_is_transposed_in_registers(target):
    """Q's block is transposed a vector-square tile at a time with shuffles (``vshufps`` among
    them) where its channels fill whole vectors; a head dimension of 20 takes the element-wise
    copy (no ``vshufps``). Numerics of both: the kernel cases above."""
    register = "zmm" if target is ZNVER4 else "ymm"
    counts = {}
    for d in (64, 20):
        shape = AttentionShape(1, 2, 64, 100, d, mask_shape=(1, 1, 1, 100), scale=0.125)
        func = attention_kernel(shape, choose_knobs(target, shape)).with_attr(
            "global_symbol", "attention")
        asm = tvm.compile(tvm.IRModule({"attention": func}), target=target).mod.inspect_source(
            "s")
        counts[d] = len(re.findall(rf"vshufps\s[^\n]*%{register}", asm))
    lanes = 16 if target is ZNVER4 else 8
    assert counts[64] >= 2 * lanes and counts[20] == 0, counts


# --- the graph pass ---------------------------------------------------------------------------


def _bert_attention(bb, x, mask, *, heads=2, seq=40, d=32, merge=True):
    """The head split, scaled scores, additive mask, softmax, P.V and head merge of BERT."""
    b = x.ty.shape.values[0]

    def split(t):
        return bb.emit(relax.op.permute_dims(
            bb.emit(relax.op.reshape(t, (b, seq, heads, d))), [0, 2, 1, 3]))

    q, k, v = (split(bb.emit(relax.op.multiply(x, relax.const(c, "float32"))))
               for c in (1.0, 0.5, 2.0))
    kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
    scores = bb.emit(relax.op.matmul(q, kt))
    scaled = bb.emit(relax.op.divide(scores, relax.const(math.sqrt(d), "float32")))
    probs = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.add(scaled, mask)), axis=-1))
    out = bb.emit(relax.op.matmul(probs, v))
    if not merge:
        return out
    return relax.op.reshape(bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3])),
                            (b, seq, heads * d))


def test_fuse_attention_structure():
    """The whole subgraph becomes one call of the kernel, reading the head split in place
    (``[b, s, h, d]``) and writing the head merge's order."""
    x = relax.Var("x", relax.TensorType((2, 40, 64), "float32"))
    mask = relax.Var("mask", relax.TensorType((2, 1, 1, 40), "float32"))
    before = relax_function([x, mask], _bert_attention)
    # The scale as the pass reads it: the reciprocal of the fp32 divisor.
    shape = AttentionShape(2, 2, 40, 40, 32, "bshd", "bshd", "bshd", "bshd", 4,
                           (2, 1, 1, 40), 1 / float(np.float32(math.sqrt(32))))
    knobs = choose_knobs(HASWELL, shape)

    def expected(bb, x, mask):
        q, k, v = (bb.emit(relax.op.reshape(bb.emit(relax.op.multiply(
            x, relax.const(c, "float32"))), (2, 40, 2, 32))) for c in (1.0, 0.5, 2.0))
        gv = bb.add_func(attention_kernel(shape, knobs), FUSED_ATTENTION)
        out = bb.emit(relax.call_tir(gv, [q, k, v, mask],
                                     relax.TensorType((2, 40, 2, 32), "float32")))
        return relax.op.reshape(out, (2, 40, 64))

    after = passes.FuseAttention(HASWELL)(before)
    tvm.ir.assert_structural_equal(after, relax_function([x, mask], expected),
                                   map_free_vars=True)


def test_fuse_attention_declines_what_it_cannot_fuse():
    x = relax.Var("x", relax.TensorType((2, 40, 64), "float32"))
    mask = relax.Var("mask", relax.TensorType((2, 1, 1, 40), "float32"))

    def scores_used_twice(bb, x, mask):
        q = bb.emit(relax.op.reshape(x, (2, 40, 2, 32)))
        q = bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3]))
        scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(q, [0, 1, 3, 2]))))
        probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
        return relax.op.add(bb.emit(relax.op.matmul(probs, q)), relax.op.sum(scores))

    module = relax_function([x, mask], scores_used_twice)
    tvm.ir.assert_structural_equal(passes.FuseAttention(HASWELL)(module), module)
    square = relax.Var("x", relax.TensorType((1, 2, 16, 16), "float32"))

    def softmax_over_queries(bb, q):  # not over the keys: not attention
        probs = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.matmul(
            q, bb.emit(relax.op.permute_dims(q, [0, 1, 3, 2])))), axis=2))
        return relax.op.matmul(probs, q)

    module = relax_function([square], softmax_over_queries)
    tvm.ir.assert_structural_equal(passes.FuseAttention(HASWELL)(module), module)


def test_fuse_attention_reads_through_a_flattened_softmax():
    """TVM imports ONNX's Softmax before opset 13 as ``reshape(softmax(reshape(x, [n, s])),
    x.shape)``; the pass reads through it (and only when the last axis is kept)."""
    q = relax.Var("q", relax.TensorType((1, 2, 16, 15), "float32"))

    def flattened(rows):
        def build(bb, q):
            scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(q, [0, 1, 3, 2]))))
            flat = bb.emit(relax.op.reshape(scores, rows))
            probs = bb.emit(relax.op.reshape(bb.emit(relax.op.nn.softmax(flat, axis=-1)),
                                             (1, 2, 16, 16)))
            return relax.op.matmul(probs, q)
        return build

    after = passes.FuseAttention(HASWELL)(relax_function([q], flattened((32, 16))))
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    assert [str(c.op.name) for c in calls if isinstance(c, relax.Call)] == ["relax.call_tir"]
    assert "hybrid_attention" in [gv.name_hint for gv in after.get_global_vars()]
    module = relax_function([q], flattened((64, 8)))  # rows of 8: not the keys' axis
    tvm.ir.assert_structural_equal(passes.FuseAttention(HASWELL)(module), module)


# --- end to end -------------------------------------------------------------------------------


def _softmax_attention_rank3(n=6, seq=45, d=32) -> onnx.ModelProto:
    """Rank-3 attention with a Mul scale and a mask built in the graph's inputs."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Add", ["ss", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["out"]),
    ]
    value = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        nodes, "attention3",
        [value("q", [n, seq, d]), value("k", [n, seq, d]), value("v", [n, seq, d]),
         value("mask", [1, seq, seq])],
        [value("out", [n, seq, d])],
        initializer=[helper.make_tensor("scale", TensorProto.FLOAT, [],
                                        [1 / math.sqrt(d)])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every ONNX Runtime since 1.10 reads (1.30 refuses onnx's 14)
    return model


def _gpt_attention(batch=2, heads=2, seq=37, d=32) -> onnx.ModelProto:
    """GPT-2 style: Q and K^T each scaled by d**-0.25 (PyTorch's SDPA export), a causal
    ``Where`` with -inf, then an additive padding mask."""
    root = np.array(d ** -0.25, "float32")
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["q", "root"], ["qs"]),
        helper.make_node("Mul", ["kt", "root"], ["kts"]),
        helper.make_node("MatMul", ["qs", "kts"], ["s"]),
        helper.make_node("Where", ["causal", "s", "neg_inf"], ["sc"]),
        helper.make_node("Add", ["sc", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["out"]),
    ]
    shape = [batch, heads, seq, d]
    value = lambda n, s, t=TensorProto.FLOAT: helper.make_tensor_value_info(n, t, s)  # noqa: E731
    graph = helper.make_graph(
        nodes, "gpt_attention",
        [value("q", shape), value("k", shape), value("v", shape),
         value("causal", [1, 1, seq, seq], TensorProto.BOOL), value("mask", [batch, 1, 1, seq])],
        [value("out", shape)],
        initializer=[helper.make_tensor("root", TensorProto.FLOAT, [], [float(root)]),
                     helper.make_tensor("neg_inf", TensorProto.FLOAT, [], [-np.inf])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every ONNX Runtime since 1.10 reads (1.30 refuses onnx's 14)
    return model


def test_gpt_style_attention_with_causal_where_and_operand_scales():
    model = _gpt_attention()
    inputs = {n: RNG.standard_normal((2, 2, 37, 32)).astype("float32") for n in "qkv"}
    inputs["causal"] = np.tril(np.ones((37, 37), bool))[None, None]
    inputs["mask"] = _padding_mask(2, 37)
    compiled = tvm_hybrid.compile(model)
    names = compiled.kernel_names()
    assert [n for n in names if n.startswith(FUSED_ATTENTION)] == [FUSED_ATTENTION], names
    assert not any("softmax" in n or "where" in n for n in names), names
    # Every node of the subgraph is attributed to the kernel (the profile report).
    nodes = set(compiled.kernels[FUSED_ATTENTION].nodes)
    assert {"Where 'sc'", "Softmax 'p'", "Mul 'qs'", "Mul 'kts'", "MatMul 'out'"} <= nodes
    want = _onnxruntime(model, inputs)
    got = np.asarray(compiled(**inputs))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _onnxruntime(model, inputs):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


@pytest.mark.parametrize("make", [
    lambda: workloads.attention(2, 77, heads=4),
    lambda: workloads.bert_layer(2, 40, hidden=128, heads=4, ffn=256),
], ids=["mha", "bert_layer"])
def test_onnx_attention_is_one_kernel_and_matches_onnxruntime(make):
    wl = make()
    compiled = tvm_hybrid.compile(wl.model)
    names = compiled.kernel_names()
    fused = [n for n in names if n.startswith(FUSED_ATTENTION)]
    assert len(fused) == 1, names
    assert not any("softmax" in n for n in names), names
    got = compiled(**wl.inputs)
    want = _onnxruntime(wl.model, wl.inputs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def _svtr_attention(seq=40, heads=8, d=15) -> onnx.ModelProto:
    """PP-OCR's SVTR attention as paddle2onnx writes it (opset 11): one QKV projection split
    by ``Reshape [0, -1, 3, h, d]``, ``Transpose [2, 0, 3, 1, 4]`` and ``Slice``/``Squeeze``,
    ``Q`` scaled, an opset-11 ``Softmax`` (TVM flattens its rows), the head merge; 15 head
    channels, which no vector divides."""
    width = heads * d
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["qkv"]),
             helper.make_node("Reshape", ["qkv", "split"], ["heads"]),
             helper.make_node("Transpose", ["heads"], ["parts"], perm=[2, 0, 3, 1, 4])]
    for i, name in enumerate("qkv"):
        nodes += [helper.make_node("Slice", ["parts", f"s{i}", f"e{i}", "axis0"], [f"{name}5"]),
                  helper.make_node("Squeeze", [f"{name}5"], [f"{name}4"], axes=[0])]
    nodes += [helper.make_node("Mul", ["q4", "scale"], ["qs"]),
              helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qs", "kt"], ["scores"]),
              helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v4"], ["out4"]),
              helper.make_node("Transpose", ["out4"], ["merged"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["merged", "merge"], ["out"])]
    ints = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)],  # noqa: E731
                                                   values)
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [width, 3 * width],
                                rng.standard_normal(3 * width * width).astype("float32") * 0.1),
             ints("split", [0, -1, 3, heads, d]), ints("merge", [0, -1, width]), ints("axis0", [0]),
             helper.make_tensor("scale", TensorProto.FLOAT, [], [d ** -0.5])]
    inits += [t for i in range(3) for t in (ints(f"s{i}", [i]), ints(f"e{i}", [i + 1]))]
    value = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(nodes, "svtr_attention", [value("x", [1, seq, width])],
                              [value("out", [1, seq, width])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    return model


def test_paddle_svtr_attention_with_15_head_channels_is_one_kernel():
    model = _svtr_attention()
    inputs = {"x": RNG.standard_normal((1, 40, 120)).astype("float32")}
    compiled = tvm_hybrid.compile(model)
    names = compiled.kernel_names()
    assert [n for n in names if n.startswith(FUSED_ATTENTION)] == [FUSED_ATTENTION], names
    assert not any("softmax" in n for n in names), names
    assert "Softmax 'probs'" in set(compiled.kernels[FUSED_ATTENTION].nodes)
    want = _onnxruntime(model, inputs)
    np.testing.assert_allclose(np.asarray(compiled(**inputs)), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def test_rank3_attention_with_a_causal_mask():
    model = _softmax_attention_rank3()
    mask = np.triu(np.full((45, 45), -1e9, "float32"), 1)[None]
    inputs = {n: RNG.standard_normal((6, 45, 32)).astype("float32") for n in "qkv"}
    inputs["mask"] = mask
    compiled = tvm_hybrid.compile(model)
    assert any(n.startswith(FUSED_ATTENTION) for n in compiled.kernel_names())
    want = _onnxruntime(model, inputs)
    np.testing.assert_allclose(np.asarray(compiled(**inputs)), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def test_no_score_matrix_is_stored():
    """The attention of a 384-token sequence keeps its scores per block: no buffer of a head's
    ``384 x 384`` scores in any kernel, and no such tensor between kernels."""
    wl = workloads.attention(1, 384, heads=2)
    compiled = tvm_hybrid.compile(wl.model)
    scores = 384 * 384
    info = compiled.kernels[next(n for n in compiled.kernel_names()
                                 if n.startswith(FUSED_ATTENTION))]
    assert info.schedule == "template" and "fused attention" in info.detail
    tir = compiled.inspect_source("tir")
    assert ATTENTION_ATTR in tir
    buffers = [math.prod(int(v) for v in dims.split(",") if v.strip())
               for dims in re.findall(r"T\.alloc_buffer\(\(([\d, ]+)\)", tir)]
    assert buffers and max(buffers) < scores, buffers
    storage = [int(n) for n in re.findall(r"alloc_storage\(R\.shape\(\[(\d+)\]\)",
                                          compiled.lowered["main"].script())]
    assert storage and max(storage) < scores * 4, storage


def test_tuning_leaves_the_generated_kernel_alone():
    """Task extraction skips the fused attention (generated scheduled; MetaSchedule cannot
    read it), keeps the GEMM tasks, and the unfused graph is one PassContext option away."""
    from tvm_hybrid.tuning.tune import extract_tasks

    wl = workloads.bert_layer(1, 32, hidden=128, heads=2, ffn=256)
    tasks = extract_tasks(wl.model, host_target(), others=True)
    assert tasks and any(t.templated for t in tasks)
    for task in tasks:
        func = task.mod["main"]
        assert ATTENTION_ATTR not in (func.attrs or {})
    with tvm.transform.PassContext(opt_level=3, disabled_pass=["FuseAttention"]):
        unfused = tvm_hybrid.compile(workloads.attention(1, 32, heads=2).model)
    assert not any(n.startswith(FUSED_ATTENTION) for n in unfused.kernel_names())
