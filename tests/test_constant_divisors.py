"""``ReciprocalDivisors``: division by a constant as multiplication by its reciprocal."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes import ReciprocalDivisors
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
