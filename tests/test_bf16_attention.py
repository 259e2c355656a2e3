"""bf16 fused attention (``schedules/attention/bf16_kernel.py``): ``precision="bf16"`` on CPUs
with a bf16 dot product.

The kernel's arithmetic (bf16 operands and probabilities, fp32 sums and softmax) is checked
against a numpy model of it and against the exact float64 attention, on the ``vdpbf16ps``
family where the host has AVX512-BF16 and on the widening family (the same kernel, bf16
widened to fp32 in the update: the same sums of exact products) on any AVX2 host. The assembly
test compiles for named CPUs and reads the code anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import re

import ml_dtypes
import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid import passes
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import host_target
from tvm_hybrid.microkernels import best_vector_family
from tvm_hybrid.passes.fuse_attention import ATTENTION_PREP, FUSED_ATTENTION
from tvm_hybrid.schedules.attention import ATTENTION_ATTR, AttentionShape, choose_knobs, variants
from tvm_hybrid.schedules.attention.amx_kernel import (
    KEY_MULTIPLE,
    amx_attention_kernel,
    exp2_nonpositive,
)
from tvm_hybrid.schedules.attention.bf16_kernel import (
    bf16_attention_kernel,
    bf16_prep_kernel,
    bf16_prep_shapes,
)
from tvm_hybrid.schedules.attention.heuristics import (
    bf16_attention_pays,
    bf16_family,
    grouped_knobs,
)

HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
ZNVER4 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
SAPPHIRE = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
#: AVX512-BF16 without AMX: Intel's vdpbf16ps is no faster than its FMAs (attention stays fp32).
COOPERLAKE = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "cooperlake", "num-cores": 2})


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _references(q, k, v, mask, scale, cond=None):
    """``(model, exact)``: the kernel's arithmetic in numpy (bf16 Q, K, V and unnormalised
    probabilities, float64 sums) and the float64 attention; operands ``[b, h, s, d]``."""
    def scores(q, k):
        s = np.einsum("bhid,bhjd->bhij", q, k) * scale
        if cond is not None:
            s = np.where(cond, s, -np.inf)
        return s + mask if mask is not None else s

    s = scores(_bf16(q), _bf16(k))
    e = np.exp(s - s.max(-1, keepdims=True))
    model = np.einsum("bhij,bhjd->bhid", _bf16(e), _bf16(v)) / e.sum(-1, keepdims=True)
    s = scores(q.astype(np.float64), k.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    exact = np.einsum("bhij,bhjd->bhid", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    return model, exact


def _to_layout(a, layout):
    return np.ascontiguousarray({"bhsd": a, "bshd": a.transpose(0, 2, 1, 3),
                                 "bhds": a.transpose(0, 1, 3, 2)}[layout])


CASES = [
    # (batch, heads, q_len, kv_len, head_dim, layouts (q, k, v, out), masks)
    (1, 2, 64, 64, 64, ("bhsd",) * 4, "padding"),                       # whole blocks
    (2, 3, 37, 45, 64, ("bshd", "bhds", "bshd", "bshd"), "causal"),     # tails, K^T given
    (1, 1, 5, 7, 32, ("bhsd",) * 4, None),                              # smaller than a tile
]

# The bf16 dot product where the host has it, the widening family (on Haswell) anywhere.
FAMILIES = [pytest.param(None, marks=pytest.mark.requires("avx512bf16"), id="vdpbf16ps"),
            pytest.param(HASWELL, id="widening")]


def _case_operands(case):
    """``(q, k, v, mask, cond, shape)`` of a case (``[b, h, s, d]`` operands, bf16 shape)."""
    batch, heads, q_len, kv_len, d, layouts, masks = case
    rng = np.random.default_rng(q_len)
    q, k, v = (rng.standard_normal((batch, heads, n, d)).astype("float32")
               for n in (q_len, kv_len, kv_len))
    mask = cond = None
    if masks is not None:
        mask = np.zeros((batch, 1, 1, kv_len), "float32")
        mask[-1, ..., kv_len - 3:] = -10000.0
    if masks == "causal":
        cond = np.tril(np.ones((q_len, kv_len), bool), kv_len - q_len)[None, None]
    scale = 1 / math.sqrt(d)
    shape = AttentionShape(batch, heads, q_len, kv_len, d, *layouts, rank=4,
                           mask_shape=None if mask is None else mask.shape, scale=scale,
                           cond_shape=None if cond is None else cond.shape, fill=-math.inf,
                           bf16=True)
    return q, k, v, mask, cond, shape


def _run(ex, shape, layouts, q, k, v, mask, cond, key_multiple=1):
    """Run ``ex``'s ``prep`` and ``attention``: ``(K's words, output [b, h, s, d])``."""
    words = [tvm.runtime.empty(s, "int32") for s in bf16_prep_shapes(shape, key_multiple)]
    ex["prep"](tvm.runtime.tensor(_to_layout(k, layouts[1])),
               tvm.runtime.tensor(_to_layout(v, layouts[2])), *words)
    out = tvm.runtime.tensor(np.full(shape.tensor_shape(layouts[3], shape.q_len), np.nan,
                                     "float32"))
    extra = [tvm.runtime.tensor(m) for m in (mask, cond) if m is not None]
    ex["attention"](tvm.runtime.tensor(_to_layout(q, layouts[0])), *words, *extra, out)
    got = out.numpy()
    return words, got if layouts[3] == "bhsd" else got.transpose(0, 2, 1, 3)


def _check_bf16_arithmetic(got, q, k, v, mask, cond, scale):
    model, exact = _references(q, k, v, mask, scale, cond)
    scale_out = np.abs(exact).max()
    # The kernel's own arithmetic up to fp32 sums and its exp (a probability within rounding
    # of a bf16 boundary may round the other way); bf16's error against the exact result.
    assert np.abs(got - model).max() <= 2e-3 * scale_out
    assert np.abs(got - exact).max() <= 2e-2 * scale_out
    assert np.abs(got - exact).max() > 1e-6 * scale_out  # it did round to bf16


@pytest.mark.parametrize("target", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_bf16_attention_kernel_computes_in_bf16(case, target):
    layouts = case[5]
    q, k, v, mask, cond, shape = _case_operands(case)
    target = target or host_target()
    family = bf16_family(target) or best_vector_family(target, "bfloat16")
    knobs = grouped_knobs(family, shape)
    assert knobs is not None and knobs.qk.in_dtype == "bfloat16", shape.describe()
    mod = tvm.IRModule({
        "prep": bf16_prep_kernel(shape).with_attr("global_symbol", "prep"),
        "attention": bf16_attention_kernel(shape, knobs).with_attr("global_symbol",
                                                                   "attention")})
    ex = tvm.compile(mod, target=target)
    words, got = _run(ex, shape, layouts, q, k, v, mask, cond)
    # K's words are its bf16 pairs (round to nearest even), exactly.
    kb = k.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    want = (kb[..., 0::2] | kb[..., 1::2] << 16).view(np.int32).transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(words[0].numpy(), want)
    _check_bf16_arithmetic(got, q, k, v, mask, cond, shape.scale)


AMX_CASES = [*(c for c in CASES if c[4] % 32 == 0),
             (1, 2, 100, 130, 128, ("bhsd",) * 4, "padding")]  # 4 query blocks, keys padded


@pytest.mark.requires("amx-tile", "amx-bf16")
@pytest.mark.parametrize("case", AMX_CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_amx_bf16_attention_kernel_computes_in_bf16(case):
    """The AMX kernel: the same arithmetic as the vector bf16 kernel (bf16 operands and
    probabilities, fp32 sums), keys padded to 32 with zero words that score nothing."""
    layouts = case[5]
    q, k, v, mask, cond, shape = _case_operands(case)
    target = host_target()
    knobs = choose_knobs(target, shape)
    assert knobs is not None and knobs.qk.per_block, shape.describe()
    mod = tvm.IRModule({
        "prep": bf16_prep_kernel(shape, KEY_MULTIPLE).with_attr("global_symbol", "prep"),
        "attention": amx_attention_kernel(shape, knobs).with_attr("global_symbol",
                                                                  "attention")})
    ex = tvm.compile(mod, target=target)
    words, got = _run(ex, shape, layouts, q, k, v, mask, cond, KEY_MULTIPLE)
    kw, vw = (w.numpy() for w in words)
    assert kw.shape[3] % 32 == 0 and vw.shape[2] % 16 == 0
    assert not kw[..., shape.kv_len:].any() and not vw[:, :, -(-shape.kv_len // 2):].any()
    _check_bf16_arithmetic(got, q, k, v, mask, cond, shape.scale)


def test_amx_softmax_exp2_is_within_3e_6_of_exact():
    """The AMX kernel's ``2**t`` (``t <= 0``), scalar and as 16 lanes, on any x86 host: within
    3e-6 relative of the exact power down to -125, where it stops (a masked score)."""
    from tvm.script import tirx as T

    @T.prim_func
    def powers(A: T.Buffer((4096,), "float32"), B: T.Buffer((4096,), "float32"),
               C: T.Buffer((4096,), "float32")):
        for i in range(256):
            B[T.ramp(i * 16, 1, 16)] = exp2_nonpositive(A[T.ramp(i * 16, 1, 16)], 16)
        for i in T.vectorized(4096):
            C[i] = exp2_nonpositive(A[i])

    t = np.concatenate([-np.linspace(0, 124.9, 4000), [-125, -126, -1e4, -3e38] * 24])
    t = t.astype("float32")
    ex = tvm.compile(tvm.IRModule({"main": powers}), target=host_target())
    out = [tvm.runtime.empty((4096,), "float32") for _ in range(2)]
    ex["main"](tvm.runtime.tensor(t), *out)
    want = np.exp2(np.maximum(t.astype(np.float64), -125))
    for got in out:
        assert np.abs(got.numpy() / want - 1).max() <= 3e-6  # -3e38 too: 2**-125


def test_amx_bf16_attention_compiles_to_tiles_with_no_scores_of_the_whole_sequence():
    """For Sapphire Rapids (compiled and read anywhere): both products on ``tdpbf16ps``, the
    scores of one query block only (``q_block x keys``), query blocks the tuner measures."""
    shape = AttentionShape(1, 2, 200, 200, 64, q_layout="bshd", k_layout="bshd",
                           v_layout="bshd", out_layout="bshd", mask_shape=(1, 1, 1, 200),
                           scale=0.125, bf16=True)
    knobs = choose_knobs(SAPPHIRE, shape)  # 2 tasks per thread of 128 queries
    assert knobs is not None and knobs.qk.isa == "amx" and knobs.q_block == 128
    assert "amx bfloat16 fused attention" in knobs.describe()
    func = amx_attention_kernel(shape, knobs)
    sizes = [math.prod(int(v) for v in dims.split(",") if v.strip())
             for dims in re.findall(r"T\.alloc_buffer\(\(([\d, ]+)\)", func.script())]
    assert sizes and max(sizes) == 128 * 224 < 200 * 200, sizes  # a block's scores, keys padded
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    asm = tvm.compile(mod, target=SAPPHIRE).mod.inspect_source("s")
    assert asm.count("tdpbf16ps") >= 8 and "tileloadd" in asm and "tilestored" in asm
    assert "vcvtneps2bf16" in asm  # the probabilities rounded to bf16
    options = variants(SAPPHIRE, shape)
    assert options[0] == knobs and [k.q_block for k in options] == [128, 32, 64]
    # 16 threads: blocks of 32 queries (14 tasks); 4096 keys: 32 (their scores fill 512 KiB).
    many = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16})
    assert choose_knobs(many, shape).q_block == 32
    long = dataclasses.replace(shape, q_len=4096, kv_len=4096, mask_shape=None)
    assert choose_knobs(SAPPHIRE, long).q_block == 32
    # A head dimension that is not a multiple of 32 has no AMX kernel: fp32 attention.
    assert choose_knobs(SAPPHIRE, dataclasses.replace(shape, head_dim=48)) is None


@pytest.mark.parametrize("target", [ZNVER4, COOPERLAKE], ids=["znver4", "cooperlake"])
def test_bf16_attention_runs_vdpbf16ps_on_zmm(target):
    shape = AttentionShape(1, 2, 64, 100, 64, mask_shape=(1, 1, 1, 100), scale=0.125,
                           bf16=True)
    knobs = choose_knobs(target, shape)
    assert knobs is not None and knobs.qk.isa == "avx512_bf16"
    mod = tvm.IRModule({"attention": bf16_attention_kernel(shape, knobs).with_attr(
        "global_symbol", "attention")})
    asm = tvm.compile(mod, target=target).mod.inspect_source("s")
    assert "vdpbf16ps" in asm and "zmm" in asm
    assert "hybrid_dpbf16ps_512" not in asm.replace(".globl", "")  # inlined, not called
    # The tuner's variants: query blocks of one, two and four vectors, all valid.
    options = variants(target, shape)
    assert options[0] == knobs and {k.q_block for k in options} == {16, 32, 64}


def test_bf16_precision_fuses_bf16_attention_where_the_cpu_has_bf16_dots():
    """``precision="bf16"``: the bf16 preparation and kernel with AVX512-BF16; fp32 attention
    without it (no bf16 dot product) and in fp32 mode."""
    mod = tvm_hybrid.frontend.import_model(workloads.attention(1, 40, heads=2).model).mod
    fused = passes.FuseAttention(ZNVER4, precision="bf16")(mod)
    names = sorted(gv.name_hint.rstrip("0123456789") for gv, f in fused.functions.items()
                   if isinstance(f, tvm.tirx.PrimFunc))
    assert names == [FUSED_ATTENTION, ATTENTION_PREP]
    kernel = next(f for gv, f in fused.functions.items() if gv.name_hint == FUSED_ATTENTION)
    assert "avx512_bf16 fused attention" in str(kernel.attrs[ATTENTION_ATTR])
    assert AttentionShape.from_key(str(kernel.attrs["hybrid.attention_shape"])).bf16
    # Compiled for that CPU (not run here), the profile counts the kernel's FLOPs as bf16.
    compiled = tvm_hybrid.compile(workloads.attention(1, 40, heads=2).model, ZNVER4,
                                  precision="bf16")
    assert compiled.kernels[FUSED_ATTENTION].kind == "bf16"
    # Sapphire Rapids: the same preparation (keys padded to 32) and the AMX kernel.
    fused = passes.FuseAttention(SAPPHIRE, precision="bf16")(mod)
    kernel = next(f for gv, f in fused.functions.items() if gv.name_hint == FUSED_ATTENTION)
    assert "amx bfloat16 fused attention" in str(kernel.attrs[ATTENTION_ATTR])
    prep = next(f for gv, f in fused.functions.items() if gv.name_hint == ATTENTION_PREP)
    assert [int(x) for x in prep.params[2].ty.shape] == [1, 2, 32, 64]  # 40 keys -> 64
    # Haswell has no bf16 dot product; Cooper Lake's is no faster than its fp32 FMAs.
    for target, precision in ((HASWELL, "bf16"), (COOPERLAKE, "bf16"), (ZNVER4, "fp32")):
        fused = passes.FuseAttention(target, precision=precision)(mod)
        kernels = [f for gv, f in fused.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
        assert len(kernels) == 1 and "bf16" not in str(kernels[0].attrs[ATTENTION_ATTR])


@pytest.mark.requires("avx512bf16")
def test_bf16_precision_attention_end_to_end():
    wl = workloads.attention(2, 77, heads=4)
    compiled = tvm_hybrid.compile(wl.model, precision="bf16")
    info = compiled.kernels[FUSED_ATTENTION]
    # AMD: vdpbf16ps; Intel: AMX tiles, or fp32 without AMX (measured faster than vdpbf16ps)
    in_bf16 = bf16_attention_pays(host_target())
    assert ("avx512_bf16" in info.detail or "amx bfloat16" in info.detail) == in_bf16, \
        info.detail
    reference = tvm_hybrid.compile(wl.model, pipeline="stock")
    want = reference(**wl.inputs)
    got = compiled(**wl.inputs)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
