"""``Resize`` as the specification has it (``frontend/resize.py``): scales that do not give
whole sizes (TVM interpolated with the ratio of the sizes: wrong everywhere), ``antialias``,
``axes``, ``keep_aspect_ratio_policy``, ``half_pixel_symmetric`` and opset 10, against ONNX
Runtime where it has the form and ONNX's reference implementation otherwise (tolerance 1e-5
of the output scale); whole-number upsampling keeps TVM's resize kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid.frontend.resize import interpolation_matrix


def _model(attrs, shape, scales=None, sizes=None, roi=None, opset=19) -> onnx.ModelProto:
    inits, names = [], ["x"]
    if opset == 10:
        names.append("scales")
        inits.append(helper.make_tensor("scales", TensorProto.FLOAT, [len(scales)], scales))
    else:
        names.append("roi" if roi is not None else "")
        if roi is not None:
            inits.append(helper.make_tensor("roi", TensorProto.FLOAT, [len(roi)], roi))
        names.append("scales" if scales is not None else "")
        if scales is not None:
            inits.append(helper.make_tensor("scales", TensorProto.FLOAT, [len(scales)], scales))
        if sizes is not None:
            names.append("sizes")
            inits.append(helper.make_tensor("sizes", TensorProto.INT64, [len(sizes)], sizes))
    graph = helper.make_graph(
        [helper.make_node("Resize", names, ["y"], **attrs)], "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


#: (attributes, input shape, scales, sizes, roi, opset, whether ONNX Runtime has the form)
CASES = {
    "linear_scale_0.6": ({"mode": "linear"}, (1, 2, 5, 7), [1, 1, 0.6, 0.6], None, None, 13,
                         True),
    "nearest_half_of_odd": ({"mode": "nearest"}, (2, 3, 9, 11), [1, 1, 0.5, 0.5], None, None,
                            13, True),
    "cubic_scale_1.7": ({"mode": "cubic", "coordinate_transformation_mode": "asymmetric"},
                        (1, 2, 6, 5), [1, 1, 1.7, 1.3], None, None, 13, True),
    # The specification defines length_resized = scale * length_original (5.6 here), as the
    # reference computes; ONNX Runtime divides by the whole output length instead.
    "linear_align_corners_0.7": ({"mode": "linear",
                                  "coordinate_transformation_mode": "align_corners"},
                                 (1, 1, 8, 9), [1, 1, 0.7, 0.7], None, None, 13, False),
    "linear_antialias": ({"mode": "linear", "antialias": 1}, (1, 2, 12, 10), [1, 1, 0.4, 0.55],
                         None, None, 18, True),
    "cubic_antialias_sizes": ({"mode": "cubic", "antialias": 1}, (1, 1, 11, 13), None,
                              [1, 1, 5, 4], None, 18, True),
    "axes_nearest": ({"mode": "nearest", "axes": [3, 2]}, (1, 2, 4, 5), [2.5, 1.5], None, None,
                     18, False),
    "not_larger": ({"mode": "linear", "keep_aspect_ratio_policy": "not_larger", "axes": [2, 3]},
                   (1, 2, 6, 9), None, [4, 4], None, 18, False),
    "half_pixel_symmetric": ({"mode": "linear",
                              "coordinate_transformation_mode": "half_pixel_symmetric"},
                             (1, 2, 5, 6), [1, 1, 1.7, 0.8], None, None, 19, False),
    "crop_and_resize_fill": ({"mode": "linear",
                              "coordinate_transformation_mode": "tf_crop_and_resize",
                              "extrapolation_value": 3.0}, (1, 1, 6, 6), None, [1, 1, 4, 5],
                             [0, 0, -0.2, 0.3, 1, 1, 0.8, 1.4], 13, True),
    "opset10_nearest": ({"mode": "nearest"}, (1, 2, 4, 6), [1, 1, 2.5, 1.5], None, None, 10,
                        True),
    "opset10_linear": ({"mode": "linear"}, (1, 2, 4, 6), [1, 1, 1.5, 2.0], None, None, 10,
                       True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resize_matches_the_specification(case, rng):
    attrs, shape, scales, sizes, roi, opset, has_ort = CASES[case]
    model = _model(attrs, shape, scales, sizes, roi, opset)
    feeds = {"x": rng.standard_normal(shape).astype("float32")}
    if has_ort:
        import onnxruntime as ort

        want = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    else:
        from onnx.reference import ReferenceEvaluator

        want = ReferenceEvaluator(model).run(None, feeds)[0]
    got = np.asarray(tvm_hybrid.compile(model)(**feeds))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_whole_number_upsampling_keeps_tvms_resize_kernel(rng):
    model = _model({"mode": "nearest"}, (1, 8, 10, 12), [1, 1, 2, 2], None, None, 13)
    compiled = tvm_hybrid.compile(model)
    assert any("resize2d" in name for name in compiled.kernel_names()), compiled.kernel_names()
    x = rng.standard_normal((1, 8, 10, 12)).astype("float32")
    np.testing.assert_array_equal(compiled(x=x), x.repeat(2, axis=2).repeat(2, axis=3))


def test_interpolation_matrix_rows_sum_to_one():
    """Every output is a weighted mean of inputs (the edge clamped), so the weights sum to 1."""
    for mode in ("nearest", "linear", "cubic"):
        for antialias in ((False, True) if mode != "nearest" else (False,)):
            matrix, outside = interpolation_matrix(13, 5, 0.4, mode, antialias=antialias)
            assert outside is None
            np.testing.assert_allclose(matrix.sum(axis=1), 1.0, atol=1e-12)


def test_hostile_scales_are_refused_by_name():
    """Sizes that would need an enormous interpolation matrix, or leave an axis empty, are
    refused before anything is built."""
    from tvm_hybrid.errors import UnsupportedModelError

    for scales, what in (([1, 1, 0.3, 123456.7], "12345670x100 interpolation matrix"),
                         ([1, 1, 0.01, 0.5], "leaves axis 2 of 10 elements empty")):
        model = _model({"mode": "linear"}, (1, 1, 10 if "empty" in what else 100, 100), scales)
        model.graph.node[0].name = "big"
        with pytest.raises(UnsupportedModelError, match=f"Resize node 'big': .*{what}"):
            tvm_hybrid.compile(model)


@pytest.mark.parametrize("index", [76, 97, 552])
def test_fuzzer_finds_of_tvms_resize_stay_fixed(index):
    """Graphs of the fuzzer's ``resize`` kind (``python -m tvm_hybrid.testing.fuzz --graphs 700
    --seed 7``) on which TVM's converter divided by zero or gave wrong values (sizes of 1,
    ``tf_crop_and_resize``, cubic ``exclude_outside``, 5-D inputs)."""
    from tvm_hybrid.testing.fuzz import make_case

    case = make_case(7, index)
    assert case.kind == "resize"
    got = np.asarray(tvm_hybrid.compile(case.model)(**case.inputs))
    assert case.check(got) is None, case.name
