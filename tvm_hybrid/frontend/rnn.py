"""ONNX ``LSTM``, ``GRU`` and ``RNN`` for TVM's Relax importer, which has none of them.

The recurrence is unrolled over the (static) sequence length. The input projection of all steps
is one GEMM (``X @ W^T + b``, on the GEMM template); each step adds one ``h @ R^T`` GEMM with a
constant, prepacked ``R`` and an elementwise gate epilogue that the fusion passes merge. Every
ONNX attribute is honoured: forward, reverse and bidirectional, initial states, per-batch
``sequence_lens`` (states hold and outputs are zero past a sequence's end; a reverse pass starts
at each sequence's own last step), peepholes, ``clip``, ``input_forget``, ``layout``,
``linear_before_reset`` and the activation functions ONNX lists.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError
from .static_dims import static_dims


def _static_shape(expr: relax.Expr, what: str, node: str) -> list[int]:
    return static_dims(expr, f"the {what}", node,
                       " so that the sequence length and batch are known")


class _Activations:
    """The ``activations`` attribute, with ``activation_alpha``/``beta`` handed out in order."""

    _DEFAULT_ALPHA = {"LeakyRelu": 0.01, "HardSigmoid": 0.2, "Affine": 1.0, "ScaledTanh": 1.0,
                      "ThresholdedRelu": 1.0, "Elu": 1.0}
    _DEFAULT_BETA = {"HardSigmoid": 0.5, "Affine": 0.0, "ScaledTanh": 1.0}

    def __init__(self, attrs: dict, defaults: list[str], directions: int, node: str):
        names = [a.decode() if isinstance(a, bytes) else a
                 for a in attrs.get("activations", defaults * directions)]
        alphas = list(attrs.get("activation_alpha", ()))
        betas = list(attrs.get("activation_beta", ()))
        self.functions = []
        for name in names:
            alpha = alphas.pop(0) if name in self._DEFAULT_ALPHA and alphas else \
                self._DEFAULT_ALPHA.get(name)
            beta = betas.pop(0) if name in self._DEFAULT_BETA and betas else \
                self._DEFAULT_BETA.get(name)
            self.functions.append(self._function(name, alpha, beta, node))
        if len(self.functions) != len(defaults) * directions:
            raise UnsupportedModelError(
                f"{node}: {len(names)} activations given, {len(defaults) * directions} expected")

    def for_direction(self, d: int, count: int) -> list:
        return self.functions[d * count:(d + 1) * count]

    @staticmethod
    def _function(name: str, alpha, beta, node: str):
        op = relax.op

        def const(v):
            return relax.const(float(v), "float32")

        table = {
            "Sigmoid": op.sigmoid,
            "Tanh": op.tanh,
            "Relu": op.nn.relu,
            "LeakyRelu": lambda x: op.nn.leakyrelu(x, alpha),
            "HardSigmoid": lambda x: op.clip(op.add(op.multiply(x, const(alpha)), const(beta)),
                                             0.0, 1.0),
            "Affine": lambda x: op.add(op.multiply(x, const(alpha)), const(beta)),
            "ScaledTanh": lambda x: op.multiply(op.tanh(op.multiply(x, const(beta))),
                                                const(alpha)),
            "Softsign": lambda x: op.divide(x, op.add(op.abs(x), const(1.0))),
            "Softplus": lambda x: op.log(op.add(op.exp(x), const(1.0))),
        }
        if name not in table:
            raise UnsupportedModelError(
                f"{node}: the recurrent activation {name!r} is not supported (supported: "
                f"{', '.join(table)})")
        return table[name]


class _Recurrence:
    """What LSTM and GRU share: reading X, weights, states and lengths; running each direction
    over the steps; assembling ``Y`` and the final states in the requested layout."""

    gates = 0  # 4 for LSTM, 3 for GRU
    default_activations: list[str] = []

    def __init__(self, bb, inputs, attrs, op_type: str):
        self.bb = bb
        self.node = f"{op_type} node {attrs['tvm_custom']['name']!r}"
        self.layout = int(attrs.get("layout", 0))
        direction = attrs.get("direction", b"forward")
        self.direction = direction.decode() if isinstance(direction, bytes) else direction
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise UnsupportedModelError(f"{self.node}: unknown direction {self.direction!r}")
        self.directions = 2 if self.direction == "bidirectional" else 1
        self.clip = attrs.get("clip")
        x = inputs[0]
        if self.layout == 1:  # [batch, seq, input] -> [seq, batch, input]
            x = self.emit(relax.op.permute_dims(x, [1, 0, 2]))
        self.steps, self.batch, self.input_size = _static_shape(x, "input X", self.node)
        w_shape = _static_shape(inputs[1], "weight W", self.node)
        self.hidden = int(attrs.get("hidden_size", w_shape[1] // self.gates))
        self.x = x
        self.w, self.r, self.b = inputs[1], inputs[2], inputs[3]
        self.lengths = inputs[4]
        self.activations = _Activations(attrs, self.default_activations, self.directions,
                                        self.node)
        if self.x.ty.dtype != "float32":
            raise UnsupportedModelError(f"{self.node}: only float32 is supported, got "
                                        f"{self.x.ty.dtype}")

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.bb.emit(expr)

    def pick(self, value: relax.Expr, d: int, axis: int = 0) -> relax.Var:
        """Index ``d`` of ``value``'s axis ``axis``, that axis dropped."""
        sliced = self.emit(relax.op.strided_slice(value, [axis], [d], [d + 1]))
        return self.emit(relax.op.squeeze(sliced, [axis]))

    def initial_state(self, value, d: int) -> relax.Expr:
        """State ``d`` of an initial ``[D, B, H]`` (``[B, D, H]`` with layout 1) input, or 0."""
        if value is None:
            return relax.const(np.zeros((self.batch, self.hidden), "float32"))
        axis = 1 if self.layout == 1 else 0
        return self.pick(value, d, axis)

    def projections(self, d: int) -> list[relax.Expr]:
        """``X_t @ W^T + Wb (+ Rb)`` for every step of direction ``d``, one GEMM for all."""
        hg = self.gates * self.hidden
        w = self.pick(self.w, d)  # [G*H, I]
        flat = self.emit(relax.op.reshape(self.x, (self.steps * self.batch, self.input_size)))
        proj = self.emit(relax.op.matmul(flat, relax.op.permute_dims(w, [1, 0])))
        if self.b is not None:
            bias = self.pick(self.b, d)  # [2*G*H]
            wb = self.emit(relax.op.strided_slice(bias, [0], [0], [hg]))
            proj = self.emit(relax.op.add(proj, self.input_bias(wb, bias)))
        proj = self.emit(relax.op.reshape(proj, (self.steps, self.batch, hg)))
        if self.steps == 1:
            return [self.emit(relax.op.reshape(proj, (self.batch, hg)))]
        parts = self.emit(relax.op.split(proj, self.steps, axis=0))
        return [self.emit(relax.op.reshape(relax.TupleGetItem(parts, t), (self.batch, hg)))
                for t in range(self.steps)]

    def input_bias(self, wb: relax.Expr, bias: relax.Expr) -> relax.Expr:
        """The bias added to the input projection (LSTM folds ``Rb`` in too)."""
        return wb

    def recurrent_weight(self, d: int) -> tuple[relax.Expr, relax.Expr | None]:
        """``R^T`` (``[H, G*H]``) of direction ``d`` and its bias ``Rb`` (or None)."""
        r = self.pick(self.r, d)
        rt = self.emit(relax.op.permute_dims(r, [1, 0]))
        if self.b is None:
            return rt, None
        hg = self.gates * self.hidden
        bias = self.pick(self.b, d)
        return rt, self.emit(relax.op.strided_slice(bias, [0], [hg], [2 * hg]))

    def clipped(self, x: relax.Expr) -> relax.Expr:
        if self.clip is None:
            return x
        return relax.op.clip(x, -float(self.clip), float(self.clip))

    def order(self, d: int) -> list[int]:
        reverse = self.direction == "reverse" or (self.direction == "bidirectional" and d == 1)
        steps = list(range(self.steps))
        return steps[::-1] if reverse else steps

    def reversed_per_sequence(self, d: int) -> bool:
        """A reverse pass over sequences of different lengths: it starts at each one's end."""
        return self.lengths is not None and self.order(d)[0] != 0

    def run(self) -> relax.Tuple:
        ys, finals = [], []
        for d in range(self.directions):
            outs, state = self.direction_pass(d)
            ys.append(self.emit(relax.op.stack(outs, axis=0)))  # [T, B, H]
            finals.append(state)
        y = self.emit(relax.op.stack(ys, axis=1))  # [T, D, B, H]
        if self.layout == 1:
            y = self.emit(relax.op.permute_dims(y, [2, 0, 1, 3]))  # [B, T, D, H]
        states = []
        for k in range(len(finals[0])):
            s = self.emit(relax.op.stack([f[k] for f in finals], axis=0))  # [D, B, H]
            if self.layout == 1:
                s = self.emit(relax.op.permute_dims(s, [1, 0, 2]))
            states.append(s)
        return relax.Tuple([y, *states])

    def direction_pass(self, d: int) -> tuple[list[relax.Expr], list[relax.Expr]]:
        """Outputs in time order and the final states of direction ``d``."""
        projections = self.projections(d)
        if self.reversed_per_sequence(d):
            projections = self.per_sequence_reverse(projections)
            order = list(range(self.steps))
        else:
            order = self.order(d)
        rt, rb = self.recurrent_weight(d)
        state = self.initial_states(d)
        outs: list[relax.Expr] = [None] * self.steps
        for t in order:
            new = self.cell(projections[t], state, rt, rb, d)
            if self.lengths is not None:
                new, out = self.masked(new, state, t)
            else:
                out = new[0]
            state = new
            outs[t] = out
        if self.reversed_per_sequence(d):
            outs = self.per_sequence_reverse(outs)
        return outs, state

    def masked(self, new: list, old: list, t: int) -> tuple[list, relax.Expr]:
        """Past a sequence's end the states hold and the output is zero."""
        lengths = self.emit(relax.op.astype(self.lengths, "int64"))
        alive = self.emit(relax.op.expand_dims(
            relax.op.less(relax.const(t, "int64"), lengths), 1))  # [B, 1]
        zero = relax.const(0.0, "float32")
        kept = [self.emit(relax.op.where(alive, n, o)) for n, o in zip(new, old)]
        return kept, self.emit(relax.op.where(alive, new[0], zero))

    def per_sequence_reverse(self, values: list[relax.Expr]) -> list[relax.Expr]:
        """``values[t]`` ([B, ...]) reordered so that step t of batch b is b's step
        ``len[b] - 1 - t`` (steps past the end keep their place): its own inverse."""
        stacked = self.emit(relax.op.stack(values, axis=0))  # [T, B, F]
        width = _static_shape(stacked, "recurrent values", self.node)[2]
        lengths = self.emit(relax.op.astype(self.lengths, "int64"))  # [B]
        t = relax.const(np.arange(self.steps).reshape(-1, 1), "int64")
        flipped = relax.op.subtract(relax.op.subtract(lengths, relax.const(1, "int64")), t)
        index = self.emit(relax.op.where(relax.op.less(t, lengths), flipped,
                                         relax.op.add(t, relax.op.zeros_like(lengths))))
        index = self.emit(relax.op.broadcast_to(
            relax.op.expand_dims(index, 2), (self.steps, self.batch, width)))
        gathered = self.emit(relax.op.gather_elements(stacked, index, axis=0))
        parts = self.emit(relax.op.split(gathered, self.steps, axis=0)) if self.steps > 1 \
            else None
        if parts is None:
            return [self.emit(relax.op.squeeze(gathered, [0]))]
        return [self.emit(relax.op.squeeze(relax.TupleGetItem(parts, k), [0]))
                for k in range(self.steps)]

    def initial_states(self, d: int) -> list[relax.Expr]:
        raise NotImplementedError

    def cell(self, proj, state, rt, rb, d) -> list[relax.Expr]:
        raise NotImplementedError


class _LSTM(_Recurrence):
    gates = 4
    default_activations = ["Sigmoid", "Tanh", "Tanh"]

    def __init__(self, bb, inputs, attrs):
        super().__init__(bb, inputs, attrs, "LSTM")
        self.h0, self.c0, self.peepholes = inputs[5], inputs[6], inputs[7]
        self.input_forget = bool(attrs.get("input_forget", 0))

    def input_bias(self, wb, bias):
        hg = self.gates * self.hidden
        return relax.op.add(wb, relax.op.strided_slice(bias, [0], [hg], [2 * hg]))

    def recurrent_weight(self, d):
        rt, _ = super().recurrent_weight(d)
        return rt, None  # Rb went into the input projection

    def initial_states(self, d):
        return [self.initial_state(self.h0, d), self.initial_state(self.c0, d)]

    def cell(self, proj, state, rt, rb, d):
        op, h_size = relax.op, self.hidden
        f, g, h = self.activations.for_direction(d, 3)
        h_prev, c_prev = state
        gates = self.emit(op.add(proj, op.matmul(h_prev, rt)))
        i_pre, o_pre, f_pre, c_pre = (self.emit(op.strided_slice(
            gates, [1], [k * h_size], [(k + 1) * h_size])) for k in range(4))
        if self.peepholes is not None:
            p = self.pick(self.peepholes, d)
            p_i, p_o, p_f = (self.emit(op.strided_slice(p, [0], [k * h_size],
                                                        [(k + 1) * h_size])) for k in range(3))
            i_pre = op.add(i_pre, op.multiply(p_i, c_prev))
            f_pre = op.add(f_pre, op.multiply(p_f, c_prev))
        i = self.emit(f(self.clipped(i_pre)))
        forget = (op.subtract(relax.const(1.0, "float32"), i) if self.input_forget
                  else f(self.clipped(f_pre)))
        candidate = g(self.clipped(c_pre))
        c = self.emit(op.add(op.multiply(forget, c_prev), op.multiply(i, candidate)))
        if self.peepholes is not None:
            o_pre = op.add(o_pre, op.multiply(p_o, c))
        o = f(self.clipped(o_pre))
        return [self.emit(op.multiply(o, h(c))), c]


class _GRU(_Recurrence):
    gates = 3
    default_activations = ["Sigmoid", "Tanh"]

    def __init__(self, bb, inputs, attrs):
        super().__init__(bb, inputs, attrs, "GRU")
        self.h0 = inputs[5]
        self.linear_before_reset = bool(attrs.get("linear_before_reset", 0))

    def initial_states(self, d):
        return [self.initial_state(self.h0, d)]

    def cell(self, proj, state, rt, rb, d):
        op, h_size = relax.op, self.hidden
        f, g = self.activations.for_direction(d, 2)
        (h_prev,) = state

        def part(x, k):
            return self.emit(op.strided_slice(x, [1], [k * h_size], [(k + 1) * h_size]))

        def bias_part(k):
            return op.strided_slice(rb, [0], [k * h_size], [(k + 1) * h_size])

        x_z, x_r, x_h = (part(proj, k) for k in range(3))
        rt_zr = self.emit(op.strided_slice(rt, [1], [0], [2 * h_size]))
        rt_h = self.emit(op.strided_slice(rt, [1], [2 * h_size], [3 * h_size]))
        hr = self.emit(op.matmul(h_prev, rt_zr))
        z_pre, r_pre = op.add(x_z, part(hr, 0)), op.add(x_r, part(hr, 1))
        if rb is not None:
            z_pre, r_pre = op.add(z_pre, bias_part(0)), op.add(r_pre, bias_part(1))
        z = self.emit(f(self.clipped(z_pre)))
        r = self.emit(f(self.clipped(r_pre)))
        if self.linear_before_reset:
            rec = op.matmul(h_prev, rt_h)
            if rb is not None:
                rec = op.add(rec, bias_part(2))
            rec = op.multiply(r, rec)
        else:
            rec = op.matmul(op.multiply(r, h_prev), rt_h)
            if rb is not None:
                rec = op.add(rec, bias_part(2))
        candidate = self.emit(g(self.clipped(op.add(x_h, rec))))
        one = relax.const(1.0, "float32")
        h = op.add(op.multiply(op.subtract(one, z), candidate), op.multiply(z, h_prev))
        return [self.emit(h)]


class _RNN(_Recurrence):
    """The simple recurrence: ``h = f(clip(X_t W^T + Wb + Rb + h_prev R^T))``."""

    gates = 1
    default_activations = ["Tanh"]

    def __init__(self, bb, inputs, attrs):
        super().__init__(bb, inputs, attrs, "RNN")
        self.h0 = inputs[5]

    def input_bias(self, wb, bias):
        return relax.op.add(wb, relax.op.strided_slice(bias, [0], [self.hidden],
                                                       [2 * self.hidden]))

    def recurrent_weight(self, d):
        rt, _ = super().recurrent_weight(d)
        return rt, None  # Rb went into the input projection

    def initial_states(self, d):
        return [self.initial_state(self.h0, d)]

    def cell(self, proj, state, rt, rb, d):
        (f,) = self.activations.for_direction(d, 1)
        (h_prev,) = state
        pre = self.emit(relax.op.add(proj, relax.op.matmul(h_prev, rt)))
        return [self.emit(f(self.clipped(pre)))]


class LSTM(OnnxOpConverter):
    """ONNX ``LSTM`` (opsets 7 and 14), unrolled."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _LSTM(bb, inputs, attr).run()


class GRU(OnnxOpConverter):
    """ONNX ``GRU`` (opsets 7 and 14), unrolled."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _GRU(bb, inputs, attr).run()


class RNN(OnnxOpConverter):
    """ONNX ``RNN`` (opsets 7 and 14), unrolled."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _RNN(bb, inputs, attr).run()


#: Converters this package adds to TVM's ONNX importer, by op type.
CONVERTERS = {"LSTM": LSTM, "GRU": GRU, "RNN": RNN}
