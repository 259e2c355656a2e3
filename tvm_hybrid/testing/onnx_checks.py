"""Checks the model tests share: a compiled ONNX model against ONNX Runtime (or a given
reference), and the kernels its ``main`` calls."""

from __future__ import annotations

import re

import numpy as np


def compiles_and_matches(model, feeds: dict, *, target=None, rtol: float = 1e-4,
                         expected: np.ndarray | None = None):
    """Compile ``model`` (for ``target``, else the host) and check its first output on
    ``feeds`` against ``expected`` (ONNX Runtime's when None) within ``rtol`` relative and
    ``rtol`` of the output's scale; return the compiled model."""
    import tvm_hybrid

    compiled = tvm_hybrid.compile(model, target)
    if expected is None:
        import onnxruntime as ort

        expected = ort.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = np.asarray(compiled(**feeds))
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * np.abs(expected).max())
    return compiled


def main_calls(compiled) -> list[str]:
    """The functions ``main`` of a compiled model calls, once per call, in order."""
    return re.findall(r"^\s*(\w+)\(", compiled.lowered["main"].script(), re.MULTILINE)
