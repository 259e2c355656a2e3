"""The "hybrid" Relax pipeline: graph passes, fusion, expert/fallback TIR schedules, lowering.

Registered with ``relax.register_pipeline("hybrid")``, so existing TVM code can use it through
``tvm.compile(mod, target, relax_pipeline="hybrid")``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
from tvm.s_tir import dlight
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from .host import host_target
from .passes import (
    CheckIndices,
    ConvToGemm,
    FastMath,
    FoldQDQ,
    FoldScalesIntoWeights,
    FuseGemmEpilogues,
    IntegerConvToFloat,
    IntegerGemmToVNNI,
    PrepackConstantWeights,
    SinkReshapes,
)
from .schedules import default_rules

PRECISIONS = ("fp32", "bf16")


def hybrid_pipeline(target: Target | None = None, precision: str = "fp32",
                    recorder=None) -> tvm.transform.Pass:
    """Build the hybrid pipeline.

    Parameters
    ----------
    target
        The CPU target. Defaults to the enclosing ``with target:`` scope (``tvm.compile`` opens
        one), else the host.
    precision
        ``"fp32"`` (default), or ``"bf16"``: GEMMs with constant weights compute in bf16 with
        fp32 accumulation (AVX512-BF16), inputs and outputs stay fp32.
    recorder
        A :class:`~tvm_hybrid.kernel_info.KernelRecorder` to note what each kernel holds
        (for the profile report), or None.

    Returns
    -------
    tvm.transform.Pass
        A module pass taking an imported Relax module to one ready for ``relax.build``.
    """

    @tvm.transform.module_pass(opt_level=0, name="HybridPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        tgt = target or Target.current(allow_none=True) or host_target()
        with tgt:
            phases = [
                *prepare_passes(tgt, precision, recorder),
                # Phase 4: schedule TIR: tuning records first, then expert templates, then the
                # parallel+vectorize fallback; anything left keeps stock lowering.
                *([recorder.snapshot()] if recorder is not None else []),
                *_apply_records(),
                dlight.ApplyDefaultSchedule(*default_rules()),
                # Phase 5: lower dataflow, plan memory statically, and finalise for the VM.
                *cpu_generic.dataflow_lower_passes(tgt),
                *cpu_generic.finalize_passes(tgt),
            ]
            return tvm.transform.Sequential(phases)(mod)

    return _pipeline


def prepare_passes(target: Target, precision: str = "fp32",
                   recorder=None) -> list[tvm.transform.Pass]:
    """Phases 1-3: the passes before TIR scheduling.

    Their output's PrimFuncs are what the schedule rules see, hence the tuning tasks
    (``tvm_hybrid.tune`` extracts tasks after exactly these passes).
    """
    return [
        # Phase 1: normalise the imported graph (inference-only forms, folded constants).
        # QDQ GEMMs become int8 first, before constant folding turns their weights into fp32.
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        FoldQDQ(target),
        relax.transform.FoldConstant(),
        # Gathers and scatters check their run-time indices (after folding: static extents).
        CheckIndices(),
        # Phase 2: graph passes (fusion patterns, weight prepacking, quantization).
        *graph_passes(target, precision, recorder),
        # Phase 3: legalize to TIR and fuse producer/consumer chains into one kernel each.
        *cpu_generic.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        *_noted(recorder, relax.transform.FuseOps()),
        relax.transform.FuseTIR(),
        *([recorder.record_kernels()] if recorder is not None else []),
    ]


def _noted(recorder, fusion: tvm.transform.Pass) -> list[tvm.transform.Pass]:
    """``fusion`` between the recorder's passes that follow ONNX nodes through it (the profile
    report's record of which nodes each kernel computes)."""
    if recorder is None:
        return [fusion]
    return [recorder.before_fusion(), fusion, recorder.after_fusion()]


def graph_passes(target: Target, precision: str = "fp32",
                 recorder=None) -> list[tvm.transform.Pass]:
    """Relax-level rewrites run before legalization.

    Integer matmuls with constant 8-bit weights become u8 x s8 VNNI GEMMs, constant fp32
    weights are prepacked for the GEMM microkernel, each GEMM is grouped with its
    epilogue chain (``patterns.py``), and exp/erf/tanh/softmax take vectorisable forms.
    """
    return [
        # Integer convolutions whose sums fp32 holds exactly join the fp32 convolutions.
        IntegerConvToFloat(),
        ConvToGemm(target),
        # Reshapes after GEMMs (a convolution's output) out of the way of their epilogues,
        # then BatchNorm-like scales and shifts into the weights (before they are packed).
        SinkReshapes(),
        FoldScalesIntoWeights(),
        IntegerGemmToVNNI(target),
        # Constant weights packed in the layout of each GEMM's kernel (fp32, bf16); after the
        # integer GEMMs, which take the matmuls of 8-bit data first.
        PrepackConstantWeights(target, bf16=precision == "bf16"),
        *_noted(recorder, FuseGemmEpilogues()),
        FastMath(),
    ]


def _apply_records() -> list[tvm.transform.Pass]:
    if ms.database.Database.current() is None:
        return []
    return [relax.transform.MetaScheduleApplyDatabase(enable_warning=False)]


def register() -> None:
    """Register ``"hybrid"`` with Relax's pipeline registry (idempotent)."""
    if "hybrid" not in relax.pipeline.PIPELINE_MAP:
        relax.register_pipeline("hybrid")(hybrid_pipeline)
