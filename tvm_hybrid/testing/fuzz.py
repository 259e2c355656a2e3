"""A seeded fuzzer: random small ONNX graphs compiled by tvm_hybrid and checked against a
reference.

Each graph is one of seven kinds, all with random (often odd) shapes:

* ``fp32_dag``: chains of elementwise ops, matmuls with constant weights, softmax and
  reductions, checked against ONNX's reference evaluator (``rtol`` 1e-4, ``atol`` 1e-4 of the
  output's scale);
* ``gemm_epilogue``: ``MatMul`` + bias + an activation (ReLU, Sigmoid, Tanh, GELU) + residual,
  the fusions of the GEMM template, checked the same way;
* ``qdq_gemm``: a QDQ GEMM with extreme scales and zero points (accumulator to output scale
  ratios from 1e-3 to 1e3, u8 or s8, per-tensor or per-channel weights), checked against ONNX's
  float QDQ semantics: within one output quantization step;
* ``integer_matmul``: ``MatMulInteger`` with random zero points, bit-exact against int64 numpy;
* ``gather``: an embedding lookup with random valid (also negative) ids, exact;
* ``axis_reduction``: ``Softmax`` or a reduction (sum, mean, max) over random axes of a 3-D or
  4-D tensor, extents often a whole number of vectors, the result kept or squeezed, then maybe
  broadcast back against the input; checked like ``fp32_dag``. (A softmax over a middle axis
  and a mean down to one scalar each failed to compile before this kind was added.)
* ``resize``: ``Resize`` of a 3-D to 5-D tensor in any mode, coordinate transformation,
  nearest rounding, cubic coefficient and ``exclude_outside``, with scales or sizes, ``axes``,
  ``keep_aspect_ratio_policy``, ``antialias`` and regions of interest; checked like
  ``fp32_dag``. (TVM's converter gave wrong values or divided by zero on sizes of 1, cubic
  ``exclude_outside`` and 3-D or 5-D inputs when this kind was added: ``frontend/resize.py``.)

Run the long mode from the command line::

    python -m tvm_hybrid.testing.fuzz --graphs 2000 --seed 0

It prints one line per failing graph and a summary, and exits non-zero if any graph gave a wrong
result or failed to compile. The test suite runs a short slice (``tests/test_reliability.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KINDS = ("fp32_dag", "gemm_epilogue", "qdq_gemm", "integer_matmul", "gather", "axis_reduction",
         "resize")
_SIZES = (1, 2, 3, 7, 8, 13, 16, 31, 32, 64, 97, 128, 197)
#: Extents of the axis_reduction kind: whole vectors (8, 16, 48, 64) and odd ones.
_AXIS_SIZES = (1, 3, 4, 7, 8, 16, 33, 48, 64)


@dataclasses.dataclass
class Case:
    """One fuzz graph: the model, its inputs and how to judge an output."""

    kind: str
    name: str
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    check: Callable[[np.ndarray], str | None]  # None when right, else what is wrong


class _Builder:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, array) -> str:
        self.count += 1
        name = f"c{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def model(self, inputs: list, output: str, out_type: int, out_shape) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "fuzz", inputs,
                                  [helper.make_tensor_value_info(output, out_type, out_shape)],
                                  self.inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        proto.ir_version = 8
        return proto


def _reference(model: onnx.ModelProto, inputs: dict) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, inputs)[0]


def _close(want: np.ndarray, rtol: float = 1e-4) -> Callable[[np.ndarray], str | None]:
    def check(got: np.ndarray) -> str | None:
        if got.shape != want.shape:
            return f"shape {got.shape}, want {want.shape}"
        scale = max(float(np.nanmax(np.abs(want))) if want.size else 0.0, 1.0)
        if not np.array_equal(np.isnan(got), np.isnan(want)):
            return "NaNs differ"
        err = float(np.nanmax(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
        if err > rtol * scale + rtol * float(np.nanmax(np.abs(want), initial=0)):
            return f"max error {err:.3g} at output scale {scale:.3g}"
        return None
    return check


def _exact(want: np.ndarray) -> Callable[[np.ndarray], str | None]:
    def check(got: np.ndarray) -> str | None:
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{got.dtype}{got.shape}, want {want.dtype}{want.shape}"
        wrong = int(np.sum(got != want))
        return f"{wrong} elements differ" if wrong else None
    return check


def _float_case(kind: str, name: str, b: _Builder, x: np.ndarray, out: str, width: int) -> Case:
    """A graph from fp32 input ``x`` to ``out`` ([rows of x, width]), checked against ONNX's
    reference evaluator."""
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                    out, TensorProto.FLOAT, [x.shape[0], width])
    inputs = {"x": x}
    return Case(kind, name, model, inputs, _close(_reference(model, inputs)))


def _fp32_dag(rng: np.random.Generator) -> Case:
    b = _Builder(rng)
    m, width = int(rng.choice(_SIZES)), int(rng.choice(_SIZES[1:]))
    x = rng.standard_normal((m, width)).astype(np.float32)
    cur, ops = "x", []
    for _ in range(int(rng.integers(2, 8))):
        choice = rng.choice(["unary", "binary", "matmul", "softmax", "reduce"])
        if choice == "unary":
            op = str(rng.choice(["Relu", "Sigmoid", "Tanh", "Erf", "Neg", "Abs"]))
            cur = b.op(op, cur)
        elif choice == "binary":
            op = str(rng.choice(["Add", "Mul", "Sub", "Max", "Min"]))
            other = b.const(rng.standard_normal((width,)).astype(np.float32))
            cur = b.op(op, cur, other)
        elif choice == "matmul":
            n = int(rng.choice(_SIZES[1:]))
            w = (rng.standard_normal((width, n)) / np.sqrt(width)).astype(np.float32)
            cur, width = b.op("MatMul", cur, b.const(w)), n
        elif choice == "softmax":
            cur = b.op("Softmax", cur, axis=-1)
        else:
            cur = b.op("ReduceMean", cur, axes=[1], keepdims=1)
            width = 1
        ops.append(str(choice))
    return _float_case("fp32_dag", f"{m}x{x.shape[1]} {'-'.join(ops)}", b, x, cur, width)


def _gemm_epilogue(rng: np.random.Generator) -> Case:
    b = _Builder(rng)
    m, k, n = (int(rng.choice(_SIZES)) for _ in range(3))
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    cur = b.op("Add", b.op("MatMul", "x", b.const(w)),
               b.const(rng.standard_normal(n).astype(np.float32)))
    act = str(rng.choice(["Relu", "Sigmoid", "Tanh", "Gelu", "none"]))
    if act == "Gelu":  # the exporters' erf form
        half = b.op("Mul", cur, b.const(np.float32(0.5)))
        erf = b.op("Erf", b.op("Div", cur, b.const(np.float32(np.sqrt(2)))))
        cur = b.op("Mul", half, b.op("Add", erf, b.const(np.float32(1))))
    elif act != "none":
        cur = b.op(act, cur)
    residual = k == n and bool(rng.integers(2))
    if residual:
        cur = b.op("Add", cur, "x")
    return _float_case("gemm_epilogue", f"{m}x{n}x{k} {act}{' +x' if residual else ''}", b, x,
                       cur, n)


def _qdq_gemm(rng: np.random.Generator) -> Case:
    b = _Builder(rng)
    m, k, n = (int(rng.choice(_SIZES)) for _ in range(3))
    a_type = str(rng.choice(["uint8", "int8"]))
    info = np.iinfo(a_type)
    sx = np.float32(10 ** rng.uniform(-4, 0))
    zx = np.array(rng.integers(info.min, info.max + 1), a_type)
    x = (rng.standard_normal((m, k)) * sx * 40).astype(np.float32)
    per_channel = bool(rng.integers(2))
    sw = (10 ** rng.uniform(-3, -1, n if per_channel else ())).astype(np.float32)
    wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
    ratio = 10 ** rng.uniform(-3, 3)  # accumulator scale / output scale
    sy = np.float32(float(sx) * float(np.max(sw)) / ratio)
    zy = np.array(rng.integers(info.min, info.max + 1), a_type)
    bias = (rng.standard_normal(n) * float(sy) * 20).astype(np.float32)
    xq = b.op("QuantizeLinear", "x", b.const(sx), b.const(zx))
    xd = b.op("DequantizeLinear", xq, b.const(sx), b.const(zx))
    wd = b.op("DequantizeLinear", b.const(wq), b.const(sw),
              b.const(np.zeros(sw.shape, np.int8)), axis=1)
    cur = b.op("Add", b.op("MatMul", xd, wd), b.const(bias))
    relu = bool(rng.integers(2))
    if relu:
        cur = b.op("Relu", cur)
    yq = b.op("QuantizeLinear", cur, b.const(sy), b.const(zy))
    out = b.op("DequantizeLinear", yq, b.const(sy), b.const(zy))
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])], out,
                    TensorProto.FLOAT, [m, n])
    inputs = {"x": x}
    # ONNX's float QDQ semantics (round half to even, saturate). The input is quantized as
    # ONNX does, in float32 (one step there moves outputs by many steps); the rest in float64.
    xq = np.clip(np.round(x / sx).astype(np.float64) + int(zx), info.min, info.max)
    y = ((xq - int(zx)) * float(sx)) @ (wq.astype(np.float64) * sw.astype(np.float64)) + bias
    y = np.maximum(y, 0) if relu else y
    yq = np.clip(np.round(y / float(sy)) + int(zy), info.min, info.max)
    want = (yq - int(zy)) * float(sy)
    step = float(sy)

    def check(got: np.ndarray) -> str | None:
        if got.shape != want.shape:
            return f"shape {got.shape}, want {want.shape}"
        steps = float(np.max(np.abs(got.astype(np.float64) - want))) / step if want.size else 0
        return f"{steps:.2f} quantization steps off" if steps > 1.001 else None

    name = (f"{m}x{n}x{k} {a_type} zx={int(zx)} zy={int(zy)} ratio={ratio:.3g} "
            f"{'per-channel' if per_channel else 'per-tensor'}{' relu' if relu else ''}")
    return Case("qdq_gemm", name, model, inputs, check)


def _integer_matmul(rng: np.random.Generator) -> Case:
    b = _Builder(rng)
    m, k, n = (int(rng.choice(_SIZES)) for _ in range(3))
    a_type = str(rng.choice(["uint8", "int8"]))
    info = np.iinfo(a_type)
    a = rng.integers(info.min, info.max + 1, (m, k)).astype(a_type)
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    zp = np.array(rng.integers(info.min, info.max + 1), a_type)
    inputs_ = ["a", b.const(w), b.const(zp)]
    wzp = None
    if rng.integers(2):
        wzp = np.array(rng.integers(-128, 128), np.int8)
        inputs_.append(b.const(wzp))
    out = b.op("MatMulInteger", *inputs_)
    elem = TensorProto.UINT8 if a_type == "uint8" else TensorProto.INT8
    model = b.model([helper.make_tensor_value_info("a", elem, [m, k])], out, TensorProto.INT32,
                    [m, n])
    wide = w.astype(np.int64) - (0 if wzp is None else int(wzp))
    want = ((a.astype(np.int64) - int(zp)) @ wide).astype(np.int32)
    return Case("integer_matmul", f"{m}x{n}x{k} {a_type} zp={int(zp)} w_zp={wzp}", model,
                {"a": a}, _exact(want))


def _gather(rng: np.random.Generator) -> Case:
    b = _Builder(rng)
    vocab, dim = int(rng.integers(1, 500)), int(rng.choice(_SIZES))
    shape = (int(rng.choice(_SIZES[:8])), int(rng.choice(_SIZES[:10])))
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    id_type = str(rng.choice(["int64", "int32"]))
    ids = rng.integers(-vocab, vocab, shape).astype(id_type)
    out = b.op("Gather", b.const(table), "ids", axis=0)
    elem = TensorProto.INT64 if id_type == "int64" else TensorProto.INT32
    model = b.model([helper.make_tensor_value_info("ids", elem, list(shape))], out,
                    TensorProto.FLOAT, [*shape, dim])
    return Case("gather", f"{vocab}x{dim} ids {shape} {id_type}", model, {"ids": ids},
                _exact(np.take(table, ids, axis=0)))


def _axis_reduction(rng: np.random.Generator) -> Case:
    b = _Builder(rng)
    shape = [int(rng.choice(_AXIS_SIZES)) for _ in range(int(rng.integers(3, 5)))]
    x = rng.standard_normal(shape).astype(np.float32)
    rank = len(shape)
    op = str(rng.choice(["Softmax", "ReduceSum", "ReduceMean", "ReduceMax"]))
    if op == "Softmax":
        axis = int(rng.integers(-rank, rank))
        out, what = b.op("Softmax", "x", axis=axis), f"Softmax axis {axis}"
    else:
        count = int(rng.integers(1, rank + 1))
        axes = sorted(int(a) for a in rng.choice(rank, count, replace=False))
        keep = int(rng.integers(2))
        if op == "ReduceSum":  # opset 13+: the axes are an input
            out = b.op(op, "x", b.const(np.array(axes, np.int64)), keepdims=keep)
        else:
            out = b.op(op, "x", axes=axes, keepdims=keep)
        what = f"{op} axes {axes} keepdims {keep}"
        if keep and rng.integers(2):  # x - mean, as normalisations broadcast it back
            out, what = b.op("Sub", "x", out), what + " then x - it"
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], out,
                    TensorProto.FLOAT, None)
    inputs = {"x": x}
    return Case("axis_reduction", f"{'x'.join(map(str, shape))} {what}", model, inputs,
                _close(_reference(model, inputs)))


def _resize(rng: np.random.Generator) -> Case:
    rank = int(rng.integers(3, 6))
    shape = [int(rng.integers(1, 3)), int(rng.integers(1, 4))] + [
        int(rng.integers(1, 9)) for _ in range(rank - 2)]
    mode = str(rng.choice(["nearest", "linear", "cubic"]))
    coord = str(rng.choice(["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel",
                            "align_corners", "asymmetric", "tf_crop_and_resize"]))
    attrs: dict = {"mode": mode, "coordinate_transformation_mode": coord}
    if mode == "nearest":
        attrs["nearest_mode"] = str(rng.choice(["round_prefer_floor", "round_prefer_ceil",
                                                "floor", "ceil"]))
    elif rng.random() < 0.3:
        attrs["antialias"] = 1
    if mode == "cubic":
        attrs["cubic_coeff_a"] = float(rng.choice([-0.75, -0.5]))
        attrs["exclude_outside"] = int(rng.integers(2))
    axes = list(range(rank))
    if rng.random() < 0.3:
        axes = sorted(int(a) for a in rng.choice(range(2, rank),
                                                 int(rng.integers(1, rank - 1)), replace=False))
        attrs["axes"] = axes
    spatial = [a >= 2 or "axes" in attrs for a in axes]
    inits, names = [], ["x", "", "", ""]
    if coord == "tf_crop_and_resize":
        low = [float(rng.uniform(-0.2, 0.5)) if s else 0.0 for s in spatial]
        high = [lo + float(rng.uniform(0.2, 0.9)) if s else 1.0 for lo, s in zip(low, spatial)]
        inits.append(numpy_helper.from_array(np.array(low + high, np.float32), "roi"))
        names[1] = "roi"
        attrs["extrapolation_value"] = float(rng.choice([0.0, 2.5]))
    dims = [shape[a] for a in axes]
    if rng.random() < 0.5:  # scales that leave every axis at least one element
        scales = [float(rng.choice([s for s in (0.5, 0.6, 0.75, 1.3, 1.5, 2.0, 2.5, 3.0)
                                    if int(np.float32(s) * d) >= 1])) if sp else 1.0
                  for d, sp in zip(dims, spatial)]
        inits.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
        names[2] = "scales"
    else:  # at least half of each axis, so that an aspect-ratio policy leaves one element
        sizes = [int(rng.integers(-(-d // 2), 2 * d + 2)) if sp else d
                 for d, sp in zip(dims, spatial)]
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        names[3] = "sizes"
        if "axes" in attrs and rng.random() < 0.4:
            attrs["keep_aspect_ratio_policy"] = str(rng.choice(["not_larger", "not_smaller"]))
    while not names[-1]:
        names.pop()
    graph = helper.make_graph(
        [helper.make_node("Resize", names, ["y"], **attrs)], "fuzz",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    inputs = {"x": rng.standard_normal(shape).astype(np.float32)}
    what = " ".join(f"{k}={v}" for k, v in attrs.items())
    return Case("resize", f"{'x'.join(map(str, shape))} {what} {names[2:]}", model, inputs,
                _close(_reference(model, inputs)))


_MAKERS = {"fp32_dag": _fp32_dag, "gemm_epilogue": _gemm_epilogue, "qdq_gemm": _qdq_gemm,
           "integer_matmul": _integer_matmul, "gather": _gather,
           "axis_reduction": _axis_reduction, "resize": _resize}


def make_case(seed: int, index: int) -> Case:
    """The ``index``-th graph of the run with ``seed`` (the kinds take turns)."""
    rng = np.random.default_rng([seed, index])
    return _MAKERS[KINDS[index % len(KINDS)]](rng)


@dataclasses.dataclass
class Summary:
    graphs: int = 0
    wrong: int = 0
    failed: int = 0
    kinds: Counter = dataclasses.field(default_factory=Counter)
    findings: list = dataclasses.field(default_factory=list)


def fuzz(graphs: int, seed: int = 0, report: Callable[[str], None] | None = None) -> Summary:
    """Compile and check ``graphs`` random graphs; wrong results and failures are findings."""
    import tvm_hybrid

    summary = Summary()
    for index in range(graphs):
        case = make_case(seed, index)
        summary.graphs += 1
        summary.kinds[case.kind] += 1
        try:
            got = tvm_hybrid.compile(case.model)(**case.inputs)
        except Exception as err:  # noqa: BLE001 - every failure is a finding
            summary.failed += 1
            finding = f"FAILED #{index} {case.kind} {case.name}: {type(err).__name__}: {err}"
        else:
            problem = case.check(got)
            if problem is None:
                continue
            summary.wrong += 1
            finding = f"WRONG #{index} {case.kind} {case.name}: {problem}"
        summary.findings.append(finding)
        if report:
            report(finding)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=2000, help="graphs to run (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    summary = fuzz(args.graphs, args.seed, report=lambda line: print(line, flush=True))
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(summary.kinds.items()))
    print(f"{summary.graphs} graphs ({kinds}) in {time.perf_counter() - start:.0f} s: "
          f"{summary.wrong} wrong, {summary.failed} failed to compile or run")
    return 1 if summary.wrong or summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
