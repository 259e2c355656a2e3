"""The depthwise convolution template (``schedules/depthwise_template.py``): its structure
before and after, numerics against a float64 reference (relative 1e-4 of the output's scale)
for the shapes and epilogues it takes and declines, its knobs as the tuner sees them, and the
ISA's FMAs in its assembly."""

from __future__ import annotations

import dataclasses
import random
import re

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import tirx
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

import tvm_hybrid
from tvm_hybrid.frontend.importer import import_model
from tvm_hybrid.host import make_target
from tvm_hybrid.pipeline import prepare_passes
from tvm_hybrid.schedules import ParallelVectorize, apply_template
from tvm_hybrid.schedules.depthwise_template import (
    DepthwiseKnobs,
    DepthwiseShape,
    DepthwiseTemplate,
    channel_lanes,
    default_x_block,
    depthwise_knobs,
)
from tvm_hybrid.schedules.gemm.template import TEMPLATE_ANNOTATION
from tvm_hybrid.testing.onnx_checks import compiles_and_matches, main_calls

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
ZNVER4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}


def _model(c=32, size=(10, 12), k=3, pads=1, strides=1, dilation=1, batch=1,
           epilogue="hardswish"):
    """``Conv(group=c) + bias -> epilogue`` on ``[batch, c, *size]``; the epilogue one of
    "none", "hardswish" (HardSigmoid and Mul, as exporters write it), "relu6" (Clip),
    "residual" (Add of the input, then Relu)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((c, 1, k, k)) * 0.3)
                                     .astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "B")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["y"], group=c, kernel_shape=[k, k],
                              pads=list(pads) if isinstance(pads, (list, tuple)) else [pads] * 4,
                              strides=[strides] * 2, dilations=[dilation] * 2)]
    last = "y"
    if epilogue == "hardswish":
        nodes += [helper.make_node("HardSigmoid", ["y"], ["h"], alpha=1 / 6, beta=0.5),
                  helper.make_node("Mul", ["y", "h"], ["out"])]
        last = "out"
    elif epilogue == "relu6":
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", ["y", "lo", "hi"], ["out"]))
        last = "out"
    elif epilogue == "residual":
        nodes += [helper.make_node("Add", ["y", "x"], ["a"]),
                  helper.make_node("Relu", ["a"], ["out"])]
        last = "out"
    graph = helper.make_graph(
        nodes, "depthwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, *size])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((batch, c, *size)).astype(np.float32) * 2
    return model, x


def _reference(model, x: np.ndarray) -> np.ndarray:
    """The model's output in float64 numpy (stride, padding, dilation, epilogue)."""
    inits = {i.name: numpy_helper.to_array(i).astype("float64") for i in model.graph.initializer}
    conv = model.graph.node[0]
    attrs = {a.name: list(a.ints) for a in conv.attribute if a.ints}
    w, bias = inits["W"], inits["B"]
    k, (top, left, bottom, right) = w.shape[-1], attrs["pads"]
    stride, dilation = attrs["strides"][0], attrs["dilations"][0]
    xp = np.pad(x.astype("float64"), [(0, 0), (0, 0), (top, bottom), (left, right)])
    span = dilation * (k - 1) + 1
    oh = (xp.shape[2] - span) // stride + 1
    ow = (xp.shape[3] - span) // stride + 1
    y = np.zeros((x.shape[0], x.shape[1], oh, ow))
    for ky in range(k):
        for kx in range(k):
            patch = xp[:, :, ky * dilation:ky * dilation + stride * (oh - 1) + 1:stride,
                       kx * dilation:kx * dilation + stride * (ow - 1) + 1:stride]
            y += patch * w[:, 0, ky, kx][None, :, None, None]
    y += bias[None, :, None, None]
    ops = [n.op_type for n in model.graph.node]
    if "HardSigmoid" in ops:
        y = y * np.clip(y / 6 + 0.5, 0, 1)
    elif "Clip" in ops:
        y = np.clip(y, 0, 6)
    elif "Add" in ops:
        y = np.maximum(y + x, 0)
    return y.astype("float32")


def _depthwise_function(model) -> tirx.PrimFunc:
    """The unscheduled fused PrimFunc holding ``model``'s depthwise convolution, for the
    host's target (what the schedule rules see)."""
    target = make_target("host")
    mod = import_model(model).mod
    with target, tvm.transform.PassContext(opt_level=3):
        for p in prepare_passes(target):
            mod = p(mod)
    (func,) = [f for gv, f in mod.functions.items()
               if isinstance(f, tirx.PrimFunc) and "depthwise" in gv.name_hint]
    return func


def _weight_loads(script: str) -> int:
    """Loads of the weights (``param_0``, the first constant) in a function's statements."""
    return sum(line.count("param_0[") for line in script.splitlines()
               if "T.reads(" not in line and "T.writes(" not in line)


def test_template_keeps_the_taps_in_a_register_block_before_the_epilogue():
    """Before (the fallback rule): the taps inlined into HardSwish's block, written twice
    (``x * clip(x + 3)``). After: the convolution computed once per block of pixels into a
    stack buffer under the output's loop, read twice by the epilogue."""
    model, _ = _model(c=32, size=(8, 12), k=3)
    func = _depthwise_function(model)
    target = make_target("host")
    before = ParallelVectorize().apply(func, target, False).mod["main"].script()
    scheduled, (knobs,) = apply_template(DepthwiseTemplate(), func, target)
    after = scheduled.mod["main"].script()

    assert "depthwise" not in re.findall(r'T\.sblock\("(\w+)"\)', before)
    assert _weight_loads(before) == 2 * 9, "the fallback writes HardSwish's operand twice"

    assert re.findall(r'T\.sblock\("(\w+)"\)', after)[:2] == ["root", "depthwise"]
    assert _weight_loads(after) == 9, "the taps once, in the depthwise block"
    (alloc,) = re.findall(r'depthwise\w* = T\.sblock_alloc_buffer\(.*\)', after)
    assert "local" not in alloc, "a stack buffer, not one from the workspace pool"
    assert knobs == depthwise_knobs(DepthwiseShape(8, 12, 32, 9, height=8), target)
    assert knobs.y_block == 2, "8 rows: blocks of 2 rows"
    assert f'"{TEMPLATE_ANNOTATION}": "depthwise convolution, 2 rows x {knobs.x_block} pixels ' \
           f'x {knobs.lanes} channels per register block, 9 taps"' in after
    loops = re.findall(r"in T\.(parallel|vectorized|unroll)\((?:T\.int64\()?(\d+)", after)
    assert loops[0][0] == "parallel"
    # The taps' block and the output's each unroll their rows and pixels, and vectorise.
    assert loops[1:] == [("unroll", "2"), ("unroll", str(knobs.x_block)),
                         ("vectorized", str(knobs.lanes))] * 2, loops


CASES = {
    "3x3-hardswish": dict(c=48, size=(14, 14)),
    "5x5-stride2-relu6": dict(c=24, size=(13, 16), k=5, pads=2, strides=2, epilogue="relu6"),
    # TensorFlow's "SAME" at stride 2: the padding after the map only (top, left, bottom, right
    # as ONNX orders them: 0, 0, 1, 1).
    "3x3-stride2-pad-after": dict(c=32, size=(12, 16), pads=(0, 0, 1, 1), strides=2),
    "dilated-residual-batch2": dict(c=16, size=(9, 8), dilation=2, pads=2, batch=2,
                                    epilogue="residual"),
    "no-epilogue-width7": dict(c=40, size=(7, 7), epilogue="none"),
    "width13-quarter-vector": dict(c=20, size=(5, 13), k=3),
    "5x5-two-rows": dict(c=64, size=(8, 10), k=5, pads=2, epilogue="relu6", rows=2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_template_matches_the_reference(case):
    model, x = _model(**{k: v for k, v in case.items() if k != "rows"})
    compiled = compiles_and_matches(model, {"x": x}, expected=_reference(model, x))
    (info,) = [i for n, i in compiled.kernels.items() if "depthwise" in n]
    assert info.schedule == "template" and "depthwise convolution" in info.detail, info
    assert info.flops > 0
    if "rows" in case:
        assert f"{case['rows']} rows x " in info.detail, info.detail


def test_padding_is_read_in_the_taps_not_written_by_a_kernel_of_its_own():
    """After a 1x1 convolution (a GEMM kernel, which a padding cannot join) the depthwise
    kernel reads the unpadded map: its taps clamp their indices into it and select zero
    outside, so no kernel writes a padded copy, and the values at every border match."""
    rng = np.random.default_rng(1)
    c_in, c, size = 24, 32, (8, 16)
    inits = [numpy_helper.from_array((rng.standard_normal((c, c_in, 1, 1)) * 0.3)
                                     .astype(np.float32), "P"),
             numpy_helper.from_array((rng.standard_normal((c, 1, 3, 3)) * 0.3)
                                     .astype(np.float32), "W")]
    nodes = [helper.make_node("Conv", ["x", "P"], ["p"]),
             helper.make_node("Relu", ["p"], ["r"]),
             helper.make_node("Conv", ["r", "W"], ["out"], group=c, kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "pointwise_depthwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, *size])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    x = rng.standard_normal((1, c_in, *size)).astype(np.float32)
    compiled = compiles_and_matches(model, {"x": x})
    names = main_calls(compiled)
    assert not [n for n in names if "pad" in n], names
    (dw,) = [n for n in compiled.kernels if "depthwise" in n]
    assert compiled.kernels[dw].schedule == "template", compiled.kernels[dw]
    script = compiled.lowered[dw].script()
    assert "T.Select(" in script and "if_then_else" not in script
    # The map it reads is the 1x1 convolution's output as it is, not a padded one.
    signature = next(line for line in script.splitlines() if line.startswith("def "))
    assert f"T.int64({size[0]}), T.int64({size[1]}), T.int64({c})" in signature


def test_channels_no_vector_divides_fall_back_and_say_why():
    model, x = _model(c=15, size=(6, 6))
    compiled = compiles_and_matches(model, {"x": x}, expected=_reference(model, x))
    (info,) = [i for n, i in compiled.kernels.items() if "depthwise" in n]
    assert info.schedule == "fallback" and "does not take" in info.detail, info


def test_heuristic_blocks():
    assert [default_x_block(w) for w in (80, 12, 14, 9, 7, 5, 13, 1)] == \
        [4, 4, 2, 3, 7, 5, 1, 1]
    zmm, ymm = make_target(ZNVER4), make_target(HASWELL)
    assert depthwise_knobs(DepthwiseShape(12, 80, 240, 25), zmm) == DepthwiseKnobs(16, 4)
    assert depthwise_knobs(DepthwiseShape(12, 80, 240, 25), ymm) == DepthwiseKnobs(8, 4)
    assert depthwise_knobs(DepthwiseShape(3, 7, 72, 9), zmm) == DepthwiseKnobs(8, 7)
    assert depthwise_knobs(DepthwiseShape(3, 7, 15, 9), zmm) is None
    # Rows: 2 where they divide the height and leave every thread 4 tasks.
    for taps, height, batch, channels, rows in (
            (9, 24, 1, 64, 2), (9, 56, 2, 96, 2), (25, 12, 1, 240, 2), (25, 6, 1, 240, 2),
            (49, 8, 1, 64, 2), (9, 7, 1, 512, 1), (25, 9, 2, 64, 1), (9, 28, 1, 8, 2),
            (9, 4, 1, 16, 1)):
        shape = DepthwiseShape(batch * height, 16, channels, taps, height=height)
        assert depthwise_knobs(shape, zmm).y_block == rows, (taps, height, channels)
    # 4 rows of 32 channels (4 ymm vectors): 16 tasks, 8 in blocks of 2 rows, 4 per thread;
    # of 16 channels 4 tasks: one row.
    assert depthwise_knobs(DepthwiseShape(4, 16, 32, 9, height=4), ymm).y_block == 2
    assert depthwise_knobs(DepthwiseShape(4, 16, 16, 9, height=4), ymm).y_block == 1
    # A u8 output (a quantized epilogue) is written 16 bytes at a time at least.
    assert channel_lanes(ymm, 32, out_bytes=1) == [16]
    assert channel_lanes(zmm, 32, out_bytes=1) == [16, 32]
    assert channel_lanes(ymm, 24, out_bytes=1) == []
    assert channel_lanes(ymm, 24) == [8, 4]


def test_tuner_space_round_trips_and_other_knobs_still_match():
    template, target = DepthwiseTemplate(), make_target("host")
    model, x = _model(c=32, size=(6, 12))
    func = _depthwise_function(model)
    (workload,) = template.workloads(func, target)
    heuristic = template.heuristic(workload, target)
    assert template.variants(workload, target)[0] == heuristic
    space = {heuristic, *template.neighbours(workload, heuristic, target)}
    rng = random.Random(0)
    space |= {template.random(workload, target, rng) for _ in range(20)}
    assert len(space) <= template.size(workload, target)
    for knobs in space:
        assert template.fits(workload, knobs, target)
        assert template.knobs_from_dict(knobs.as_dict()) == knobs
    assert not template.fits(workload, DepthwiseKnobs(heuristic.lanes, 5), target)
    assert not template.fits(workload, DepthwiseKnobs(heuristic.lanes, 4, 4), target)  # 6 rows
    assert {k.y_block for k in space} == {1, 2, 3}
    record = heuristic.as_dict()
    del record["y_block"]  # a record from before the row block: one row
    assert template.knobs_from_dict(record) == dataclasses.replace(heuristic, y_block=1)
    other = DepthwiseKnobs(min(k.lanes for k in space), 12, 3)  # a whole row, 3 rows
    scheduled, _ = apply_template(template, func, target, [other])
    lib = tvm.compile(tvm.IRModule({"main": scheduled.mod["main"].with_attr(
        "global_symbol", "main")}), target=target)
    rng = np.random.default_rng(1)
    args = [rng.standard_normal([int(d) for d in info.shape]).astype(str(info.dtype))
            for info in ArgInfo.from_prim_func(func)]
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib(*tensors)
    baseline = ParallelVectorize().apply(func, target, False).mod["main"]
    base_lib = tvm.compile(tvm.IRModule({"main": baseline.with_attr("global_symbol", "main")}),
                           target=target)
    base_tensors = [tvm.runtime.tensor(a) for a in args]
    base_lib(*base_tensors)
    np.testing.assert_allclose(tensors[-1].numpy(), base_tensors[-1].numpy(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("target,register", [(HASWELL, "ymm"), (ZNVER4, "zmm")])
def test_assembly_uses_the_isa_fma(target, register):
    """Compiled for a named CPU (whatever the host), the template's kernel runs its taps on
    the ISA's vector FMAs."""
    model, _ = _model(c=64, size=(8, 16))
    compiled = tvm_hybrid.compile(model, target=target)
    (info,) = [i for n, i in compiled.kernels.items() if "depthwise" in n]
    assert info.schedule == "template"
    assert re.search(rf"vfmadd\d+ps\s+[^\n]*%{register}", compiled.inspect_source("asm"))


@pytest.mark.parametrize("target", [HASWELL, ZNVER4])
def test_accumulator_is_on_the_stack_not_from_the_workspace_pool(target):
    """The register block's accumulator is a stack buffer, which LLVM keeps in registers: no
    ``TVMBackendAllocWorkspace`` call in the parallel kernel (a ``"local"`` buffer took one
    per parallel task)."""
    model, _ = _model(c=512, size=(3, 3))
    func = _depthwise_function(model)
    target = make_target(target)
    scheduled, _ = apply_template(DepthwiseTemplate(), func, target)
    lib = tvm.compile(tvm.IRModule({"main": scheduled.mod["main"].with_attr(
        "global_symbol", "main")}), target=target)
    ir = lib.mod.inspect_source("ll")
    assert "load ptr, ptr @__TVMBackendParallelLaunch" in ir
    assert "load ptr, ptr @__TVMBackendAllocWorkspace" not in ir


def test_qdq_depthwise_takes_the_template(monkeypatch):
    """A QDQ depthwise convolution (dequantized input, u8 output) takes the template too, on
    at least 16 channels a vector (16 bytes of output), its result identical to the
    fallback's (same arithmetic, same order)."""
    model, x = _model(c=32, size=(10, 12), epilogue="relu6")
    scale = np.float32(0.05)
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(np.array(scale), "s"),
                              numpy_helper.from_array(np.array(128, np.uint8), "z")])
    conv = graph.node[0]
    conv.input[0] = "xd"
    graph.node.insert(0, helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]))
    graph.node.insert(0, helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]))
    graph.node.append(helper.make_node("QuantizeLinear", ["out", "s", "z"], ["q"]))
    del graph.output[:]  # the u8 tensor itself: the kernel's output is u8
    graph.output.append(helper.make_tensor_value_info("q", TensorProto.UINT8, None))
    compiled = tvm_hybrid.compile(model)
    kernels = [i for n, i in compiled.kernels.items() if "depthwise" in n]
    assert kernels and all(i.schedule == "template" and " x 16 channels" in i.detail
                           for i in kernels), kernels
    monkeypatch.setattr(DepthwiseTemplate, "heuristic", lambda *args: None)
    fallback = tvm_hybrid.compile(model)
    assert all(i.schedule == "fallback" for n, i in fallback.kernels.items()
               if "depthwise" in n)
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(fallback(x)))
