"""Which TIR intrinsic a call is: the op's name without its namespace.

TVM 0.27 registers TIR's intrinsics as ``prim.*`` (``prim.if_then_else``, ``prim.likely``);
checks written against ``tirx.*`` names never matched (no padding was inlined into a
reduction, ``schedules/parallel_vectorize.py``), so rules compare the last part only.
"""

from __future__ import annotations

#: Intrinsics that pick or annotate a value rather than compute one.
SELECTS = frozenset({"if_then_else", "likely"})


def intrinsic_name(call) -> str:
    """The name of ``call``'s op without its namespace (``"if_then_else"``); ``""`` when the
    call is not to an op."""
    return getattr(call.op, "name", "").rpartition(".")[2]
