"""int8 (QDQ) fused attention: ``schedules/attention/quantized_kernel.py`` and its matching in
``FuseAttention``.

The kernel's integer products are exact; its softmax is fp32, so a probability within float
rounding of a quantization boundary may round to the neighbouring step. The numeric tests run
it (VNNI on VNNI hosts, AVX2's s16 form on any host) against an integer reference of the same
arithmetic (float64 softmax) and require most rows to be bit-identical and every difference
to be at most the effect of a few such steps; the end-to-end tests compare against ONNX
Runtime's QDQ result (which quantizes the probabilities its own way) within the same bound.
The assembly tests compile for named CPUs (AVX-512 VNNI, AVX-VNNI, AVX2) and read the code on
any host.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

import tvm_hybrid
from tvm_hybrid import passes
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import host_target
from tvm_hybrid.passes.fuse_attention import ATTENTION_PREP, FUSED_ATTENTION
from tvm_hybrid.schedules.attention import (
    ATTENTION_ATTR,
    AttentionShape,
    choose_knobs,
    fits,
    variants,
)
from tvm_hybrid.schedules.attention.quantized_kernel import (
    attention_prep_kernel,
    prep_dtypes,
    prep_shapes,
    quantized_attention_kernel,
)
from tvm_hybrid.schedules.attention.workload import Quantization

HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
ZNVER5 = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
ALDERLAKE = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "alderlake", "num-cores": 2})
NEHALEM = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "nehalem", "num-cores": 2})
#: AVX512-VNNI without AMX (the VNNI family on AMX hosts too).
ICELAKE = {"kind": "llvm", "mcpu": "icelake-server", "num-cores": 2}
SAPPHIRE = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})


def _assert_close_to_integer(got, want, qt: Quantization, v8, steps: int = 3):
    """Most rows bit-identical; elsewhere at most ``steps`` probability steps apart."""
    assert np.isfinite(got).all()
    exact = np.all(got == want, axis=-1).mean()
    assert exact >= 0.9, f"only {exact:.1%} of the rows are exact"
    step = qt.p_scale * qt.v_scale * np.abs(v8.astype(np.int64) - qt.v_zero).max()
    assert np.abs(got - want).max() <= steps * step * 1.0001


def _to_layout(a, layout):
    return np.ascontiguousarray(a if layout == "bhsd" else a.transpose(0, 2, 1, 3))


CASES = [
    # (batch, heads, q_len, kv_len, layouts (q, k, v, out), masked, zero points q/k/v/p)
    (1, 2, 128, 128, ("bhsd",) * 4, True, (131, 120, 125, 0)),       # whole blocks
    (2, 3, 197, 197, ("bhsd",) * 4, True, (0, 255, 128, 0)),          # tails, extreme zeros
    (1, 2, 33, 77, ("bshd", "bshd", "bhsd", "bshd"), False, (7, 200, 3, 128)),  # s8 P
    (1, 1, 5, 6, ("bhsd",) * 4, True, (100, 100, 100, 0)),            # smaller than a tile
]


def _check_preparation(prepared, k8, v8, qt: Quantization, group: int):
    """The preparation's outputs, exactly: VNNI: K's row sums, V's 4-key words and column
    sums; s16: K's and V's pairs less their zero points."""
    batch, heads, kv_len, d = k8.shape
    if group == 4:
        ks, vw, vs = (t.numpy() for t in prepared)
        np.testing.assert_array_equal(ks, k8.astype(np.int64).sum(-1))
        np.testing.assert_array_equal(vs, v8.astype(np.int64).sum(-2))
        padded = np.zeros((batch, heads, 4 * vw.shape[2], d), np.uint8)
        padded[:, :, :kv_len] = v8
        words = padded.reshape(batch, heads, -1, 4, d).transpose(0, 1, 2, 4, 3).copy()
        np.testing.assert_array_equal(vw, words.view(np.int32)[..., 0])
        return
    kw, vw = (t.numpy() for t in prepared)
    keys = (k8.astype(np.int16) - qt.k_zero).transpose(0, 1, 3, 2)  # [b, h, d, kv]
    pairs = keys.reshape(batch, heads, d // 2, 2, kv_len).transpose(0, 1, 2, 4, 3).copy()
    np.testing.assert_array_equal(kw, pairs.view(np.int32)[..., 0])
    padded = np.zeros((batch, heads, 2 * vw.shape[2], d), np.int16)
    padded[:, :, :kv_len] = v8.astype(np.int16) - qt.v_zero
    pairs = padded.reshape(batch, heads, -1, 2, d).transpose(0, 1, 2, 4, 3).copy()
    np.testing.assert_array_equal(vw, pairs.view(np.int32)[..., 0])


def _run_kernel(shape, knobs, target, layouts, q8, k8, v8, masks):
    """Compile and run the preparation and the kernel of ``knobs`` (operands ``[b, h, s,
    d]``, given in ``layouts``; ``masks`` the additive and boolean ones, None where absent):
    ``(the preparation's outputs, the output as [b, h, s, d])``."""
    group, amx = knobs.qk.k_step, knobs.qk.per_block
    mod = tvm.IRModule({
        "prep": attention_prep_kernel(shape, group, amx).with_attr("global_symbol", "prep"),
        "attention": quantized_attention_kernel(shape, knobs).with_attr("global_symbol",
                                                                        "attention")})
    ex = tvm.compile(mod, target=target)
    k_in = tvm.runtime.tensor(_to_layout(k8, layouts[1]))
    prepared = [tvm.runtime.empty(s, t) for s, t in zip(prep_shapes(shape, group, amx),
                                                          prep_dtypes(group, amx))]
    ex["prep"](k_in, tvm.runtime.tensor(_to_layout(v8, layouts[2])), *prepared)
    out = tvm.runtime.tensor(np.full(shape.tensor_shape(layouts[3], shape.q_len), np.nan,
                                     "float32"))
    ex["attention"](tvm.runtime.tensor(_to_layout(q8, layouts[0])),
                    *([k_in] if group == 4 else []), *prepared,
                    *(tvm.runtime.tensor(m) for m in masks if m is not None), out)
    got = out.numpy()
    return prepared, got if layouts[3] == "bhsd" else got.transpose(0, 2, 1, 3)


# The int8 families: VNNI where the host has it, AVX2's s16 form (compiled for Haswell) on any.
FAMILIES = [pytest.param(tvm_hybrid.make_target(ICELAKE), "vnni",
                         marks=pytest.mark.requires(ICELAKE), id="vnni"),
            pytest.param(HASWELL, "avx2_s16", id="s16")]


@pytest.mark.parametrize("target,isa", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])))
def test_quantized_attention_kernel_is_exact_in_integers(case, target, isa):
    batch, heads, q_len, kv_len, layouts, masked, (zq, zk, zv, zp) = case
    d = 64
    rng = np.random.default_rng(kv_len)
    # Scales that make the softmax peaky (scores of several units), as trained models do.
    qt = Quantization(0.06, zq, 0.05, zk, 0.031, zv, 1 / 256, zp)
    mask = None
    if masked:
        mask = np.zeros((batch, 1, 1, kv_len), "float32")
        for b in range(batch):
            mask[b, ..., kv_len - 1 - 2 * b:] = -10000.0
    shape = AttentionShape(batch, heads, q_len, kv_len, d, *layouts, rank=4,
                           mask_shape=None if mask is None else mask.shape,
                           scale=1 / math.sqrt(d), quant=qt)
    target = target or host_target()
    knobs = choose_knobs(target, shape)
    assert knobs is not None and knobs.qk.isa.endswith(isa), shape.describe()
    group = knobs.qk.k_step
    q8, k8, v8 = (rng.integers(0, 256, (batch, heads, n, d)).astype(np.uint8)
                  for n in (q_len, kv_len, kv_len))
    prepared, got = _run_kernel(shape, knobs, target, layouts, q8, k8, v8, [mask])
    _check_preparation(prepared, k8, v8, qt, group)
    want = workloads.quantized_attention_reference(q8, k8, v8, mask, 1 / math.sqrt(d), qt)
    _assert_close_to_integer(got, want, qt, v8)


@pytest.mark.parametrize("target,isa", FAMILIES)
def test_a_zero_scale_gives_every_key_the_same_weight(target, isa):
    """Scores multiplied by 0 (``shape.scale`` 0.0, not absent): every key gets the same
    probability, the output is V's mean over the keys. Read as "no scale" (1.0), the products
    of these peaky operands would pick a few keys."""
    batch, heads, q_len, kv_len, d = 1, 2, 16, 40, 64
    rng = np.random.default_rng(7)
    qt = Quantization(0.06, 128, 0.05, 120, 0.031, 131, 1 / 256, 0)
    layouts = ("bhsd",) * 4
    shape = AttentionShape(batch, heads, q_len, kv_len, d, *layouts, rank=4, scale=0.0,
                           quant=qt)
    target = target or host_target()
    knobs = choose_knobs(target, shape)
    assert knobs is not None and knobs.qk.isa.endswith(isa), shape.describe()
    q8, k8, v8 = (rng.integers(0, 256, (batch, heads, n, d)).astype(np.uint8)
                  for n in (q_len, kv_len, kv_len))
    _, got = _run_kernel(shape, knobs, target, layouts, q8, k8, v8, [None])
    want = workloads.quantized_attention_reference(q8, k8, v8, None, 0.0, qt)
    _assert_close_to_integer(got, want, qt, v8)
    unscaled = workloads.quantized_attention_reference(q8, k8, v8, None, 1.0, qt)
    assert np.abs(unscaled - want).max() > 10 * qt.p_scale * qt.v_scale * 255


@pytest.mark.parametrize("target,isa", FAMILIES)
@pytest.mark.parametrize("keep_if", [True, False])
def test_quantized_attention_kernel_applies_a_boolean_mask(target, isa, keep_if):
    """GPT's causal mask (``where(cond, scores, -inf)``, or the inverted ``where(cond, -inf,
    scores)``) before a padding mask, on a query block and a key tile with tails."""
    batch, heads, q_len, kv_len, d = 2, 2, 37, 45, 64
    rng = np.random.default_rng(5)
    qt = Quantization(0.06, 130, 0.05, 121, 0.031, 127, 1 / 256, 0)
    causal = np.tril(np.ones((q_len, kv_len), bool), kv_len - q_len)[None, None]
    cond = causal if keep_if else ~causal
    mask = np.zeros((batch, 1, 1, kv_len), "float32")
    mask[1, ..., :3] = -10000.0  # padding at the start of the second sequence
    shape = AttentionShape(batch, heads, q_len, kv_len, d, mask_shape=mask.shape,
                           scale=0.125, cond_shape=cond.shape, fill=-math.inf,
                           keep_if=keep_if, quant=qt)
    target = target or host_target()
    knobs = choose_knobs(target, shape)
    assert knobs is not None and knobs.qk.isa.endswith(isa), shape.describe()
    group = knobs.qk.k_step
    kernel = quantized_attention_kernel(shape, knobs)
    # Q, the keys (K or its words), the prepared operands, both masks, the output.
    assert len(kernel.params) == (8 if group == 4 else 6)
    mod = tvm.IRModule({
        "prep": attention_prep_kernel(shape, group).with_attr("global_symbol", "prep"),
        "attention": kernel.with_attr("global_symbol", "attention")})
    ex = tvm.compile(mod, target=target)
    q8, k8, v8 = (rng.integers(0, 256, (batch, heads, n, d)).astype(np.uint8)
                  for n in (q_len, kv_len, kv_len))
    k_in = tvm.runtime.tensor(k8)
    prepared = [tvm.runtime.empty(s, "int32") for s in prep_shapes(shape, group)]
    ex["prep"](k_in, tvm.runtime.tensor(v8), *prepared)
    out = tvm.runtime.tensor(np.full((batch, heads, q_len, d), np.nan, "float32"))
    ex["attention"](tvm.runtime.tensor(q8), *([k_in] if group == 4 else []), *prepared,
                    tvm.runtime.tensor(mask), tvm.runtime.tensor(cond), out)
    want = workloads.quantized_attention_reference(q8, k8, v8, mask, 0.125, qt, cond,
                                                   keep_if=keep_if)
    _assert_close_to_integer(out.numpy(), want, qt, v8)
    # The mask matters: without it the result is far off.
    unmasked = workloads.quantized_attention_reference(q8, k8, v8, mask, 0.125, qt)
    assert np.abs(unmasked - want).max() > 10 * qt.p_scale * qt.v_scale * 255


AMX_CASES = [
    # (batch, heads, q_len, kv_len, layouts, masked, zero points q/k/v/p, causal)
    (1, 2, 128, 128, ("bhsd",) * 4, True, (131, 120, 125, 0), False),
    (2, 3, 197, 224, ("bshd", "bshd", "bhsd", "bshd"), True, (0, 255, 128, 0), False),
    (1, 2, 33, 96, ("bshd", "bshd", "bhsd", "bshd"), False, (7, 200, 3, 128), False),  # s8 P
    (2, 2, 40, 64, ("bhsd",) * 4, True, (130, 121, 127, 0), True),     # causal, then padding
]


@pytest.mark.requires("amx-tile", "amx-int8", "avx512vnni")
@pytest.mark.parametrize("case", AMX_CASES, ids=lambda c: "x".join(map(str, c[:4])))
def test_amx_int8_attention_is_exact_in_integers(case):
    """Both products on ``tdpbusd`` tiles (``K``'s rows in place, ``V`` transposed by the
    preparation, keys padded to 64 with zeros): the VNNI form's arithmetic, so the same
    integer reference."""
    batch, heads, q_len, kv_len, layouts, masked, (zq, zk, zv, zp), causal = case
    d = 64
    rng = np.random.default_rng(kv_len)
    qt = Quantization(0.06, zq, 0.05, zk, 0.031, zv, 1 / 256, zp)
    mask = cond = None
    if masked:
        mask = np.zeros((batch, 1, 1, kv_len), "float32")
        for b in range(batch):
            mask[b, ..., kv_len - 1 - 2 * b:] = -10000.0
    if causal:
        cond = np.tril(np.ones((q_len, kv_len), bool), kv_len - q_len)[None, None]
    shape = AttentionShape(batch, heads, q_len, kv_len, d, *layouts, rank=4,
                           mask_shape=None if mask is None else mask.shape,
                           scale=1 / math.sqrt(d), quant=qt,
                           cond_shape=None if cond is None else cond.shape, fill=-math.inf)
    target = host_target()
    knobs = choose_knobs(target, shape)
    assert knobs is not None and knobs.qk.isa == "amx" and fits(shape, knobs)
    q8, k8, v8 = (rng.integers(0, 256, (batch, heads, n, d)).astype(np.uint8)
                  for n in (q_len, kv_len, kv_len))
    prepared, got = _run_kernel(shape, knobs, target, layouts, q8, k8, v8, [mask, cond])
    vt = prepared[1].numpy()  # V transposed, keys padded to 64 with zeros
    assert vt.shape[-1] % 64 == 0 and not vt[..., kv_len:].any()
    np.testing.assert_array_equal(vt[..., :kv_len], v8.transpose(0, 1, 3, 2))
    want = workloads.quantized_attention_reference(q8, k8, v8, mask, 1 / math.sqrt(d), qt,
                                                   cond)
    _assert_close_to_integer(got, want, qt, v8)


def test_amx_int8_attention_compiles_to_tdpbusd_tiles():
    """For Sapphire Rapids (compiled and read anywhere): both products on ``tdpbusd``; the
    pass reads K in place and V transposed (u8); shapes AMX cannot take stay on VNNI."""
    qt = Quantization(0.1, 1, 0.1, 2, 0.1, 3, 1 / 256, 0)
    shape = AttentionShape(1, 2, 64, 128, 64, mask_shape=(1, 1, 1, 128), scale=0.125,
                           quant=qt)
    knobs = choose_knobs(SAPPHIRE, shape)
    assert knobs.qk.isa == knobs.pv.isa == "amx" and knobs.q_block == 32  # 2 tasks a thread
    assert "amx uint8 fused attention" in knobs.describe()
    assert sorted(k.q_block for k in variants(SAPPHIRE, shape)) == [32, 64]
    func = quantized_attention_kernel(shape, knobs)
    asm = tvm.compile(tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")}),
                      target=SAPPHIRE).mod.inspect_source("s")
    assert asm.count("tdpbusd") >= 8 and "tileloadd" in asm and "vpdpbusd" in asm  # QS sums
    for other in (dataclasses.replace(shape, kv_len=100, mask_shape=(1, 1, 1, 100)),
                  dataclasses.replace(shape, head_dim=32),
                  dataclasses.replace(shape, k_layout="bhds")):
        assert choose_knobs(SAPPHIRE, other).qk.isa == "avx512_vnni", other.describe()
    fused = passes.FuseAttention(SAPPHIRE)(from_onnx(workloads.qdq_attention(2, 64,
                                                                             heads=2).model))
    kernel = next(f for gv, f in fused.functions.items() if gv.name_hint == FUSED_ATTENTION)
    assert "amx uint8" in str(kernel.attrs[ATTENTION_ATTR])
    # Q and K in u8, K's sums, V transposed (u8), V's sums, the mask.
    assert _kernel_operands(fused) == ["uint8"] * 2 + ["int32", "uint8", "int32", "float32"]


def test_int8_knobs_take_vnni_else_avx2_s16():
    shape = AttentionShape(1, 12, 384, 384, 64, quant=Quantization(0.1, 1, 0.1, 2, 0.1, 3,
                                                                   1 / 256, 0))
    knobs = choose_knobs(ZNVER5, shape)
    assert knobs.qk.isa == knobs.pv.isa == "avx512_vnni" and knobs.q_block == 64
    assert knobs.qk.fits_registers() and knobs.pv.fits_registers() and 64 % knobs.pv.mr == 0
    # AVX2: no exact u8 x s8 dot product for operands that are not constants (vpmaddubsw
    # saturates): the s16 family, 16 queries (the scores stay in L1), 4 x 16 tiles.
    knobs = choose_knobs(HASWELL, shape)
    assert knobs.qk.isa == knobs.pv.isa == "avx2_s16" and knobs.qk.k_step == 2
    assert (knobs.qk.mr, knobs.qk.nr, knobs.pv.mr, knobs.pv.nr) == (4, 16, 4, 16)
    assert knobs.qk.fits_registers() and knobs.pv.fits_registers()
    # Without AVX2 no int8 family: the attention stays in per-op kernels.
    assert choose_knobs(NEHALEM, shape) is None


@pytest.mark.parametrize("target,register,dot",
                         [(ZNVER5, "zmm", "vpdpbusd"), (ALDERLAKE, "ymm", "vpdpbusd"),
                          (HASWELL, "ymm", "vpmaddwd")],
                         ids=["znver5", "alderlake", "haswell"])
def test_quantized_attention_assembly_runs_on_integer_dots_in_registers(target, register, dot):
    """Both products issue the family's dot product (``vpdpbusd``: AVX512-VNNI on zmm,
    AVX-VNNI on ymm; ``vpmaddwd`` on AVX2); the accumulators stay in registers across the
    reduction (no store right after a dot product)."""
    shape = AttentionShape(1, 2, 64, 100, 64, mask_shape=(1, 1, 1, 100), scale=0.125,
                           quant=Quantization(0.1, 1, 0.1, 2, 0.1, 3, 1 / 256, 0))
    knobs = choose_knobs(target, shape)
    func = quantized_attention_kernel(shape, knobs)
    ex = tvm.compile(tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")}),
                     target=target)
    lines = ex.mod.inspect_source("s").splitlines()
    dots = [i for i, line in enumerate(lines) if re.search(rf"{dot}\s+[^\n]*%{register}", line)]
    # At least one unrolled step of each tile: one dot per row and vector of queries.
    per_step = (knobs.qk.mr + knobs.pv.mr) * knobs.q_block // knobs.qk.lanes
    assert len(dots) >= per_step >= 16, (len(dots), per_step)
    stored = sum(1 for i in dots if "vmovdq" in lines[i + 1]
                 and lines[i].split(",")[-1].strip() in lines[i + 1])
    assert stored <= len(dots) // 4, f"{stored} of {len(dots)} dot products stored at once"
    assert not any("vfmadd" in lines[i] for i in dots)
    if dot == "vpmaddwd":  # the words are s16 pairs: nothing saturates
        assert not any("vpmaddubsw" in line for line in lines)


def _kernel_operands(mod) -> list[str]:
    """The dtypes of the fused kernel's operands in ``mod``'s main."""
    call = next(b.value for b in mod["main"].body.blocks[0].bindings
                if isinstance(b.value, relax.Call) and len(b.value.args) == 2
                and getattr(b.value.args[0], "name_hint", "") == FUSED_ATTENTION)
    return [str(a.ty.dtype) for a in call.args[1].fields]


def test_pass_fuses_ort_qdq_attention_where_an_exact_dot_product_exists():
    """ONNX Runtime's QDQ form (K's transpose between two QDQ pairs, a quantized softmax)
    becomes the preparation and the fused kernel on ``u8`` inputs with VNNI (``K`` read in
    place) and with AVX2 (``K``'s s16 words); without AVX2 the graph is left as it was."""
    wl = workloads.qdq_attention(2, 40, heads=2)
    mod = from_onnx(wl.model)
    fused = passes.FuseAttention(ZNVER5)(mod)
    called = [gv.name_hint for gv, f in fused.functions.items()
              if isinstance(f, tvm.tirx.PrimFunc)]
    assert sorted(n.rstrip("0123456789") for n in called) == [FUSED_ATTENTION, ATTENTION_PREP]
    main = fused["main"].script()
    assert "R.nn.softmax" not in main and "R.matmul" not in main
    assert "R.dequantize" not in main  # the operands stay u8
    kernel = next(f for gv, f in fused.functions.items() if gv.name_hint == FUSED_ATTENTION)
    shape = AttentionShape.from_key(str(kernel.attrs["hybrid.attention_shape"]))
    assert shape.quant is not None and shape.quant.p_scale == 1 / 256
    # Q and K in u8, K's sums, V's words and sums, the mask.
    assert _kernel_operands(fused) == ["uint8"] * 2 + ["int32"] * 3 + ["float32"]
    # AVX2: Q in u8, K and V as the preparation's s16 words (K itself not passed).
    fused = passes.FuseAttention(HASWELL)(mod)
    kernel = next(f for gv, f in fused.functions.items() if gv.name_hint == FUSED_ATTENTION)
    assert "avx2_s16" in str(kernel.attrs[ATTENTION_ATTR])
    assert _kernel_operands(fused) == ["uint8", "int32", "int32", "float32"]
    assert "R.nn.softmax" not in fused["main"].script()
    unfused = passes.FuseAttention(NEHALEM)(mod)
    tvm.ir.assert_structural_equal(unfused, mod)
    # GPT's causal Where joins the kernel as a bool operand after the padding mask.
    causal = from_onnx(workloads.qdq_attention(2, 40, heads=2, causal=True).model)
    fused = passes.FuseAttention(HASWELL)(causal)
    assert _kernel_operands(fused) == ["uint8", "int32", "int32", "float32", "bool"]
    assert "R.where" not in fused["main"].script()


@pytest.mark.parametrize("probs_dtype,causal", [("uint8", False), ("int8", False),
                                               ("uint8", True)])
def test_onnx_qdq_attention_matches_onnxruntime(probs_dtype, causal):
    import onnxruntime as ort

    wl = workloads.qdq_attention(2, 77, heads=4, probs_dtype=probs_dtype, causal=causal)
    compiled = tvm_hybrid.compile(wl.model)
    names = compiled.kernel_names()
    assert any(n.startswith(FUSED_ATTENTION) for n in names), names
    assert not any("softmax" in n or "matmul" in n for n in names), names
    info = compiled.kernels[FUSED_ATTENTION]
    isa = "avx512_vnni" if "avx512vnni" in tvm_hybrid.host.host_features() else "avx2_s16"
    assert info.schedule == "template" and isa in info.detail, info.detail
    # The profile attributes the QDQ subgraph's nodes to the kernel.
    assert {"Softmax", "MatMul", "QuantizeLinear", "DequantizeLinear",
            *(["Where"] if causal else [])} <= {n.split()[0] for n in info.nodes}
    got = np.asarray(compiled(**wl.inputs))
    session = ort.InferenceSession(wl.model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    want = session.run(None, wl.inputs)[0]
    # ONNX Runtime quantizes P its own way: within a few P steps. Against the integer
    # reference (inputs quantized as ONNX does), most rows are bit-exact.
    reference, step = workloads.qdq_attention_reference(wl)
    assert np.abs(got - want).max() <= 3 * step
    assert np.mean(np.all(got == reference, axis=-1)) >= 0.9
    assert np.abs(got - reference).max() <= 3 * step


def test_no_score_matrix_in_the_int8_attention():
    wl = workloads.qdq_attention(1, 384, heads=2)
    compiled = tvm_hybrid.compile(wl.model)
    tir = compiled.inspect_source("tir")
    assert ATTENTION_ATTR in tir
    buffers = [math.prod(int(v) for v in dims.split(",") if v.strip())
               for dims in re.findall(r"T\.alloc_buffer\(\(([\d, ]+)\)", tir)]
    assert buffers and max(buffers) < 384 * 384, buffers
    storage = [int(n) for n in re.findall(r"alloc_storage\(R\.shape\(\[(\d+)\]\)",
                                          compiled.lowered["main"].script())]
    # (u8 probabilities of both heads would take 2 x 384 x 384 bytes.)
    assert storage and max(storage) < 2 * 384 * 384, storage
