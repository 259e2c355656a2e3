"""The static shape a converter needs, or an error naming the node that has none."""

from __future__ import annotations

import tvm
from tvm import relax

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
