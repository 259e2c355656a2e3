"""Relax graph passes of the hybrid pipeline (phases 1 and 2), one per module."""

from .bf16 import PrepackBF16
from .check_indices import CheckIndices
from .conv_gemm import ConvToGemm
from .fast_math import FastMath
from .fuse_epilogues import FuseGemmEpilogues
from .integer_gemm import IntegerGemmToVNNI
from .prepack import PrepackConstantWeights
from .qdq import FoldQDQ

__all__ = [
    "CheckIndices",
    "ConvToGemm",
    "FastMath",
    "FoldQDQ",
    "FuseGemmEpilogues",
    "IntegerGemmToVNNI",
    "PrepackBF16",
    "PrepackConstantWeights",
]
