"""Relax graph passes of the hybrid pipeline (phases 1 and 2) and its TIR passes (phase 6), one
per module."""

from .affine_chains import FoldAffineChains
from .check_indices import CheckIndices
from .constant_divisors import ReciprocalDivisors
from .conv_gemm import ConvToGemm
from .element_aligned_arguments import ElementAlignedArguments
from .fast_math import FastMath
from .fold_constant import FoldConstantCleanly
from .fold_scales import FoldScalesIntoWeights
from .fuse_attention import FuseAttention
from .fuse_epilogues import FuseGemmEpilogues
from .gemm_chain import FuseGemmChains
from .integer_conv import IntegerConvToFloat
from .integer_gemm import IntegerGemmToVNNI
from .peel_guarded_tails import PeelGuardedTails
from .prepack import PrepackConstantWeights
from .qdq import FoldQDQ
from .row_padding import DropRowPadding
from .sink_reshapes import SinkReshapes

__all__ = [
    "CheckIndices",
    "ConvToGemm",
    "DropRowPadding",
    "ElementAlignedArguments",
    "FastMath",
    "FoldAffineChains",
    "FoldConstantCleanly",
    "FoldScalesIntoWeights",
    "FoldQDQ",
    "FuseAttention",
    "FuseGemmEpilogues",
    "FuseGemmChains",
    "IntegerConvToFloat",
    "IntegerGemmToVNNI",
    "PeelGuardedTails",
    "PrepackConstantWeights",
    "ReciprocalDivisors",
    "SinkReshapes",
]
