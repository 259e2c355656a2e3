"""The paper's workloads as ONNX models with random weights (fixed seed).

Used by ``tvm-hybrid demo``, the benchmark scripts and the tests. Each builder returns an
``onnx.ModelProto`` whose weights are initializers, the way exporters from PyTorch write them
(MatMul + Add for a Linear layer).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named model with the inputs to feed it and its floating-point op count."""

    name: str
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    flops: float


class _Graph:
    """Small helper to build an ONNX graph node by node."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, array: np.ndarray, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, *shape: int, scale: float | None = None) -> str:
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
        return self.const(self.rng.uniform(-scale, scale, shape).astype("float32"), "w")

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, k: int, n: int) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight(k, n)), self.weight(n, scale=0.1))

    def model(self, name, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        proto.ir_version = 8
        onnx.checker.check_model(proto)
        return proto


def _value(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


def mlp(batch: int, dims: tuple[int, ...], *, seed: int = 0, final: str | None = None,
        name: str | None = None) -> Workload:
    """A multi-layer perceptron: Linear+ReLU per layer; ``final`` (e.g. "Sigmoid") after the last.

    MLP_1 of the paper is ``dims=(13, 512, 256, 128)``, MLP_2 is
    ``(479, 1024, 1024, 512, 256, 1)`` with a final Sigmoid.
    """
    g = _Graph(seed)
    x = "x"
    for n, (k, m) in enumerate(zip(dims[:-1], dims[1:])):
        x = g.linear(x, k, m)
        last = n == len(dims) - 2
        if not last or final is None:
            x = g.op("Relu", x)
        elif final:
            x = g.op(final, x)
    out = g.op("Identity", x)
    proto = g.model("mlp", [_value("x", (batch, dims[0]))], [_value(out, (batch, dims[-1]))])
    data = np.random.default_rng(seed + 1).standard_normal((batch, dims[0])).astype("float32")
    flops = sum(2.0 * batch * k * m for k, m in zip(dims[:-1], dims[1:]))
    name = f"{name or 'mlp' + 'x'.join(map(str, dims))}_b{batch}"
    return Workload(name, proto, {"x": data}, flops)


def gemm(m: int, n: int, k: int, *, seed: int = 0) -> Workload:
    """``Y = A @ W`` with a constant weight ``W`` of shape (k, n)."""
    g = _Graph(seed)
    out = g.op("MatMul", "a", g.weight(k, n, scale=1.0))
    proto = g.model("gemm", [_value("a", (m, k))], [_value(out, (m, n))])
    data = np.random.default_rng(seed + 1).standard_normal((m, k)).astype("float32")
    return Workload(f"gemm{m}x{n}x{k}", proto, {"a": data}, 2.0 * m * n * k)


def _activation_qparams(g: _Graph, values: np.ndarray, pow2: bool = False) -> tuple[str, str]:
    """Constants of the per-tensor asymmetric ``u8`` quantization calibrated on ``values``
    (their range, widened to hold 0; ``pow2``: the scale rounded up to a power of two): the
    scale's and the zero point's names."""
    low, high = min(float(values.min()), 0.0), max(float(values.max()), 0.0)
    scale = np.float32(max(high - low, 1e-6) / 255)
    if pow2:
        scale = np.float32(2.0 ** np.ceil(np.log2(scale)))
    zero = np.uint8(np.clip(round(-low / float(scale)), 0, 255))
    return g.const(np.array(scale, np.float32), "s"), g.const(np.array(zero), "z")


def qdq_mlp(batch: int, dims: tuple[int, ...], *, seed: int = 0, final: str | None = None,
            name: str | None = None, reduce_range: bool = False) -> Workload:
    """The :func:`mlp` quantized to int8 as an ONNX QDQ model (what ONNX Runtime's quantizer
    writes): u8 activations (per-tensor, asymmetric, calibrated on the workload's input), s8
    weights (per output channel, symmetric), fp32 bias; ``QuantizeLinear``/``DequantizeLinear``
    around every MatMul, ReLU before each requantization, ``final`` applied to the dequantized
    output of the last layer. ``reduce_range`` quantizes the weights to 7 bits, ``[-64, 64]``,
    as ONNX Runtime's quantizers do with that option (advised for AVX2 CPUs without VNNI);
    the workload's name then ends in ``_rr``.
    """
    qmax = 64 if reduce_range else 127
    fp32 = mlp(batch, dims, seed=seed, final=final, name=name)
    inits = {t.name: numpy_helper.to_array(t) for t in fp32.model.graph.initializer}
    weights = [n.input[1] for n in fp32.model.graph.node if n.op_type == "MatMul"]
    biases = [n.input[1] for n in fp32.model.graph.node if n.op_type == "Add"]
    g = _Graph(seed)
    x = fp32.inputs["x"]

    scale, zero = _activation_qparams(g, x)
    cur = g.op("DequantizeLinear", g.op("QuantizeLinear", "x", scale, zero), scale, zero)
    value = x
    for n, (wname, bname) in enumerate(zip(weights, biases)):
        w, b = inits[wname], inits[bname]
        w_scale = (np.abs(w).max(axis=0) / qmax).astype(np.float32)
        w_q = np.clip(np.round(w / w_scale), -qmax, qmax).astype(np.int8)
        w_dq = g.op("DequantizeLinear", g.const(w_q, "wq"), g.const(w_scale, "ws"),
                    g.const(np.zeros(w.shape[1], np.int8), "wz"), axis=1)
        cur = g.op("Add", g.op("MatMul", cur, w_dq), g.const(b, "b"))
        value = value @ w + b
        last = n == len(weights) - 1
        if not last or final is None:
            cur = g.op("Relu", cur)
            value = np.maximum(value, 0)
        scale, zero = _activation_qparams(g, value)
        cur = g.op("DequantizeLinear", g.op("QuantizeLinear", cur, scale, zero), scale, zero)
    if final:
        cur = g.op(final, cur)
    out = g.op("Identity", cur)
    proto = g.model("qdq_mlp", [_value("x", (batch, dims[0]))],
                    [_value(out, (batch, dims[-1]))])
    return Workload(f"qdq_{fp32.name}{'_rr' if reduce_range else ''}", proto, dict(fp32.inputs),
                    fp32.flops)


def qdq_reference(wl: Workload) -> np.ndarray:
    """The QDQ integer reference of a :func:`qdq_mlp` workload, in numpy.

    Quantization and dequantization follow ONNX (round half to even, saturate); each GEMM is
    exact in integers, with bias and requantization in the integer arithmetic of
    ``tvm_hybrid.passes.qdq`` (fixed-point multiplier, bias with the multiplier's precision).
    """
    from ..passes.qdq import requantization_constants, requantize_reference

    inits = {t.name: numpy_helper.to_array(t) for t in wl.model.graph.initializer}
    nodes = list(wl.model.graph.node)
    values: dict[str, np.ndarray] = {"x": wl.inputs["x"]}
    quantized: dict[str, tuple] = {}  # float tensor name -> (q, scale, zero) it dequantizes
    index = 0
    while index < len(nodes):
        node = nodes[index]
        if node.op_type == "QuantizeLinear" and node.input[0] in values:
            s, z = inits[node.input[1]], inits[node.input[2]]
            q = np.clip(np.round(values[node.input[0]] / s) + z, 0, 255).astype(np.uint8)
            values[node.output[0]] = q
        elif node.op_type == "DequantizeLinear" and node.input[0] in values:
            s, z = inits[node.input[1]], inits[node.input[2]]
            q = values[node.input[0]]
            values[node.output[0]] = ((q.astype(np.int32) - z).astype(np.float32) * s)
            quantized[node.output[0]] = (q, s, z)
        elif node.op_type == "MatMul":
            q, sx, zx = quantized[node.input[0]]
            w_node = next(n for n in nodes if n.output[0] == node.input[1])
            wq, ws = inits[w_node.input[0]], inits[w_node.input[1]]
            acc = (q.astype(np.int64) - int(zx)) @ wq.astype(np.int64)
            scale = (np.float32(sx) * ws).astype(np.float32)
            add = nodes[index + 1]
            bias = inits[add.input[1]]
            relu = nodes[index + 2].op_type == "Relu"
            qnode = nodes[index + 2 + relu]
            sy, zy = inits[qnode.input[1]], inits[qnode.input[2]]
            bias_fixed, m, shift = requantization_constants(scale, float(sy), bias)
            values[qnode.output[0]] = requantize_reference(acc, bias_fixed, m, shift, int(zy),
                                                           "uint8", relu)
            index += 3 + relu
            continue
        elif node.op_type in ("Sigmoid", "Identity"):
            value = values[node.input[0]]
            values[node.output[0]] = (1 / (1 + np.exp(-value))).astype(np.float32) \
                if node.op_type == "Sigmoid" else value
        index += 1
    return values[wl.model.graph.output[0].name]


def _hardswish(v: np.ndarray) -> np.ndarray:
    return (v * np.clip(v + np.float32(3), 0, 6) / np.float32(6)).astype(np.float32)


_ACTIVATIONS = {"Relu": lambda v: np.maximum(v, 0), "HardSwish": _hardswish}


def _conv_nchw(x: np.ndarray, w: np.ndarray, stride: int, pad: int) -> np.ndarray:
    """``x[N, C, H, W]`` convolved with ``w[O, C, KH, KW]``, zero padding, in the dtype of
    ``x * w`` (exact in int64)."""
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (xp.shape[2] - kh) // stride + 1
    ow = (xp.shape[3] - kw) // stride + 1
    out = 0
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            out = out + np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out


def qdq_convs(channels: tuple[int, ...] = (16, 64, 24), size: tuple[int, int] = (28, 28), *,
              kernels: tuple[int, ...] | None = None, strides: tuple[int, ...] | None = None,
              activation: str = "HardSwish", pow2_scales: bool = False,
              seed: int = 0) -> Workload:
    """A chain of convolutions as an ONNX QDQ model: u8 activations (per-tensor, calibrated on
    the workload's input), s8 weights (per output channel, symmetric), fp32 bias,
    ``activation`` after each convolution, then quantized. ``kernels`` (default all 1:
    MobileNet's pointwise layers) and ``strides`` (default 1) per layer; ``k x k`` kernels
    are padded by ``k // 2``. :func:`qdq_conv_reference` computes it. ``pow2_scales``: every
    scale a power of two and no bias, so that with ReLU the float epilogue is exact (however
    it is contracted or ordered) and outputs must match the reference bit for bit."""
    layers = len(channels) - 1
    kernels = kernels or (1,) * layers
    strides = strides or (1,) * layers
    g = _Graph(seed)
    x = np.random.default_rng(seed + 1).standard_normal((1, channels[0], *size)).astype("float32")
    scale, zero = _activation_qparams(g, x, pow2_scales)
    cur = g.op("DequantizeLinear", g.op("QuantizeLinear", "x", scale, zero), scale, zero)
    value, flops = x, 0.0
    for c, o, k, stride in zip(channels[:-1], channels[1:], kernels, strides):
        w = g.rng.uniform(-1, 1, (o, c, k, k)).astype(np.float32) / math.sqrt(c * k * k)
        w_scale = (np.abs(w).reshape(o, -1).max(axis=1) / 127).astype(np.float32)
        if pow2_scales:
            w_scale = (2.0 ** np.ceil(np.log2(w_scale))).astype(np.float32)
        w_q = np.clip(np.round(w / w_scale.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
        bias = g.rng.uniform(-0.5, 0.5, o).astype(np.float32) * (not pow2_scales)
        w_dq = g.op("DequantizeLinear", g.const(w_q, "wq"), g.const(w_scale, "ws"),
                    g.const(np.zeros(o, np.int8), "wz"), axis=0)
        conv = g.op("Conv", cur, w_dq, g.const(bias, "b"), pads=[k // 2] * 4,
                    strides=[stride, stride])
        cur = g.op(activation, conv)
        value = _conv_nchw(value, w, stride, k // 2) + bias.reshape(1, -1, 1, 1)
        value = _ACTIVATIONS[activation](value)
        flops += 2.0 * c * k * k * value.size
        scale, zero = _activation_qparams(g, value, pow2_scales)
        cur = g.op("DequantizeLinear", g.op("QuantizeLinear", cur, scale, zero), scale, zero)
    out = g.op("Identity", cur)
    proto = g.model("qdq_convs", [_value("x", x.shape)], [_value(out, value.shape)])
    name = "x".join(map(str, channels)) + "_k" + "".join(map(str, kernels))
    name += "_pow2" if pow2_scales else ""
    return Workload(f"qdq_convs_{name}_{activation.lower()}", proto, {"x": x}, flops)


def qdq_conv_reference(wl: Workload) -> np.ndarray:
    """A :func:`qdq_convs` model in numpy: each convolution's integer accumulator exact
    (int64, padding with the zero point), then ``acc * (sx * sw) + bias``, the activation and
    the quantization in fp32 (round half to even, saturate), as ONNX defines them."""
    inits = {t.name: numpy_helper.to_array(t) for t in wl.model.graph.initializer}
    values: dict[str, np.ndarray] = {"x": wl.inputs["x"]}
    quantized: dict[str, tuple] = {}
    for node in wl.model.graph.node:
        ins = node.input
        if node.op_type == "QuantizeLinear":
            s, z = inits[ins[1]], inits[ins[2]]
            q = np.clip(np.round(values[ins[0]] / s) + z, 0, 255).astype(np.uint8)
            values[node.output[0]] = q
        elif node.op_type == "DequantizeLinear" and ins[0] in values:
            s, z = inits[ins[1]], inits[ins[2]]
            q = values[ins[0]]
            values[node.output[0]] = (q.astype(np.int32) - z).astype(np.float32) * s
            quantized[node.output[0]] = (q, s, z)
        elif node.op_type == "Conv":
            q, sx, zx = quantized[ins[0]]
            w_node = next(n for n in wl.model.graph.node if n.output[0] == ins[1])
            wq, ws = inits[w_node.input[0]], inits[w_node.input[1]]
            attrs = {a.name: list(a.ints) for a in node.attribute}
            acc = _conv_nchw(q.astype(np.int64) - int(zx), wq.astype(np.int64),
                             attrs["strides"][0], attrs["pads"][0])
            scale = (np.float32(sx) * ws).astype(np.float32).reshape(1, -1, 1, 1)
            values[node.output[0]] = (acc.astype(np.float32) * scale
                                      + inits[ins[2]].reshape(1, -1, 1, 1))
        elif node.op_type in _ACTIVATIONS:
            values[node.output[0]] = _ACTIVATIONS[node.op_type](values[ins[0]])
        elif node.op_type == "Identity":
            values[node.output[0]] = values[ins[0]]
    return values[wl.model.graph.output[0].name]

def matmul_integer(m: int, n: int, k: int, *, activations: str = "uint8", zero_point: int = 0,
                   weight_zero_point: int | None = None, weight_range=(-128, 128),
                   seed: int = 0) -> Workload:
    """ONNX ``MatMulInteger``: ``(A - a_zp) @ (W - w_zp)`` in int32, ``W`` a constant ``s8``.

    ``activations`` is ``"uint8"`` or ``"int8"``; ``weight_zero_point=None`` leaves the
    optional weight zero point out of the node; weights are drawn from ``weight_range``
    (half-open).
    """
    rng = np.random.default_rng(seed)
    weight = rng.integers(*weight_range, (k, n)).astype(np.int8)
    a_type = TensorProto.UINT8 if activations == "uint8" else TensorProto.INT8
    g = _Graph(seed)
    inputs = ["a", g.const(weight, "w"), g.const(np.array(zero_point, activations), "a_zp")]
    if weight_zero_point is not None:
        inputs.append(g.const(np.array(weight_zero_point, np.int8), "w_zp"))
    out = g.op("MatMulInteger", *inputs)
    proto = g.model("matmul_integer", [_value("a", (m, k), a_type)],
                    [_value(out, (m, n), TensorProto.INT32)])
    low, high = (0, 256) if activations == "uint8" else (-128, 128)
    data = np.random.default_rng(seed + 1).integers(low, high, (m, k)).astype(activations)
    return Workload(f"matmul_integer{m}x{n}x{k}_{activations}", proto, {"a": data},
                    2.0 * m * n * k)


def matmul_integer_reference(wl: Workload) -> np.ndarray:
    """The exact result of a :func:`matmul_integer` workload, computed in int64 with numpy."""
    inits = {t.name: numpy_helper.to_array(t) for t in wl.model.graph.initializer}
    node = wl.model.graph.node[0]
    a = wl.inputs["a"].astype(np.int64) - inits[node.input[2]].astype(np.int64)
    w = inits[node.input[1]].astype(np.int64)
    if len(node.input) > 3:
        w = w - inits[node.input[3]].astype(np.int64)
    return (a @ w).astype(np.int32)


def attention(batch: int, seq: int, *, heads: int = 12, head_dim: int = 64,
              seed: int = 0) -> Workload:
    """BERT multi-head attention core: softmax(Q·Kᵀ/√d + mask)·V on [batch, heads, seq, d]."""
    g = _Graph(seed)
    scores = g.op("MatMul", "q", g.op("Transpose", "k", perm=[0, 1, 3, 2]))
    scaled = g.op("Div", scores, g.const(np.array(math.sqrt(head_dim), "float32")))
    probs = g.op("Softmax", g.op("Add", scaled, "mask"), axis=-1)
    out = g.op("MatMul", probs, "v")
    shape = (batch, heads, seq, head_dim)
    proto = g.model(
        "mha",
        [_value("q", shape), _value("k", shape), _value("v", shape),
         _value("mask", (batch, 1, 1, seq))],
        [_value(out, shape)],
    )
    rng = np.random.default_rng(seed + 1)
    inputs = {n: rng.standard_normal(shape).astype("float32") for n in ("q", "k", "v")}
    inputs["mask"] = _attention_mask(rng, batch, seq)
    flops = 4.0 * batch * heads * seq * seq * head_dim
    suffix = "" if heads == 12 else f"_h{heads}"
    return Workload(f"mha_b{batch}_s{seq}{suffix}", proto, inputs, flops)


def qdq_attention(batch: int, seq: int, *, heads: int = 12, head_dim: int = 64,
                  seed: int = 0, probs_dtype: str = "uint8", causal: bool = False) -> Workload:
    """:func:`attention` quantized as ONNX Runtime's QDQ quantizer writes it.

    ``Q``, ``K`` and ``V`` are quantized to u8 (per tensor, asymmetric, calibrated on the
    workload's inputs) and dequantized before the matmuls, ``K``'s transpose sits between two
    QDQ pairs of the same parameters, and the softmax output is quantized with a scale of
    1/256 (zero point 0 for ``probs_dtype`` u8, -128 for s8) before ``P . V``. The output is
    fp32. ``causal`` adds GPT's boolean mask before the padding mask: ``Where(causal, scores,
    -inf)`` with a constant lower-triangular ``causal`` (``[1, 1, seq, seq]``).
    """
    fp32 = attention(batch, seq, heads=heads, head_dim=head_dim, seed=seed)
    g = _Graph(seed)

    def qdq(name: str, values: np.ndarray) -> tuple[str, str, str]:
        s, z = _activation_qparams(g, values)
        return g.op("DequantizeLinear", g.op("QuantizeLinear", name, s, z), s, z), s, z

    q, _, _ = qdq("q", fp32.inputs["q"])
    k, ks, kz = qdq("k", fp32.inputs["k"])
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2])
    kt = g.op("DequantizeLinear", g.op("QuantizeLinear", kt, ks, kz), ks, kz)
    v, _, _ = qdq("v", fp32.inputs["v"])
    scores = g.op("Div", g.op("MatMul", q, kt),
                  g.const(np.array(math.sqrt(head_dim), "float32")))
    if causal:
        scores = g.op("Where", g.const(np.tril(np.ones((seq, seq), bool))[None, None], "causal"),
                      scores, g.const(np.array(-np.inf, "float32")))
    probs = g.op("Softmax", g.op("Add", scores, "mask"), axis=-1)
    p_zero = np.uint8(0) if probs_dtype == "uint8" else np.int8(-128)
    ps, pz = g.const(np.array(1 / 256, np.float32), "s"), g.const(np.array(p_zero), "z")
    probs = g.op("DequantizeLinear", g.op("QuantizeLinear", probs, ps, pz), ps, pz)
    out = g.op("MatMul", probs, v)
    proto = g.model("qdq_mha", list(fp32.model.graph.input),
                    [_value(out, (batch, heads, seq, head_dim))])
    suffix = ("" if probs_dtype == "uint8" else "_s8") + ("_causal" if causal else "")
    return Workload(f"qdq_{fp32.name}{suffix}", proto, dict(fp32.inputs), fp32.flops)


def quantized_attention_reference(q8, k8, v8, mask, scale: float, quant, cond=None,
                                  fill: float = -np.inf, keep_if: bool = True) -> np.ndarray:
    """The int8 attention kernel's arithmetic in numpy (``schedules/attention``): exact
    integer products, the softmax in float64, ``P`` quantized (round half to even), the output
    ``float32(acc) * float32(sp * sv)``; ``q8``, ``k8``, ``v8`` are ``u8 [b, h, s, d]`` and
    ``quant`` a ``Quantization``. A boolean mask ``cond`` (broadcasting to the scores) replaces
    the scaled scores where it is not ``keep_if`` by ``fill`` before the additive ``mask``."""
    acc = np.einsum("bhid,bhjd->bhij", q8.astype(np.int64) - quant.q_zero,
                    k8.astype(np.int64) - quant.k_zero)
    s = acc * (quant.q_scale * quant.k_scale * scale)
    if cond is not None:
        s = np.where(np.asarray(cond) == keep_if, s, fill)
    if mask is not None:
        s = s + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pq = np.clip(np.round(p / quant.p_scale) + quant.p_zero, 0, 255).astype(np.int64)
    out = np.einsum("bhij,bhjd->bhid", pq - quant.p_zero, v8.astype(np.int64) - quant.v_zero)
    return out.astype(np.float32) * np.float32(quant.p_scale * quant.v_scale)


def qdq_attention_reference(wl: Workload) -> tuple[np.ndarray, float]:
    """A :func:`qdq_attention` workload's output by :func:`quantized_attention_reference`
    (inputs quantized as ONNX does), and one probability step of it (``sp * sv * 255``)."""
    from ..schedules.attention.workload import Quantization

    inits = {t.name: numpy_helper.to_array(t) for t in wl.model.graph.initializer}
    quantize = [n for n in wl.model.graph.node if n.op_type == "QuantizeLinear"]
    params = {n.input[0]: (float(inits[n.input[1]]), int(inits[n.input[2]])) for n in quantize}
    (sq, zq), (sk, zk), (sv, zv) = params["q"], params["k"], params["v"]
    softmax = next(n.output[0] for n in wl.model.graph.node if n.op_type == "Softmax")
    sp, zp = params[softmax]
    zp += 128 if zp < 0 else 0
    q8, k8, v8 = (np.clip(np.round(wl.inputs[n] / s) + z, 0, 255).astype(np.uint8)
                  for n, (s, z) in zip("qkv", ((sq, zq), (sk, zk), (sv, zv))))
    quant = Quantization(sq, zq, sk, zk, sv, zv, sp, zp)
    scale = 1 / math.sqrt(q8.shape[-1])
    where = [n for n in wl.model.graph.node if n.op_type == "Where"]
    cond = inits[where[0].input[0]] if where else None
    return (quantized_attention_reference(q8, k8, v8, wl.inputs["mask"], scale, quant, cond),
            sp * sv * 255)


def bert_layer(batch: int, seq: int, *, hidden: int = 768, heads: int = 12, ffn: int = 3072,
               seed: int = 0) -> Workload:
    """One BERT encoder layer (post-LN), as exported from PyTorch.

    QKV projections, scaled dot-product attention with an additive mask, output projection,
    residual + LayerNorm, FFN with erf-GELU, residual + LayerNorm. BERT-base is the default size.
    """
    g = _Graph(seed)
    head_dim = hidden // heads

    def split_heads(t: str) -> str:  # [b, s, hidden] -> [b, heads, s, d]
        shape = g.const(np.array([batch, seq, heads, head_dim], "int64"))
        return g.op("Transpose", g.op("Reshape", t, shape), perm=[0, 2, 1, 3])

    def layer_norm(t: str) -> str:
        gamma = g.const(np.ones(hidden, "float32") + g.rng.uniform(-0.1, 0.1, hidden)
                        .astype("float32"))
        beta = g.const(g.rng.uniform(-0.1, 0.1, hidden).astype("float32"))
        return g.op("LayerNormalization", t, gamma, beta, axis=-1, epsilon=1e-12)

    x = "x"
    q, k, v = (split_heads(g.linear(x, hidden, hidden)) for _ in range(3))
    scores = g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2]))
    scaled = g.op("Div", scores, g.const(np.array(math.sqrt(head_dim), "float32")))
    probs = g.op("Softmax", g.op("Add", scaled, "mask"), axis=-1)
    context = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
    context = g.op("Reshape", context, g.const(np.array([batch, seq, hidden], "int64")))
    attn = layer_norm(g.op("Add", g.linear(context, hidden, hidden), x))
    h = g.linear(attn, hidden, ffn)
    erf = g.op("Erf", g.op("Div", h, g.const(np.array(math.sqrt(2.0), "float32"))))
    gelu = g.op("Mul", g.op("Mul", h, g.op("Add", erf, g.const(np.array(1.0, "float32")))),
                g.const(np.array(0.5, "float32")))
    out = g.op("Identity", layer_norm(g.op("Add", g.linear(gelu, ffn, hidden), attn)))
    proto = g.model(
        "bert_layer",
        [_value("x", (batch, seq, hidden)), _value("mask", (batch, 1, 1, seq))],
        [_value(out, (batch, seq, hidden))],
    )
    rng = np.random.default_rng(seed + 1)
    inputs = {
        "x": rng.standard_normal((batch, seq, hidden)).astype("float32"),
        "mask": _attention_mask(rng, batch, seq),
    }
    tokens = batch * seq
    flops = 2.0 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    flops += 4.0 * batch * seq * seq * hidden  # Q·Kᵀ and P·V
    suffix = "" if hidden == 768 else f"_h{hidden}"
    return Workload(f"bert_layer_b{batch}_s{seq}{suffix}", proto, inputs, flops)


def resnet(batch: int = 1, size: int = 112, widths: tuple[int, ...] = (32, 64, 128), *,
           classes: int = 100, seed: int = 0) -> Workload:
    """A small ResNet as exporters write it: a 3x3 stride-2 stem, then per width a basic block
    (3x3 Conv, BatchNormalization, Relu, 3x3 Conv, BatchNormalization, the residual Add, Relu;
    stride 2 and a 1x1 projection from the second width on), GlobalAveragePool, Flatten and a
    Gemm classifier. He-initialised weights, BatchNorm statistics of a trained-looking spread,
    input a normalised image batch ``[batch, 3, size, size]``."""
    g = _Graph(seed)
    flops = 0.0

    def conv_bn(x, c, o, k, stride, hw):
        nonlocal flops
        w = g.rng.standard_normal((o, c, k, k)).astype(np.float32) * math.sqrt(2.0 / (c * k * k))
        y = g.op("Conv", x, g.const(w, "w"), pads=[k // 2] * 4, strides=[stride, stride])
        out_hw = (hw + 2 * (k // 2) - k) // stride + 1
        flops += 2.0 * batch * o * c * k * k * out_hw * out_hw
        gamma = g.rng.uniform(0.5, 1.5, o).astype(np.float32)
        beta = g.rng.uniform(-0.2, 0.2, o).astype(np.float32)
        mean = g.rng.uniform(-0.1, 0.1, o).astype(np.float32)
        var = g.rng.uniform(0.5, 2.0, o).astype(np.float32)
        return g.op("BatchNormalization", y, *(g.const(v, "bn") for v in (gamma, beta, mean, var)),
                    epsilon=1e-5), out_hw

    x, hw = conv_bn("x", 3, widths[0], 3, 2, size)
    x, c = g.op("Relu", x), widths[0]
    for i, o in enumerate(widths):
        stride = 1 if i == 0 else 2
        y, out_hw = conv_bn(x, c, o, 3, stride, hw)
        y, _ = conv_bn(g.op("Relu", y), o, o, 3, 1, out_hw)
        shortcut = x if stride == 1 and c == o else conv_bn(x, c, o, 1, stride, hw)[0]
        x, c, hw = g.op("Relu", g.op("Add", y, shortcut)), o, out_hw
    pooled = g.op("Flatten", g.op("GlobalAveragePool", x))
    w = g.rng.standard_normal((classes, c)).astype(np.float32) / math.sqrt(c)
    logits = g.op("Gemm", pooled, g.const(w, "fc"), g.const(np.zeros(classes, np.float32), "fb"),
                  transB=1)
    flops += 2.0 * batch * classes * c
    out = g.op("Identity", logits)
    proto = g.model("resnet", [_value("x", (batch, 3, size, size))],
                    [_value(out, (batch, classes))])
    data = np.random.default_rng(seed + 1).standard_normal((batch, 3, size, size)).astype("float32")
    return Workload(f"resnet{'x'.join(map(str, widths))}_s{size}_b{batch}", proto, {"x": data},
                    flops)


def _attention_mask(rng, batch: int, seq: int) -> np.ndarray:
    """Additive mask: 0 for real tokens, -10000 for padding at the end of each sequence."""
    mask = np.zeros((batch, 1, 1, seq), "float32")
    for b in range(batch):
        mask[b, ..., seq - int(rng.integers(0, seq // 4 + 1)):] = -10000.0
    return mask


def demo_workloads() -> list[Workload]:
    """The embedded default models of ``tvm-hybrid demo``: a DLRM-style MLP and a BERT layer."""
    return [
        mlp(128, (479, 1024, 1024, 512, 256, 1), final="Sigmoid", name="dlrm_mlp"),
        bert_layer(1, 128, hidden=256, heads=4, ffn=1024),
    ]


def paper_workloads(quick: bool = False) -> list[Workload]:
    """The oneDNN Graph Compiler paper's fp32 workloads (``quick``: one of each kind)."""
    if quick:
        return [
            gemm(1024, 1024, 1024),
            mlp(32, (13, 512, 256, 128), name="mlp1"),
            mlp(32, (479, 1024, 1024, 512, 256, 1), final="Sigmoid", name="mlp2"),
            attention(1, 128),
            bert_layer(1, 128),
        ]
    out = [gemm(1024, 1024, 1024)]
    for batch in (32, 128):
        out.append(mlp(batch, (13, 512, 256, 128), name="mlp1"))
        out.append(mlp(batch, (479, 1024, 1024, 512, 256, 1), final="Sigmoid", name="mlp2"))
    for batch, seq in ((1, 128), (1, 384), (32, 128), (32, 384)):
        out.append(attention(batch, seq))
    out.append(attention(8, 512, heads=16))  # BERT-large heads, a long sequence
    for batch in (1, 8):
        out.append(bert_layer(batch, 128))
    return out
