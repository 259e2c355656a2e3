"""The fusion pattern registry: a GEMM anchor and the epilogue chains fused into its kernel.

Every pattern is data: a name that says what it fuses (``hybrid.matmul_bias_gelu_erf``), a Relax
dataflow pattern, and a check. An epilogue *stage* is one named step after the GEMM, declared
once with its own pattern builder and check function:

========== =============================================================== ==================
stage      matches (``y`` is the previous value)                           check
========== =============================================================== ==================
bias       ``y + b``, ``b`` a constant broadcast along the last axis       :func:`check_bias`
scale      ``y * c`` or ``y / c``, ``c`` a scalar constant                 :func:`check_scale`
gelu_erf   ``gelu(y)``, or ``y * (erf(y / c) + 1) * 0.5`` (ONNX export)    --
gelu_tanh  ``gelu_tanh(y)``, or the tanh formula of ONNX exports           --
relu       ``relu(y)``; likewise ``sigmoid``, ``tanh``                     --
silu       ``y * sigmoid(y)``                                              --
clip       ``minimum(maximum(y, lo), hi)`` (ReLU6, clips)                  --
hardswish  ``y * clip(y + 3, 0, 6) / 6`` (TVM's import; paddle's order;    --
           ``* (1 / 6)`` as well)
hardsig... ``y * clip(a * y + b, 0, 1)`` (HardSigmoid times its input)     --
residual   ``y + r``, ``r`` a tensor broadcasting to the output          :func:`check_residual`
then_relu  ``relu`` or a clip after the residual (ResNet's ReLU)          --
========== =============================================================== ==================

:func:`gemm_patterns` combines them in the order bias, scale, activation, residual, then
(each optional, ``then_relu`` only after a residual), longest chains first, into
``FuseOpsByPattern`` patterns anchored on ``matmul`` or on the packed GEMM of
``passes/prepack.py``.
Every pattern's check also runs :func:`check_gemm` (fp32, static shapes) and refuses a group
whose intermediate values are used outside it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from tvm import relax
from tvm.ir.prim.expr import IntImm
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext

from .passes.conv_computes import DIRECT_CONV
from .passes.packed_gemm import PACKED_GEMM

Check = Callable[[PatternCheckContext, str], bool]


@dataclasses.dataclass(frozen=True)
class EpilogueStage:
    """One step of a GEMM epilogue: how to match it after ``y``, and when it is allowed."""

    name: str
    kind: str  # "bias" | "scale" | "activation" | "residual" | "post": combined in this order
    build: Callable[[DFPattern, str], tuple[DFPattern, dict[str, DFPattern]]]
    check: Check | None = None


def _ty(expr):
    return expr.ty if hasattr(expr, "ty") else None


def _static_shape(expr) -> tuple[int, ...] | None:
    ty = _ty(expr)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values
    if not all(isinstance(d, IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def check_gemm(context: PatternCheckContext) -> bool:
    """The anchor: a GEMM with an fp32 output on static shapes, nothing leaking out of the
    group.

    The anchor is an fp32 ``matmul`` or, once the weights are packed, a ``call_tir`` of a packed
    GEMM of any operand dtype (``passes/packed_gemm.py``: fp32, or bf16 accumulating in fp32;
    integer GEMMs end in int32 and are dequantized by plain fusion), or of the direct
    convolution of ``passes/conv_gemm.py``.
    """
    call = context.annotated_expr["gemm"]
    if call.op.name == "relax.call_tir":
        name = call.args[0].name_hint
        if PACKED_GEMM not in name and not name.startswith(DIRECT_CONV):
            return False
        operands = list(call.args[1].fields)
        if str(_ty(call).dtype) != "float32":
            return False
    else:
        operands = list(call.args)
        if any(str(_ty(arg).dtype) != "float32" for arg in operands):
            return False
    if any(_static_shape(arg) is None for arg in operands):
        return False
    return not has_leaking_intermediate_variables(context)


def check_bias(context: PatternCheckContext, prefix: str) -> bool:
    """A bias broadcasts along the output's channels only: shape ``[N]`` or ``[1, .., N]``, or
    ``[G, Og]`` on a grouped convolution's output ``[B, OH, OW, G, Og]``."""
    shape = _static_shape(context.annotated_expr[prefix + "bias"])
    out = _static_shape(context.annotated_expr["gemm"])
    if shape is None or out is None:
        return False
    channels = 2 if len(out) == 5 and len(shape) >= 2 else 1
    return shape[-channels:] == out[-channels:] and all(d == 1 for d in shape[:-channels])


def check_scale(context: PatternCheckContext, prefix: str) -> bool:
    """A scale is one number."""
    shape = _static_shape(context.annotated_expr[prefix + "scale"])
    return shape is not None and all(d == 1 for d in shape)


def check_residual(context: PatternCheckContext, prefix: str) -> bool:
    """A residual (or additive mask) broadcasts to the output's shape without growing it."""
    residual = _static_shape(context.annotated_expr[prefix + "residual"])
    out = _static_shape(context.matched_expr)
    if residual is None or out is None or len(residual) > len(out):
        return False
    return all(r in (1, o) for r, o in zip(residual[::-1], out[::-1]))


def _bias(y, p):
    bias = is_const()
    return is_op("relax.add")(y, bias), {p + "bias": bias}


def _scale(y, p):
    c = is_const()
    return is_op("relax.multiply")(y, c) | is_op("relax.divide")(y, c), {p + "scale": c}


def _gelu_erf(y, _p):
    erf = is_op("relax.erf")(is_op("relax.divide")(y, is_const())
                             | is_op("relax.multiply")(y, is_const()))
    inner = is_op("relax.multiply")(y, is_op("relax.add")(erf, is_const()))
    exported = is_op("relax.multiply")(inner, is_const())
    return is_op("relax.nn.gelu")(y) | exported, {}


def _gelu_tanh(y, _p):
    cube = is_op("relax.power")(y, is_const())
    inner = is_op("relax.add")(y, is_op("relax.multiply")(cube, is_const()))
    tanh = is_op("relax.tanh")(is_op("relax.multiply")(inner, is_const()))
    exported = is_op("relax.multiply")(
        is_op("relax.multiply")(y, is_const()), is_op("relax.add")(tanh, is_const())
    )
    return is_op("relax.nn.gelu_tanh")(y) | exported, {}


def _mul(a, b):
    """``a * b`` in either operand order."""
    return is_op("relax.multiply")(a, b) | is_op("relax.multiply")(b, a)


def _clip(v):
    """``minimum(maximum(v, lo), hi)`` (a clip as ``frontend/clip.py`` imports it)."""
    return is_op("relax.minimum")(is_op("relax.maximum")(v, is_const()), is_const())


def _activation(*forms):
    def build(y, _p):
        pattern = None
        for form in forms:
            pattern = form(y) if pattern is None else pattern | form(y)
        return pattern, {}
    return build


def _unary(op: str):
    return lambda y: is_op(op)(y)


def _silu(y):
    return _mul(y, is_op("relax.sigmoid")(y))


def _hardswish(y):
    """``y * clip(y + 3, 0, 6) / 6`` as TVM imports HardSwish, and as paddle exports it
    (``y * clip(y + 3) / 6`` with the division last); either division also as the
    multiplication by ``1 / 6`` that ``ReciprocalDivisors`` makes of it."""
    clipped = _clip(is_op("relax.add")(y, is_const()))
    scaled = is_op("relax.divide")(clipped, is_const()) | _mul(clipped, is_const())
    product = _mul(y, clipped)
    return (_mul(y, scaled) | is_op("relax.divide")(product, is_const())
            | _mul(product, is_const()))


def _hardsigmoid_gate(y):
    """``y * clip(alpha * y + beta, 0, 1)`` (HardSigmoid times its input)."""
    return _mul(y, _clip(is_op("relax.add")(_mul(y, is_const()), is_const())))


def _residual(y, p):
    residual = wildcard()
    return is_op("relax.add")(y, residual), {p + "residual": residual}


#: The epilogue stages, by name.
STAGES: dict[str, EpilogueStage] = {
    s.name: s
    for s in (
        EpilogueStage("bias", "bias", _bias, check_bias),
        EpilogueStage("scale", "scale", _scale, check_scale),
        EpilogueStage("gelu_erf", "activation", _gelu_erf),
        EpilogueStage("gelu_tanh", "activation", _gelu_tanh),
        EpilogueStage("relu", "activation", _activation(_unary("relax.nn.relu"))),
        EpilogueStage("sigmoid", "activation", _activation(_unary("relax.sigmoid"))),
        EpilogueStage("tanh", "activation", _activation(_unary("relax.tanh"))),
        EpilogueStage("silu", "activation", _activation(_silu)),
        EpilogueStage("clip", "activation", _activation(_clip)),
        EpilogueStage("hardswish", "activation", _activation(_hardswish)),
        EpilogueStage("hardsigmoid_gate", "activation", _activation(_hardsigmoid_gate)),
        EpilogueStage("residual", "residual", _residual, check_residual),
        EpilogueStage("then_relu", "post", _activation(_unary("relax.nn.relu"), _clip)),
    )
}

_ORDER = ("bias", "scale", "activation", "residual", "post")


def gemm_patterns() -> list[FusionPattern]:
    """Every anchor + epilogue chain, longest first, as ``FuseOpsByPattern`` patterns."""
    # Among chains of one length the earlier kinds' stages first: ``y + b`` with a constant
    # ``b`` is named a bias, not a residual (either would fuse the same ops).
    choices = [[*[s for s in STAGES.values() if s.kind == kind], None] for kind in _ORDER]
    chains = [tuple(s for s in combo if s is not None) for combo in itertools.product(*choices)
              if combo[-1] is None or combo[-2] is not None]  # "post" only after a residual
    chains.sort(key=len, reverse=True)
    return [_make_pattern(chain) for chain in chains if chain]


def _make_pattern(chain: tuple[EpilogueStage, ...]) -> FusionPattern:
    gemm = is_op("relax.matmul")(wildcard(), wildcard()) | is_op("relax.call_tir")(
        wildcard(), wildcard()
    )
    annotations: dict[str, DFPattern] = {"gemm": gemm}
    y = gemm
    for position, stage in enumerate(chain):
        y, named = stage.build(y, f"s{position}_")
        annotations.update(named)
    name = "hybrid.matmul_" + "_".join(stage.name for stage in chain)
    checks = [(f"s{i}_", s.check) for i, s in enumerate(chain) if s.check is not None]

    def check(context: PatternCheckContext) -> bool:
        return check_gemm(context) and all(fn(context, prefix) for prefix, fn in checks)

    return FusionPattern(name, y, annotations, check)
