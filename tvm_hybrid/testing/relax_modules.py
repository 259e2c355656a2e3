"""Small Relax modules for tests: one ``main`` function built op by op with a BlockBuilder."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax


def relax_function(params: list[relax.Var], body: Callable) -> tvm.IRModule:
    """A module whose ``main(*params)`` is one dataflow block: ``body(bb, *params)`` emits
    what it needs with ``bb`` and returns the output expression."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()
