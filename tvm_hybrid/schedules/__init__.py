"""TIR schedule rules, tried in order on every fused PrimFunc; the first that applies wins.

Expert templates come first (each a :class:`~.template.Template`: an explicit "does this
apply?", heuristic knobs, and a search space the tuner reads); the generic
:class:`ParallelVectorize` rule catches the rest. A function no rule takes keeps TVM's stock
lowering.
"""

from __future__ import annotations

from .conv_template import ConvTemplate
from .depthwise_template import DepthwiseTemplate
from .gemm.template import GemmTemplate
from .gemm_chain import GemmChainTemplate
from .parallel_vectorize import ParallelVectorize
from .template import Template, apply_template

#: The expert templates, in priority order (what the rules apply and the tuner searches).
TEMPLATES: tuple[Template, ...] = (GemmChainTemplate(), GemmTemplate(), ConvTemplate(),
                                   DepthwiseTemplate())


def default_rules() -> list:
    """The schedule rules the hybrid pipeline applies, in priority order."""
    return [*TEMPLATES, ParallelVectorize()]


def covering_template(func, target) -> tuple[Template, list] | None:
    """The first template that schedules workloads of ``func``, with those workloads."""
    for template in TEMPLATES:
        workloads = template.workloads(func, target)
        if workloads:
            return template, workloads
    return None


__all__ = ["TEMPLATES", "ConvTemplate", "DepthwiseTemplate", "GemmChainTemplate", "GemmTemplate",
           "ParallelVectorize", "Template", "apply_template", "covering_template", "default_rules"]
