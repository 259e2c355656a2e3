"""TIR schedule rules, tried in order on every fused PrimFunc; the first that applies wins.

Expert templates come first (each with an explicit "does this apply?" check); the generic
:class:`ParallelVectorize` rule catches the rest. A function no rule takes keeps TVM's stock
lowering.
"""

from __future__ import annotations

from .conv_template import ConvTemplate
from .gemm_template import GemmTemplate
from .parallel_vectorize import ParallelVectorize


def default_rules() -> list:
    """The schedule rules the hybrid pipeline applies, in priority order."""
    return [GemmTemplate(), ConvTemplate(), ParallelVectorize()]


__all__ = ["ConvTemplate", "GemmTemplate", "ParallelVectorize", "default_rules"]
