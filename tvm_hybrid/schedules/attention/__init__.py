"""The fused attention template: ``softmax(scale * Q . K^T + mask) . V`` in one kernel.

``workload.py`` says what one attention computes, ``heuristics.py`` picks the knobs (blocks and
register tiles from the microkernel registry), ``kernel.py`` generates the fp32 kernel,
``quantized_kernel.py`` the int8 (QDQ) one and ``bf16_kernel.py`` the bf16 one; the graph
pass that finds attentions is ``passes/fuse_attention.py``.
"""

from .heuristics import (
    AttentionKnobs,
    choose_knobs,
    fits,
    knobs_for,
    knobs_from_dict,
    tuned_knobs,
    variants,
)
from .kernel import ATTENTION_ATTR, FLOPS_ATTR, SHAPE_ATTR, attention_kernel
from .workload import AttentionShape

__all__ = ["ATTENTION_ATTR", "FLOPS_ATTR", "SHAPE_ATTR", "AttentionKnobs", "AttentionShape",
           "attention_kernel", "choose_knobs", "fits", "knobs_for", "knobs_from_dict",
           "tuned_knobs", "variants"]
