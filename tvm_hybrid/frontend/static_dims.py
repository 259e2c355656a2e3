"""What a converter needs known at compile time, the static shape of an input or the value of
an operand, or an error naming the node that lacks it."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from ..errors import UnsupportedModelError


def static_dims(expr: relax.Expr, what: str, node: str, why: str = "") -> list[int]:
    """``expr``'s dimensions as integers.

    Raises
    ------
    UnsupportedModelError
        Naming ``node`` and ``what`` (and ``why`` the converter needs them) when a dimension
        is unknown at compile time.
    """
    shape = expr.ty.shape
    dims = list(shape.values) if shape is not None and hasattr(shape, "values") else None
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        raise UnsupportedModelError(f"{node}: {what} needs a static shape (got {dims}); pass "
                                    f"input_shapes to compile{why}")
    return [int(d) for d in dims]


def constant_operand(value: relax.Expr | None, params, what: str,
                     node: str) -> np.ndarray | None:
    """The value of an operand that must be constant (an initializer, or a graph input made one
    per value: ``value_inputs.py``); None when the node omits it.

    Raises
    ------
    UnsupportedModelError
        Naming ``node`` and ``what`` when the operand is computed at run time.
    """
    if value is None:
        return None
    const = get_constant(value, params)
    if not isinstance(const, tvm.ir.GenericConst):
        raise UnsupportedModelError(f"{node}: {what} is computed at run time; it must be a "
                                    "constant")
    return np.asarray(const.value.numpy())


def constant_int(value: relax.Expr | None, params, what: str, node: str) -> int | None:
    """The one integer of a one-element constant operand (an axis, ``k``, a length); None when
    the node omits it. Raises as :func:`constant_operand` does, and when it has more elements."""
    data = constant_operand(value, params, what, node)
    if data is None:
        return None
    if data.size != 1:
        raise UnsupportedModelError(f"{node}: {what} must have one element, got {data.size}")
    return int(data.reshape(-1)[0])
