"""``DFT`` and ``STFT`` (missing in TVM's importer) as a GEMM with a constant matrix
(``frontend/spectral.py``): against numpy's FFT (float64, tolerance 1e-5 of the output scale)
and, for ``STFT``, ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid.errors import UnsupportedModelError
from tvm_hybrid.frontend.spectral import dft_matrix


def _model(nodes, inputs, inits=(), opset=20) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _scalar(name, value):
    return helper.make_tensor(name, TensorProto.INT64, [], [value])


def _complex(x: np.ndarray) -> np.ndarray:
    return x[..., 0] + 1j * x[..., 1] if x.shape[-1] == 2 else x[..., 0]


def _split(z: np.ndarray) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("components,axis,length,inverse,onesided", [
    (1, 1, None, 0, 0), (1, 1, None, 0, 1), (2, 2, None, 0, 0), (2, 1, 12, 0, 0),
    (1, 1, 7, 0, 1), (2, 1, None, 1, 0), (2, 2, 16, 1, 1), (2, 1, 9, 1, 1)])
def test_dft_matches_numpy(components, axis, length, inverse, onesided, rng):
    shape = (2, 10, 6, components)
    inputs = ["x", "n" if length else "", "axis"]
    inits = [_scalar("axis", axis)] + ([_scalar("n", length)] if length else [])
    model = _model([helper.make_node("DFT", inputs, ["y"], inverse=inverse, onesided=onesided)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))], inits)
    x = rng.standard_normal(shape).astype("float32")
    z = _complex(x.astype("float64"))
    if inverse and onesided:
        n = length or 2 * (shape[axis] - 1)
        want = np.fft.irfft(z, n=n, axis=axis)[..., None]
    elif inverse:
        want = _split(np.fft.ifft(z, n=length, axis=axis))
    else:
        full = np.fft.fft(z, n=length, axis=axis)
        if onesided:
            full = np.take(full, np.arange(full.shape[axis] // 2 + 1), axis=axis)
        want = _split(full)
    compiled = tvm_hybrid.compile(model)
    got = compiled(x=x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert any("matmul" in name for name in compiled.kernel_names())


@pytest.mark.parametrize("window", ["constant", "input", None])
def test_stft_matches_onnxruntime(window, rng):
    """A speech front end's transform: 400-sample frames every 160 samples, 201 bins. Against
    numpy's FFT within 1e-5 of the output scale, and ONNX Runtime within 1e-4 (its float32
    transform is off by 3e-5 of the scale here)."""
    import onnxruntime as ort

    samples, frame = 1600, 400
    hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(frame) / frame)).astype("float32")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, samples, 1])]
    inits = [_scalar("step", 160), _scalar("frame", frame)]
    names = ["x", "step", "w" if window else "", "frame"]
    if window == "constant":
        inits.append(onnx.numpy_helper.from_array(hann, "w"))
    elif window == "input":
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [frame]))
    model = _model([helper.make_node("STFT", names, ["y"], onesided=1)], inputs, inits,
                   opset=17)
    feeds = {"x": rng.standard_normal((2, samples, 1)).astype("float32")}
    if window == "input":
        feeds["w"] = hann
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = tvm_hybrid.compile(model)(**feeds)
    assert got.shape == want.shape == (2, 8, 201, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    frames = np.stack([feeds["x"][:, i * 160:i * 160 + frame, 0] for i in range(8)], 1)
    exact = _split(np.fft.rfft(frames.astype("float64") * (hann if window else 1), axis=-1))
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())


def test_dft_matrix_is_the_transform():
    """The matrix itself: a forward then an inverse transform is the identity."""
    forward = dft_matrix(8, 2, 8, False, False)
    inverse = dft_matrix(8, 2, 8, True, False)
    np.testing.assert_allclose(forward @ inverse, np.eye(16), atol=1e-12)


def test_a_transform_too_large_is_refused_by_name():
    """Refused before the matrix is built (a length of 10**9 would need 16 GiB of it)."""
    model = _model([helper.make_node("DFT", ["x", "", "axis"], ["y"], name="big")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8192, 2])],
                   [_scalar("axis", 1)])
    with pytest.raises(UnsupportedModelError, match="DFT node 'big'.*matrix"):
        tvm_hybrid.compile(model)
    model = _model([helper.make_node("DFT", ["x", "n", "axis"], ["y"], name="long")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 1])],
                   [_scalar("axis", 1), _scalar("n", 10**9)])
    with pytest.raises(UnsupportedModelError, match="DFT node 'long'.*16x2000000000 matrix"):
        tvm_hybrid.compile(model)
