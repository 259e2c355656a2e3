"""Relax graph passes of the hybrid pipeline (phase 2), one per module."""

from .bf16 import PrepackBF16
from .fast_math import FastMath
from .fuse_epilogues import FuseGemmEpilogues
from .integer_gemm import IntegerGemmToVNNI
from .prepack import PrepackConstantWeights
from .qdq import FoldQDQ

__all__ = [
    "FastMath",
    "FoldQDQ",
    "FuseGemmEpilogues",
    "IntegerGemmToVNNI",
    "PrepackBF16",
    "PrepackConstantWeights",
]
