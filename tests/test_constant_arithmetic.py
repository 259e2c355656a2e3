"""Constant arithmetic made cheap: `ReciprocalDivisors` (division by a constant as a product)
and `FoldAffineChains` (chains of constant scales and shifts as one multiply-add)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes import FoldAffineChains, ReciprocalDivisors
from tvm_hybrid.passes.constant_divisors import reciprocal
from tvm_hybrid.testing.relax_modules import relax_function

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
RNG = np.random.default_rng(0)


def _same(after: tvm.IRModule, expected: tvm.IRModule) -> None:
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(after),
                                   relax.transform.Normalize()(expected), map_free_vars=True)


def test_constant_divisors_become_reciprocal_products():
    """Scalar and per-channel constants are replaced; a variable divisor, a zero, an infinity
    and a divisor whose reciprocal is not a normal float32 keep the division."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    y = relax.Var("y", relax.TensorType((4, 8), "float32"))
    channels = RNG.uniform(0.5, 2.0, 8).astype("float32")
    kept = [0.0, np.inf, np.nan, 1e-40, 3e38]

    def before(bb, x, y):
        out = bb.emit(relax.op.divide(x, relax.const(0.1137, "float32")))
        out = bb.emit(relax.op.divide(out, relax.const(channels)))
        out = bb.emit(relax.op.divide(out, y))
        for value in kept:
            out = bb.emit(relax.op.divide(out, relax.const(value, "float32")))
        return out

    def expected(bb, x, y):
        out = bb.emit(relax.op.multiply(x, relax.const(np.float32(1 / np.float64(0.1137)))))
        recip = (1 / channels.astype(np.float64)).astype(np.float32)
        out = bb.emit(relax.op.multiply(out, relax.const(recip)))
        out = bb.emit(relax.op.divide(out, y))
        for value in kept:
            out = bb.emit(relax.op.divide(out, relax.const(value, "float32")))
        return out

    _same(ReciprocalDivisors()(relax_function([x, y], before)),
          relax_function([x, y], expected))


def test_reciprocal():
    np.testing.assert_array_equal(reciprocal(np.array([0.125, -4.0, 6.0], "float32")),
                                  np.array([8.0, -0.25, np.float32(1 / 6)], "float32"))
    for bad in ([1.0, 0.0], [np.inf], [np.nan], [1e-40], [3e38], []):
        assert reciprocal(np.array(bad, "float32")) is None


def test_power_of_two_divisors_stay_exact():
    """``x / 2**k`` and ``x * 2**-k`` are the same correctly rounded number: the compiled
    graph equals numpy's division bit for bit, subnormal results and infinities included."""
    scales = (2.0 ** RNG.integers(-6, 7, 16)).astype("float32")
    x = relax.Var("x", relax.TensorType((64, 16), "float32"))
    mod = relax_function([x], lambda bb, x: relax.op.divide(
        bb.emit(relax.op.divide(x, relax.const(0.25, "float32"))), relax.const(scales)))
    data = (RNG.standard_normal((64, 16)) * 10.0 ** RNG.integers(-38, 38, (64, 16)))
    data = data.astype("float32")
    data[0, :4] = [np.inf, -np.inf, np.nan, 1e-45]
    model = tvm_hybrid.compile(mod, HASWELL)
    with np.errstate(over="ignore"):
        expected = data / np.float32(0.25) / scales
    np.testing.assert_array_equal(model(data), expected)


def _divisions(model) -> int:
    return model.inspect_source("asm").count("vdivps")


@pytest.mark.requires("avx2")
def test_quantized_layers_divide_nowhere():
    """A QDQ MobileNet-style stack (integer 1x1 convolutions, HardSwish, quantization) compiles
    to kernels without a vector division (its quantizations, HardSwish's 6), where the same
    model with the pass disabled has them; the outputs stay within a quantization step of the
    division's on at most 1e-4 of the elements, and both match the integer reference (see
    ``tests/test_qdq_conv.py``)."""
    wl = workloads.qdq_convs((16, 64, 24), (28, 28), activation="HardSwish")
    fast = tvm_hybrid.compile(wl.model, HASWELL)
    with tvm.transform.PassContext(opt_level=3, disabled_pass=["ReciprocalDivisors"]):
        divided = tvm_hybrid.compile(wl.model, HASWELL)
    assert _divisions(fast) == 0
    assert _divisions(divided) > 0
    out, ref = fast(**wl.inputs), divided(**wl.inputs)
    step = float(np.min(np.diff(np.unique(ref))))
    assert np.abs(out - ref).max() <= step * 1.001
    assert np.mean(out != ref) <= 1e-4


# --- FoldAffineChains ------------------------------------------------------------------------


def test_affine_chain_becomes_one_multiply_add():
    """BatchNorm between quantization pairs: ``x * s - mean, * inv_std * gamma + beta, *
    1/s'`` is ``x * a + b`` with ``a`` and ``b`` composed in float64."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    s, mean, inv, gamma, beta, out_scale = (RNG.uniform(0.5, 2.0, 8).astype("float32")
                                            for _ in range(6))

    def before(bb, x):
        y = bb.emit(relax.op.multiply(x, relax.const(s)), name_hint="node3_")
        y = bb.emit(relax.op.subtract(y, relax.const(mean)))
        y = bb.emit(relax.op.multiply(relax.const(inv), y))
        y = bb.emit(relax.op.multiply(y, relax.const(gamma)))
        y = bb.emit(relax.op.add(y, relax.const(beta)))
        return relax.op.multiply(y, relax.const(out_scale))

    f64 = [v.astype(np.float64) for v in (s, mean, inv, gamma, beta, out_scale)]
    a = f64[0] * f64[2] * f64[3] * f64[5]
    b = ((-f64[1]) * f64[2] * f64[3] + f64[4]) * f64[5]

    def expected(bb, x):
        y = bb.emit(relax.op.multiply(x, relax.const(a.astype(np.float32))))
        return relax.op.add(y, relax.const(b.astype(np.float32)))

    after = FoldAffineChains()(relax_function([x], before))
    _same(after, relax_function([x], expected))
    # The multiply keeps the first op's name (Relax may append digits): its ONNX node stays
    # attributed in the profile report (attribution.py reads `node<i>_`).
    assert after["main"].body.blocks[0].bindings[0].var.name.startswith("node3_")


def test_affine_chains_stop_where_a_value_is_shared_or_not_constant():
    """A value read twice (HardSwish's ``x``) ends a chain; so does an operand that is not a
    finite constant; ``c - x`` and shifts compose too (``5 - (v + 1 - 2) + 1 + 1`` is
    ``v * -1 + 8``); two ops that stay two (a shift then a scale) are left as they are."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    y = relax.Var("y", relax.TensorType((4, 8), "float32"))

    def unchanged(bb, x, y):
        shared = bb.emit(relax.op.multiply(bb.emit(relax.op.add(x, relax.const(1.0))),
                                           relax.const(2.0)))
        twice = bb.emit(relax.op.multiply(shared, bb.emit(relax.op.add(shared,
                                                                        relax.const(3.0)))))
        inf = bb.emit(relax.op.add(bb.emit(relax.op.multiply(twice, relax.const(np.inf))),
                                   relax.const(1.0)))
        return bb.emit(relax.op.multiply(inf, y))

    def before(bb, x, y):
        kept = bb.emit(relax.op.add(unchanged(bb, x, y), relax.const(1.0)))
        shifted = bb.emit(relax.op.subtract(relax.const(5.0), bb.emit(
            relax.op.subtract(kept, relax.const(2.0)))))
        return relax.op.add(bb.emit(relax.op.add(shifted, relax.const(1.0))), relax.const(1.0))

    def expected(bb, x, y):
        scaled = bb.emit(relax.op.multiply(unchanged(bb, x, y), relax.const(-1.0)))
        return relax.op.add(scaled, relax.const(8.0))

    _same(FoldAffineChains()(relax_function([x, y], before)),
          relax_function([x, y], expected))


def test_affine_chains_compile_within_float_rounding():
    """Compiled, a folded per-channel chain with broadcasting stays within a few ulps of
    float64."""
    x = relax.Var("x", relax.TensorType((2, 16, 8), "float32"))
    c = [RNG.uniform(0.5, 2.0, shape).astype("float32") for shape in ((8,), (16, 1), (8,))]

    def chain(bb, x):
        y = bb.emit(relax.op.multiply(x, relax.const(c[0])))
        y = bb.emit(relax.op.subtract(y, relax.const(c[1])))
        y = bb.emit(relax.op.divide(y, relax.const(c[2])))
        return relax.op.nn.relu(bb.emit(relax.op.add(y, relax.const(0.5))))

    data = RNG.standard_normal((2, 16, 8)).astype("float32")
    model = tvm_hybrid.compile(relax_function([x], chain), HASWELL)
    ref = np.maximum((data.astype(np.float64) * c[0] - c[1]) / c[2] + 0.5, 0)
    np.testing.assert_allclose(model(data), ref, rtol=1e-6, atol=1e-6)
