"""``ConvToGemm``: dense convolutions run as im2col + the GEMM template, with ONNX Runtime's
results (relative 1e-4), for kernel sizes, strides, asymmetric padding, dilation and bias;
grouped convolutions as a dense one per group, depthwise convolutions on their own kernel."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid.testing.onnx_checks import compiles_and_matches

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}

ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")


def _conv_model(c=8, o=16, k=3, size=(13, 11), group=1, relu=True, batch=2, **attrs):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((o, c // group, k, k)) * 0.2).astype("float32")
    b = rng.standard_normal(o).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], group=group, **attrs)]
    nodes.append(helper.make_node("Relu" if relu else "Identity", ["c"], ["y"]))
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, *size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((batch, c, *size)).astype("float32")
    return model, x


def _onnxruntime(model, x):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _compiles_and_matches(model, x):
    """Compile ``model``; its output on ``x`` matches ONNX Runtime's (relative 1e-4)."""
    compiled = tvm_hybrid.compile(model)
    expected = _onnxruntime(model, x)
    got = np.asarray(compiled(x=x))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    return compiled


CASES = [
    dict(k=1), dict(k=3, pads=[1, 1, 1, 1]), dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(k=5, pads=[2, 1, 0, 2]), dict(k=3, dilations=[2, 2], pads=[2, 2, 2, 2]),
    dict(k=1, strides=[2, 2]), dict(k=3, relu=False, c=3, o=5),
    dict(k=3, auto_pad="SAME_UPPER"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dense_conv_runs_on_the_gemm_template_and_matches(case):
    model, x = _conv_model(**case)
    compiled = _compiles_and_matches(model, x)
    gemms = {k.schedule for k in compiled.kernels.values() if _on_the_engine(k.name)}
    assert gemms == {"template"}
    assert not [n for n in compiled.kernel_names() if "conv2d" in n]


def _on_the_engine(name: str) -> bool:
    return "packed_matmul" in name or "direct_conv" in name


# (A 1x1 convolution of 11x11 pixels with 8 channels a group would be one kernel on AVX2:
# its 121 pixels as one row, padded to 124: ``tests/test_grouped_conv.py``.)
GROUPED = [dict(group=2, k=3, pads=[1, 1, 1, 1]),
           dict(group=4, k=3, pads=[1, 1, 1, 1], c=16, o=32),
           dict(group=2, k=5, pads=[2, 2, 2, 2], c=16, o=12),
           dict(group=2, k=3, strides=[2, 2], pads=[1, 1, 1, 1]),
           dict(group=4, k=1, c=16, o=20, relu=False)]


@pytest.mark.parametrize("case", GROUPED, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grouped_conv_runs_a_dense_conv_per_group_on_the_engine(case):
    """AlexNet's two-group and ShuffleNet's four-group convolutions of few channels a group
    or rows no tile divides: one engine kernel per group on its channels (1x1 GEMM, direct
    or im2col), concatenated; no conv2d left. (Where ``grouped_panel`` allows, one kernel for
    all groups: ``tests/test_grouped_conv.py``.)"""
    from tvm_hybrid.host import host_target
    from tvm_hybrid.passes.conv_gemm import grouped_panel

    model, x = _conv_model(**case)
    compiled = _compiles_and_matches(model, x)
    engine = [k for k in compiled.kernels.values() if _on_the_engine(k.name)]
    assert engine and {k.schedule for k in engine} == {"template"}
    stride = case.get("strides", [1, 1])[0]
    one = grouped_panel(host_target(), 11 // stride, case.get("o", 16) // case["group"],
                        (stride, stride))
    assert one is None  # these shapes keep a convolution per group on every CPU
    assert len(_engine_calls(compiled)) == case["group"]
    assert not [n for n in compiled.kernel_names() if "conv2d" in n]


def _engine_calls(compiled) -> list[str]:
    """The engine kernels ``main`` calls, once per call (groups of one shape share a kernel)."""
    calls = re.findall(r"^\s*(\w+)\(", compiled.lowered["main"].script(), re.MULTILINE)
    return [name for name in calls if _on_the_engine(name)]


def test_conv_with_many_small_groups_keeps_tvms_lowering_and_matches():
    # 32 groups of 2 channels: a GEMM per group would be all overhead.
    model, x = _conv_model(group=32, c=64, o=64, k=3, pads=[1, 1, 1, 1])
    compiled = _compiles_and_matches(model, x)
    assert [n for n in compiled.kernel_names() if "conv2d" in n]
    assert not [n for n in compiled.kernel_names() if _on_the_engine(n)]


def test_grouped_and_depthwise_convs_in_nchw_run_on_the_engine(monkeypatch):
    """Where ``ConvertLayout`` fails (TVM's layout rule for ``stack`` did, before
    ``LayoutFriendly`` wrote it as a concatenation; here the pass is made to fail), each
    convolution changes layout on its own, grouped and depthwise ones too."""
    from tvm import relax

    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((16, 4, 1, 1)) * 0.3).astype("float32")  # 4 groups
    w2 = (rng.standard_normal((16, 1, 3, 3)) * 0.3).astype("float32")  # depthwise
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 9, 10), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w1), groups=4))
            s = bb.emit(relax.op.sum(bb.emit(relax.op.stack([y, y], axis=0)), axis=[0]))
            z = bb.emit(relax.op.nn.conv2d(s, relax.const(w2), padding=[1, 1], groups=16))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    mod = bb.get()
    with pytest.raises(Exception):  # noqa: B017 - TVM raises its C++ check failure
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod)

    def failing(_layouts):
        def fail(_mod):
            raise RuntimeError("Check failed: a layout rule this model has no answer to")
        return fail

    monkeypatch.setattr(relax.transform, "ConvertLayout", failing)
    compiled = tvm_hybrid.compile(mod)
    names = compiled.kernel_names()
    assert not [n for n in names if "conv2d" in n]
    assert len(_engine_calls(compiled)) == 4
    assert [n for n in names if "depthwise" in n]
    xv = rng.standard_normal((1, 16, 9, 10)).astype("float32")
    expected = _numpy_conv(_numpy_conv(xv, w1, 4, 0) * 2, w2, 16, 1)
    np.testing.assert_allclose(np.asarray(compiled(xv)), expected, rtol=1e-4, atol=1e-4)


def _numpy_conv(x: np.ndarray, w: np.ndarray, groups: int, pad: int) -> np.ndarray:
    """A direct NCHW convolution (stride 1) in float64, the reference for Relax-built modules."""
    x = np.pad(x.astype("float64"), [(0, 0), (0, 0), (pad, pad), (pad, pad)])
    n, c, h, wd = x.shape
    o, per, kh, kw = w.shape
    oh, ow = h - kh + 1, wd - kw + 1
    out = np.zeros((n, o, oh, ow))
    outs = o // groups
    for g in range(groups):
        xs = x[:, g * per:(g + 1) * per]
        for ky in range(kh):
            for kx in range(kw):
                patch = xs[:, :, ky:ky + oh, kx:kx + ow]
                out[:, g * outs:(g + 1) * outs] += np.einsum(
                    "nchw,oc->nohw", patch, w[g * outs:(g + 1) * outs, :, ky, kx])
    return out.astype("float32")


@pytest.mark.parametrize("case", [dict(k=3, pads=[1, 1, 1, 1]),
                                  dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1]),
                                  dict(k=5, pads=[2, 1, 0, 2]), dict(k=3, dilations=[2, 2]),
                                  dict(k=1)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_depthwise_conv_runs_its_unrolled_kernel_and_matches(case):
    model, x = _conv_model(group=8, c=8, o=8, **case)
    compiled = _compiles_and_matches(model, x)
    names = compiled.kernel_names()
    assert [n for n in names if "depthwise" in n] and not [n for n in names if "conv2d" in n]


TRANSPOSED = [
    dict(k=2, strides=[2, 2]), dict(k=2, strides=[2, 2], output_padding=[1, 1]),
    dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
    dict(k=4, strides=[2, 2], pads=[1, 1, 1, 1]), dict(k=3, dilations=[2, 2]),
    dict(k=3, strides=[1, 1], pads=[1, 1, 1, 1]),
]


@pytest.mark.parametrize("case", TRANSPOSED,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_transposed_conv_runs_as_gemm_and_col2im(case):
    rng = np.random.default_rng(1)
    k = case.pop("k")
    w = (rng.standard_normal((8, 6, k, k)) * 0.2).astype("float32")  # [C, O, KH, KW]
    b = rng.standard_normal(6).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], **case)], "deconv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 7, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((2, 8, 7, 9)).astype("float32")
    compiled = _compiles_and_matches(model, x)
    names = compiled.kernel_names()
    assert [n for n in names if "col2im" in n] and not [n for n in names if "transpose" in n
                                                       and "conv2d" in n]


@pytest.mark.parametrize("case", [dict(k=3, pads=[1, 1]), dict(k=5, strides=[2], pads=[2, 1]),
                                  dict(k=3, dilations=[2]), dict(k=3, group=8, pads=[1, 1])],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_conv1d_runs_as_a_height_one_conv2d_and_matches(case):
    """Audio models (silero VAD) are 1-D convolutions: the GEMM (or depthwise) kernel too."""
    rng = np.random.default_rng(2)
    k, group = case.pop("k"), case.get("group", 1)
    w = (rng.standard_normal((8, 8 // group, k)) * 0.2).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], **case)], "conv1d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((2, 8, 40)).astype("float32")
    compiled = _compiles_and_matches(model, x)
    assert not [n for n in compiled.kernel_names() if "conv1d" in n or "conv2d" in n]


@pytest.mark.parametrize("case", [dict(k=3, pads=[1, 1, 1, 1], size=(12, 12), c=16, o=24),
                                  dict(k=3, dilations=[2, 2], size=(14, 16), c=16, o=40),
                                  dict(k=5, pads=[2, 2, 2, 2], size=(9, 8), c=8, o=32)],
                         ids=["3x3", "dilated", "5x5"])
def test_stride_one_conv_runs_direct_without_im2col(case):
    model, x = _conv_model(**case)
    compiled = _compiles_and_matches(model, x)
    (conv,) = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert conv.schedule == "template" and "direct convolution" in conv.detail
    assert not [n for n in compiled.kernel_names() if "im2col" in n]


STRIDED = [dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1], size=(13, 24), c=16, o=32),
           dict(k=5, strides=[2, 2], pads=[2, 1, 1, 2], size=(11, 24), c=8, o=24),
           dict(k=3, strides=[2, 2], dilations=[2, 2], pads=[2, 2, 2, 2], size=(10, 24), c=16,
                o=16),
           dict(k=3, strides=[3, 3], pads=[1, 1, 1, 1], size=(9, 34), c=8, o=16),
           dict(k=3, strides=[1, 2], pads=[0, 1, 2, 0], size=(7, 24), c=16, o=16),
           dict(k=3, strides=[2, 1], pads=[1, 1, 1, 1], size=(9, 12), c=16, o=16)]


@pytest.mark.parametrize("case", STRIDED, ids=["3x3s2", "5x5s2-asym", "dilated-s2", "3x3s3",
                                               "column-s2", "row-s2"])
def test_strided_conv_runs_direct_on_its_phase_split_input(case):
    """A strided convolution runs on the direct template, no im2col: a column stride reads the
    padded input dealt into phases (``hybrid_phase_split``), a row stride alone the padded
    input. Matches ONNX Runtime (12 output pixels a row: a tile of 4, 6 or 12 rows divides)."""
    model, x = _conv_model(**case)
    compiled = _compiles_and_matches(model, x)
    (conv,) = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert conv.schedule == "template" and "direct convolution" in conv.detail
    names = compiled.kernel_names()
    assert not [n for n in names if "im2col" in n], names
    assert bool([n for n in names if "phase_split" in n]) == (case["strides"][1] > 1), names


@pytest.mark.requires("avx2", "fma")
def test_strided_direct_conv_on_avx2_matches():
    # The AVX2 tiles (Zen 3's code) on the phase-split input; 12 output pixels a row.
    model, x = _conv_model(**STRIDED[0])
    compiled = compiles_and_matches(model, {"x": x}, target=HASWELL)
    (conv,) = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert conv.schedule == "template" and "avx2" in conv.detail, conv.detail


@pytest.mark.parametrize("channels,size,direct", [(3, (640, 640), True), (1, (640, 640), False),
                                                   (3, (48, 96), False)],
                         ids=["rgb-large", "one-channel", "rgb-small"])
def test_rgb_stem_runs_direct_where_its_im2col_would_leave_the_l2(channels, size, direct):
    """A 3-channel 3x3 stem (stride 2, 16 outputs) runs on the direct template, 3 channels a
    tap on a one-vector tile, where its im2col buffer (320 x 320 x 27 fp32, 11 MB) would not
    stay in a core's L2; on a small image, or with one channel, it keeps im2col. Each matches
    ONNX Runtime."""
    model, x = _conv_model(k=3, strides=[2, 2], pads=[1, 1, 1, 1], size=size, c=channels, o=16,
                           batch=1)
    compiled = _compiles_and_matches(model, x)
    names = compiled.kernel_names()
    convs = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert bool(convs) == direct and bool([n for n in names if "im2col" in n]) != direct, names
    if direct:
        (conv,) = convs
        lanes = 16 if "avx512" in conv.detail else 8
        assert conv.schedule == "template" and f"taps of K={channels}" in conv.detail
        assert re.search(rf"\dx{max(16, lanes)} microkernel", conv.detail), conv.detail


def test_convs_whose_gemm_reads_the_weights_once_run_on_im2col(monkeypatch):
    """ResNet's last stage (512 channels of 3x3 taps on 7 x 7 pixels, 9.4 MB of weights)
    runs on im2col and a GEMM of one block of all 49 rows (rule 3's) where its im2col stays
    in the L2 (a 2 MiB L2 here, whatever the host's); 14 x 14 pixels (3.6 MB of im2col) and
    small weights stay direct. Each against ONNX Runtime."""
    from tvm_hybrid.host import CacheSizes
    from tvm_hybrid.passes import conv_gemm

    caches = CacheSizes(l1d=48 * 1024, l2=2 * 1024 * 1024, l3=32 * 1024 * 1024)
    monkeypatch.setattr(conv_gemm, "cache_sizes", lambda: caches)
    target = tvm_hybrid.host.make_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    assert conv_gemm._gemm_reads_weights_once(target, 49, 512, 9 * 512)
    assert not conv_gemm._gemm_reads_weights_once(target, 196, 512, 9 * 512)  # im2col over the L2
    assert not conv_gemm._gemm_reads_weights_once(target, 49, 128, 9 * 128)  # weights of one L2
    model, x = _conv_model(c=512, o=512, k=3, pads=[1, 1, 1, 1], size=(7, 7), batch=1)
    names = _compiles_and_matches(model, x).kernel_names()
    assert any("im2col" in n for n in names) and not any("direct_conv" in n for n in names), \
        names


def test_narrow_conv_panels_only_for_dense_convolutions_of_few_channels():
    from tvm_hybrid.microkernels import microkernels_for
    from tvm_hybrid.schedules.conv_template import conv_panel

    target = tvm_hybrid.host.make_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    kernels = microkernels_for(target, "float32")
    assert conv_panel(kernels, 160, 16, narrow=True) == 16  # one AVX-512 vector
    assert conv_panel(kernels, 160, 16) == 32  # a grouped convolution's rule: two vectors
    assert conv_panel(kernels, 160, 64, narrow=True) >= 32


def test_direct_conv_is_declined_where_no_microkernel_tiles_the_rows():
    # 17 pixels per row: no fp32 microkernel with at least 4 rows divides it, so im2col.
    model, x = _conv_model(k=3, pads=[1, 1, 1, 1], size=(6, 17), c=16, o=16)
    compiled = _compiles_and_matches(model, x)
    assert not [n for n in compiled.kernel_names() if "direct_conv" in n]
    assert [n for n in compiled.kernel_names() if "im2col" in n]


@pytest.mark.requires("avx2", "fma")
def test_im2col_writes_padded_rows_where_a_better_tile_needs_them():
    # 13 x 13 = 169 output pixels (a stride-2 conv, so im2col): on AVX2 only a one-vector
    # 13x8 tile divides 169; the im2col writes 3 zero rows more for a 4-row tile, and the
    # GEMM slices their results off.
    model, x = _conv_model(k=3, strides=[2, 2], pads=[1, 1, 1, 1], size=(25, 25), c=16, o=48,
                           batch=1)
    compiled = compiles_and_matches(model, {"x": x}, target=HASWELL)
    (gemm,) = [k for k in compiled.kernels.values() if "packed_matmul" in k.name]
    mr = int(re.search(r"(\d+)x\d+ microkernel", gemm.detail).group(1))
    assert gemm.schedule == "template" and mr != 13 and 172 % mr == 0, gemm.detail
    main = compiled.lowered["main"].script()
    (cols,) = re.findall(r"(\w+): R\.Tensor\(\(172, 144\)", main)
    assert re.search(rf"hybrid_im2col\w*\(\w+, {cols}\)", main), main
    assert not [n for n in compiled.kernel_names() if n == "pad" or n.endswith("_pad")]


@pytest.mark.parametrize("mcpu,register", [("haswell", "ymm"), ("znver5", "zmm")])
def test_direct_conv_assembly_uses_the_isa_fma(mcpu, register):
    model, _ = _conv_model(k=3, pads=[1, 1, 1, 1], size=(12, 12), c=16, o=32)
    compiled = tvm_hybrid.compile(model, target={"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    (conv,) = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert conv.schedule == "template"
    assert re.search(rf"vfmadd\d+ps\s+[^\n]*%{register}", compiled.inspect_source("asm"))


def test_dropout_between_convs_keeps_one_layout_change_at_each_end():
    """SqueezeNet's and Inception's inference ``Dropout`` (a tuple in Relax, on which TVM's
    layout rules fail for the whole model) is read as its input: ``ConvertLayout`` carries
    NHWC through the chain, so a transpose stands only at its two ends, none between the
    convolutions."""
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    from tvm_hybrid.passes.conv_layout import LayoutFriendly
    from tvm_hybrid.passes.relax_rewrite import rewrite_functions

    rng = np.random.default_rng(4)
    weights = [onnx.numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype("float32"), n)
               for n, s in (("W1", (16, 8, 3, 3)), ("W2", (16, 16, 1, 1)))]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Dropout", ["r1"], ["d1"]),
             helper.make_node("Conv", ["d1", "W2"], ["c2"]),
             helper.make_node("Relu", ["c2"], ["y"])]
    graph = helper.make_graph(
        nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    layouts = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})
    mod = from_onnx(model, keep_params_in_input=False)
    with pytest.raises(Exception):  # noqa: B017 - TVM raises its C++ check failure
        layouts(mod)
    friendly = relax.transform.CanonicalizeBindings()(
        rewrite_functions(mod, LayoutFriendly(mod), eliminate_dead_code=True))
    assert "dropout" not in friendly["main"].script()
    converted = layouts(friendly)["main"].script()
    # The input's and the output's (the weights' fold into constants).
    assert len(re.findall(r"R\.permute_dims\((?!metadata)", converted)) == 2
    x = rng.standard_normal((1, 8, 9, 10)).astype("float32")
    compiled = _compiles_and_matches(model, x)
    assert len(_engine_calls(compiled)) == 2
    assert len([n for n in compiled.kernel_names() if "transpose" in n]) <= 2


def test_stack_after_convs_is_a_concatenation_layouts_carry():
    """``stack`` (an LSTM's outputs after a CNN: captcha OCR) has a layout rule that fails for
    the whole model; ``LayoutFriendly`` writes it as ``concat`` of ``expand_dims``, which
    ``ConvertLayout`` carries, with the same values."""
    from tvm import relax

    from tvm_hybrid.passes.conv_layout import LayoutFriendly
    from tvm_hybrid.passes.relax_rewrite import rewrite_functions

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.2).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 6, 7), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=[1, 1]))
            z = bb.emit(relax.op.nn.conv2d(y, relax.const(w), padding=[1, 1]))
            out = bb.emit_output(relax.op.stack([y, z, y], axis=2))
        bb.emit_func_output(out)
    mod = bb.get()
    layouts = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})
    with pytest.raises(Exception):  # noqa: B017 - TVM raises its C++ check failure
        layouts(mod)
    friendly = rewrite_functions(mod, LayoutFriendly(mod))
    script = friendly["main"].script()
    assert "R.stack" not in script and "R.concat" in script
    converted = layouts(friendly)["main"].script()
    # The input's change and the output's (the concatenation is carried in NHWC too).
    assert len(re.findall(r"R\.permute_dims\((?!metadata)", converted)) == 2
    xv = rng.standard_normal((1, 16, 6, 7)).astype("float32")
    yv = _numpy_conv(xv, w, 1, 1)
    expected = np.stack([yv, _numpy_conv(yv, w, 1, 1), yv], axis=2)
    np.testing.assert_allclose(np.asarray(tvm_hybrid.compile(mod)(xv)), expected, rtol=1e-4,
                               atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("case", [dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1]),
                                  dict(k=3, strides=[1, 2], pads=[0, 1, 2, 0])])
def test_bf16_conv_through_im2col(case):
    """precision="bf16": the cast of the im2col's rows to bf16 fuses into the hand-written
    im2col. Its buffers had int32 extents against Relax's int64 and FuseTIR refused the fused
    kernel ("Inconsistent buffers cols and lv"), so such a model did not compile. Compiled for
    a named AVX512-BF16 CPU (any host), numerics where the host has the instruction."""
    model, x = _conv_model(c=16, o=32, **case)
    target = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}
    compiled = tvm_hybrid.compile(model, target, precision="bf16")
    assert any("im2col" in k and "cast" in k for k in compiled.kernel_names()), \
        compiled.kernel_names()
    assert "vdpbf16ps" in compiled.inspect_source("asm")
    if "avx512bf16" in tvm_hybrid.host.host_features():
        want = _onnxruntime(model, x)
        assert np.abs(compiled(x=x) - want).max() <= 2e-2 * np.abs(want).max()
