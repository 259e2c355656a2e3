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
pointwise  up to six elementwise steps: unary ops, ops with a constant,    :func:`check_pointwise`
           gates ``y * v`` (ReLU, clips, SiLU, HardSwish, HardSigmoid...)
residual   ``y + r``, ``r`` a tensor broadcasting to the output          :func:`check_residual`
then       a pointwise chain after the residual (ResNet's ReLU)            :func:`check_pointwise`
========== =============================================================== ==================

:func:`gemm_patterns` combines them in the order bias, scale, activation, residual, then
(each optional, ``then`` only after a residual), longest chains first, into
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

from .passes.conv_gemm import DIRECT_CONV
from .passes.prepack import PACKED_MATMUL

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
    """The anchor: fp32 GEMM on static shapes, nothing leaking out of the group.

    The anchor is a ``matmul`` or, once ``PrepackConstantWeights`` has run, a ``call_tir`` of
    its packed GEMM, or of the direct convolution of ``passes/conv_gemm.py``.
    """
    call = context.annotated_expr["gemm"]
    if call.op.name == "relax.call_tir":
        if not call.args[0].name_hint.startswith((PACKED_MATMUL, DIRECT_CONV)):
            return False
        operands = list(call.args[1].fields)
    else:
        operands = list(call.args)
    if any(str(_ty(arg).dtype) != "float32" for arg in operands):
        return False
    if any(_static_shape(arg) is None for arg in operands):
        return False
    return not has_leaking_intermediate_variables(context)


def check_bias(context: PatternCheckContext, prefix: str) -> bool:
    """A bias broadcasts along the output's last axis only (shape ``[N]`` or ``[1, .., N]``)."""
    shape = _static_shape(context.annotated_expr[prefix + "bias"])
    out = _static_shape(context.annotated_expr["gemm"])
    return shape is not None and out is not None and shape[-1:] == out[-1:] and all(
        d == 1 for d in shape[:-1]
    )


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


#: Elementwise ops a pointwise activation chains: unary ones, and binary ones whose other
#: operand is a constant (a scalar, or a vector along the output's last axis).
_POINTWISE_UNARY = ("relax.sigmoid", "relax.tanh", "relax.nn.relu", "relax.nn.silu",
                    "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.leakyrelu", "relax.clip",
                    "relax.erf", "relax.exp", "relax.round")
_POINTWISE_BINARY = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                     "relax.maximum", "relax.minimum")
#: The longest pointwise chain an epilogue takes (HardSwish as exported: five ops).
MAX_POINTWISE = 6


def _pointwise(y, p):
    """A chain of up to :data:`MAX_POINTWISE` elementwise steps on ``y``, each a unary op, a
    binary op with a constant, or a gate ``y * v`` by the stage's input (SiLU, HardSwish,
    HardSigmoid times ``x``, clips and their many exported spellings). Longest first."""
    chains, constants = [], {}
    for length in range(MAX_POINTWISE, 0, -1):
        v = y
        for step in range(length):
            const = is_const()
            constants[f"{p}c{length}_{step}"] = const
            v = (_any_op(_POINTWISE_UNARY)(v)
                 | _any_op(_POINTWISE_BINARY)(v, const) | _any_op(_POINTWISE_BINARY)(const, v)
                 | is_op("relax.multiply")(y, v) | is_op("relax.multiply")(v, y))
        chains.append(v)
    pattern = chains[0]
    for chain in chains[1:]:
        pattern = pattern | chain
    return pattern, constants


def _any_op(names: tuple[str, ...]):
    def build(*args):
        pattern = is_op(names[0])(*args)
        for name in names[1:]:
            pattern = pattern | is_op(name)(*args)
        return pattern
    return build


def check_pointwise(context: PatternCheckContext, prefix: str) -> bool:
    """A pointwise chain's constants broadcast to the output without growing it."""
    out = _static_shape(context.matched_expr)
    for name, expr in context.annotated_expr.items():
        if name.startswith(prefix + "c"):
            shape = _static_shape(expr)
            if shape is None or out is None or len(shape) > len(out) or not all(
                    d in (1, o) for d, o in zip(shape[::-1], out[::-1])):
                return False
    return True


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
        EpilogueStage("pointwise", "activation", _pointwise, check_pointwise),
        EpilogueStage("residual", "residual", _residual, check_residual),
        EpilogueStage("then", "post", _pointwise, check_pointwise),
    )
}

_ORDER = ("bias", "scale", "activation", "residual", "post")


def gemm_patterns() -> list[FusionPattern]:
    """Every anchor + epilogue chain, longest first, as ``FuseOpsByPattern`` patterns."""
    choices = [[None, *[s for s in STAGES.values() if s.kind == kind]] for kind in _ORDER]
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
