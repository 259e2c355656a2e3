"""Grouped convolutions on one direct-template kernel (``conv_computes.grouped_direct_conv``)
and ShuffleNet's channel shuffle in NHWC (``conv_layout.ChannelShuffleNHWC``): ONNX Runtime's
results (relative 1e-4 of the output's scale), one engine kernel for all groups with the
BatchNorm folded into its weights and the bias, activation and residual add in its kernel."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_hybrid.passes.conv_gemm import grouped_panel
from tvm_hybrid.passes.conv_layout import ChannelShuffleNHWC
from tvm_hybrid.passes.relax_rewrite import rewrite_functions
from tvm_hybrid.testing.onnx_checks import compiles_and_matches, main_calls

ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
ZNVER4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}


def _model(c=136, o=136, groups=4, k=1, size=28, pads=0, dilation=1, strides=1,
           residual=False, shuffle=False):
    """``Conv(group) -> BatchNormalization -> [Add(x)] -> Relu [-> channel shuffle]``."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(
        (rng.standard_normal((o, c // groups, k, k)) * 0.2).astype(np.float32), "W")]
    for name, value in (("s", rng.random(o) + 0.5), ("b", rng.standard_normal(o)),
                        ("m", rng.standard_normal(o)), ("v", rng.random(o) + 0.5)):
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], group=groups, kernel_shape=[k, k],
                              pads=[pads] * 4, dilations=[dilation] * 2, strides=[strides] * 2),
             helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"])]
    last = "n"
    if residual:
        nodes.append(helper.make_node("Add", ["n", "x"], ["a"]))
        last = "a"
    nodes.append(helper.make_node("Relu", [last], ["r"]))
    last = "r"
    if shuffle:
        inits += [numpy_helper.from_array(np.array([1, groups, o // groups, -1, size], np.int64),
                                          "split"),
                  numpy_helper.from_array(np.array([1, o, size, size], np.int64), "merge")]
        nodes += [helper.make_node("Reshape", ["r", "split"], ["g"]),
                  helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1, 3, 4]),
                  helper.make_node("Reshape", ["t", "merge"], ["y"])]
        last = "y"
    graph = helper.make_graph(
        nodes, "grouped", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                         [1, c, size, size])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((1, c, size, size)).astype(np.float32)
    return model, x


def _matches_onnxruntime(model, x, target=None):
    return compiles_and_matches(model, {"x": x}, target=target)


CASES = [dict(), dict(k=3, pads=1, c=64, o=96, groups=2, size=16),
         dict(k=3, pads=2, dilation=2, c=64, o=64, groups=4, size=16),
         dict(residual=True),
         # 14-pixel rows, which no AVX2 tile divides: a 1x1 convolution's 196 pixels as one
         # row (its [N, 1, 196, G, Og] output's reshape still moves past the BatchNorm).
         dict(size=14, residual=True),
         # 49 pixels of 7x7: one row padded to a whole number of tiles (AVX2: 50, 5-row tiles).
         dict(size=7, c=272, o=272)]


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "haswell"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
                         or "1x1")
def test_grouped_conv_is_one_template_kernel_for_all_groups(case, target):
    """ShuffleNet's 4-group 1x1 (34 channels a group: padded panels; at 28x28, and at 14x14
    and 7x7, whose pixels form one row, padded to whole tiles), 3x3 and dilated grouped
    convolutions: one direct-template kernel, its detail naming the groups; no slice or
    concatenation kernel; the BatchNorm folded (no subtract or divide left), the bias, ReLU
    and residual add in the convolution's kernel."""
    model, x = _model(**case)
    compiled = _matches_onnxruntime(model, x, target)
    engine = [n for n in main_calls(compiled) if "direct_conv" in n or "packed_matmul" in n]
    assert len(engine) == 1, main_calls(compiled)
    info = compiled.kernels[engine[0]]
    assert info.schedule == "template", info.detail
    assert f"{case.get('groups', 4)} groups" in info.detail
    assert "relax_add_relax_add_relax_nn_relu" in engine[0] or not case.get("residual")
    assert "relu" in engine[0]
    names = compiled.kernel_names()
    assert not [n for n in names if re.search("strided_slice|concatenate|subtract|divide|conv2d",
                                              n)], names


def test_grouped_conv_keeps_a_conv_per_group_where_one_kernel_would_not_pay():
    """Stride 2, or too few channels a group for the panels (8 a group on AVX-512's 32-wide
    panels would compute four times the work; AVX2's 16-wide ones take them): a dense
    convolution per group, as before."""
    haswell, znver4 = tvm.target.Target(HASWELL), tvm.target.Target(ZNVER4)
    assert grouped_panel(haswell, 28, 34, (1, 1)) in (16, 24)
    assert grouped_panel(znver4, 28, 34, (1, 1)) == 32
    assert grouped_panel(haswell, 28, 8, (1, 1)) == 16
    assert grouped_panel(znver4, 28, 8, (1, 1)) is None
    assert grouped_panel(znver4, 28, 34, (2, 2)) is None
    assert grouped_panel(znver4, 29, 34, (1, 1)) is None  # no tile divides a 29-pixel row
    assert grouped_panel(haswell, 14, 34, (1, 1)) is None  # nor AVX2's a 14-pixel one
    model, x = _model(k=3, pads=1, strides=2, c=32, o=64, groups=2, size=14)
    compiled = _matches_onnxruntime(model, x)
    engine = [n for n in main_calls(compiled) if "direct_conv" in n or "packed_matmul" in n]
    assert len(engine) == 2, main_calls(compiled)


@pytest.mark.requires("avx2")
def test_channel_shuffle_after_a_grouped_conv_matches():
    """conv(4 groups) -> BN -> ReLU -> shuffle: the shuffle is one transpose of the last two
    axes of the convolution's [N, H, W, G, Og] output (no reshape arithmetic on the flattened
    index: no division by H * W)."""
    model, x = _model(shuffle=True)
    compiled = _matches_onnxruntime(model, x)
    assert len([n for n in main_calls(compiled) if "direct_conv" in n]) == 1
    shuffles = [f.script() for g, f in compiled.lowered.functions.items()
                if isinstance(f, tvm.tirx.PrimFunc) and "transpose" in g.name_hint]
    assert shuffles
    # 28 * 28: a flattened-index division (a parallel loop over 784 pixels is no division)
    assert not [s for s in shuffles if re.search(r"(//|%) (T\.int64\()?784\b", s)]


def test_channel_shuffle_pass_structure():
    """Before: the five ops ``ConvertLayout`` leaves (to NCHW, split, swap, merge, to NHWC);
    after: reshape to [N, H, W, G, C/G], swap the last two axes, reshape back."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 5, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2]))
            t = bb.emit(relax.op.reshape(t, (1, 3, 4, 6, 5)))
            t = bb.emit(relax.op.permute_dims(t, [0, 2, 1, 3, 4]))
            t = bb.emit(relax.op.reshape(t, (1, 12, 6, 5)))
            out = bb.emit_output(relax.op.permute_dims(t, [0, 2, 3, 1]))
        bb.emit_func_output(out)
    before = bb.get()
    after = rewrite_functions(before, ChannelShuffleNHWC(before), eliminate_dead_code=True)
    ops = []
    relax.analysis.post_order_visit(after["main"], lambda e: ops.append(e) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert [c.op.name for c in ops] == ["relax.reshape", "relax.permute_dims", "relax.reshape"]
    assert [int(a) for a in ops[1].attrs.axes] == [0, 1, 2, 4, 3]
    assert [int(d) for d in ops[0].ty.shape.values] == [1, 6, 5, 3, 4]
    xv = np.random.default_rng(0).standard_normal((1, 6, 5, 12)).astype(np.float32)
    results = []
    for mod in (before, after):
        exe = tvm.compile(mod, "llvm")
        vm = relax.VirtualMachine(exe, tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(xv)).numpy())
    np.testing.assert_array_equal(results[0], results[1])
    # Any other permutation chain is left alone.
    other = rewrite_functions(after, ChannelShuffleNHWC(after), eliminate_dead_code=True)
    tvm.ir.assert_structural_equal(other, after)


def _single(nodes, inits, shape):
    graph = helper.make_graph(nodes, "fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model, np.random.default_rng(2).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op,shape", [("Mul", (64, 1)), ("Sub", (64, 1)), ("Add", (64, 1))])
def test_constants_along_rows_do_not_fold_as_channels(op, shape):
    """A square GEMM's per-row constant ``[M, 1]`` (as many rows as channels) is not a
    channel constant, nor a grouped convolution's ``[G, Og]``: it stays an elementwise op."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)
    c = (rng.random(shape) + 0.5).astype(np.float32)
    model, x = _single([helper.make_node("MatMul", ["x", "W"], ["m"]),
                        helper.make_node(op, ["m", "c"], ["y"])],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(c, "c")], [64, 64])
    _matches_onnxruntime(model, x)


def test_a_scale_along_the_width_of_a_conv_does_not_fold_as_channels():
    """NCHW ``Conv(16 channels) * c[16]`` on a 16-pixel-wide image scales the width."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32)
    c = (rng.random(16) + 0.5).astype(np.float32)
    model, x = _single([helper.make_node("Conv", ["x", "W"], ["m"], pads=[1] * 4),
                        helper.make_node("Mul", ["m", "c"], ["y"])],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(c, "c")],
                       [1, 8, 16, 16])
    _matches_onnxruntime(model, x)
