"""The "hybrid" Relax pipeline, in phase order: normalise, graph passes, fusion, schedule,
lower.

1. **Normalise** the imported graph: inference forms, QDQ GEMMs to integer GEMMs, constants
   folded, run-time index checks.
2. **Graph passes**: attention subgraphs to fused kernels, convolutions to GEMMs, epilogues
   cleared of reshapes and scales, integer and constant-weight GEMMs packed for their
   microkernels, GEMM + epilogue fusion groups, divisions by constants as products and
   chains of constant scales and shifts as one multiply-add.
3. **Fusion**: legalize to TIR, fuse producer/consumer chains into one kernel each. Phases 1-3
   are :func:`prepare_passes`; their PrimFuncs are the tuning tasks.
4. **Schedule**: tuning records, then the expert templates, then the fallback rule; then the
   zero rows that GEMMs' row tails never read are no longer copied in (``DropRowPadding``).
5. **Lower** for the VM.
6. **TIR** (:func:`tir_pipeline`, registered as the ``"hybrid"`` TIR pipeline): guarded
   write-backs peeled to whole vectors outside their last panel (``PeelGuardedTails``), TVM's
   default lowering, then kernels that take their tensor arguments at any element-aligned
   address.

Registered with ``relax.register_pipeline("hybrid")``, so existing TVM code can use it through
``tvm.compile(mod, target, relax_pipeline="hybrid")``. Each comment below states an ordering
constraint.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
from tvm.s_tir import dlight
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.pipeline import default_s_tir_pipeline
from tvm.target import Target

from .host import host_target
from .passes import (
    CheckIndices,
    ConvToGemm,
    DropRowPadding,
    ElementAlignedArguments,
    FastMath,
    FoldAffineChains,
    FoldConstantCleanly,
    FoldQDQ,
    FoldScalesIntoWeights,
    FuseAttention,
    FuseGemmChains,
    FuseGemmEpilogues,
    IntegerConvToFloat,
    IntegerGemmToVNNI,
    PeelGuardedTails,
    PrepackConstantWeights,
    ReciprocalDivisors,
    SinkReshapes,
)
from .passes.peel_guarded_tails import with_loop_partition
from .schedules import default_rules

PRECISIONS = ("fp32", "bf16")


def normalize_passes(target: Target) -> list[tvm.transform.Pass]:
    """Phase 1: the imported graph in inference form, constants folded, indices checked."""
    return [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        # QDQ GEMMs become integer GEMMs before constant folding turns their weights to fp32.
        FoldQDQ(target),
        FoldConstantCleanly(),
        # After folding: the gathers' data extents are static.
        CheckIndices(),
    ]


def graph_passes(target: Target, precision: str = "fp32",
                 recorder=None) -> list[tvm.transform.Pass]:
    """Phase 2: Relax-level rewrites onto the GEMM engine, before legalization."""
    return [
        # Attention subgraphs to one kernel each, before their matmuls could join GEMM
        # fusion groups.
        FuseAttention(target, recorder, precision),
        # Integer convolutions whose sums fp32 holds exactly join the fp32 convolutions
        # before those become GEMMs.
        IntegerConvToFloat(target),
        ConvToGemm(target, precision),
        # A convolution's output reshape out of the way of its epilogue, before the scales
        # after it fold into the weights, before the weights are packed.
        SinkReshapes(),
        # reshape(reshape(x)) as one (a grouped convolution's [N, H, W, G, Og] output,
        # merged to NHWC, split again by the channel shuffle after it), none where it keeps
        # the shape.
        relax.transform.RemoveRedundantReshape(),
        FoldScalesIntoWeights(),
        # Integer GEMMs take the matmuls of 8-bit data before the constant-weight packing
        # sees their int32 form.
        IntegerGemmToVNNI(target),
        PrepackConstantWeights(target, bf16=precision == "bf16"),
        # Quantization scales, BatchNorm's deviations, HardSwish's 6, GELU's sqrt(2): after
        # every rewrite that folds or builds a division (convolution layouts, scales into
        # weights), before the epilogues are grouped (a group takes its constants as
        # parameters, whose values this pass no longer sees).
        ReciprocalDivisors(),
        # Fusion groups anchor on the packed GEMMs, so after the packing.
        *_noted(recorder, FuseGemmEpilogues()),
        # Inside the fused groups too, so after the grouping.
        FastMath(),
        # The dequantization scale, BatchNorm and quantization scale between two roundings,
        # as one multiply-add: after the divisions became products.
        FoldAffineChains(),
    ]


def fusion_passes(target: Target, recorder=None) -> list[tvm.transform.Pass]:
    """Phase 3: legalize to TIR and fuse producer/consumer chains into one kernel each."""
    return [
        *cpu_generic.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        *_noted(recorder, relax.transform.FuseOps()),
        # Whole fused layers (an integer GEMM meets its requantization in FuseOps) merge into
        # chains, before FuseTIR makes each group one PrimFunc.
        FuseGemmChains(target, recorder=recorder),
        relax.transform.FuseTIR(),
        *([recorder.record_kernels()] if recorder is not None else []),
    ]


def prepare_passes(target: Target, precision: str = "fp32",
                   recorder=None) -> list[tvm.transform.Pass]:
    """Phases 1-3: the passes before TIR scheduling.

    Their output's PrimFuncs are what the schedule rules see, hence the tuning tasks
    (``tvm_hybrid.tune`` extracts tasks after exactly these passes).
    """
    return [*normalize_passes(target), *graph_passes(target, precision, recorder),
            *fusion_passes(target, recorder)]


def schedule_passes(recorder=None) -> list[tvm.transform.Pass]:
    """Phase 4: tuning records first (a record beats a heuristic), then the expert templates,
    then the parallel+vectorize fallback; anything left keeps stock lowering."""
    records = [] if ms.database.Database.current() is None else [
        relax.transform.MetaScheduleApplyDatabase(enable_warning=False)]
    # The recorder keeps the unscheduled kernels (FLOP counts, hints) before they change.
    snapshot = [recorder.snapshot()] if recorder is not None else []
    # Then the GEMMs whose last row tile reads only A's own rows take A without its padding.
    return [*snapshot, *records, dlight.ApplyDefaultSchedule(*default_rules()), DropRowPadding()]


def lowering_passes(target: Target) -> list[tvm.transform.Pass]:
    """Phase 5: lower dataflow, plan memory statically, and finalise for the VM."""
    return [*cpu_generic.dataflow_lower_passes(target), *cpu_generic.finalize_passes(target)]


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
            phases = [*prepare_passes(tgt, precision, recorder), *schedule_passes(recorder),
                      *lowering_passes(tgt)]
            return tvm.transform.Sequential(phases)(mod)

    return _pipeline


def tir_pipeline():
    """Phase 6, the ``"hybrid"`` TIR pipeline: :class:`~tvm_hybrid.passes.PeelGuardedTails`,
    TVM's default TIR lowering (which ends with ``MakePackedAPI``; run with loop partitioning
    of constant loops, which only the loops that pass marks take), then
    :class:`~tvm_hybrid.passes.ElementAlignedArguments`.

    Returns
    -------
    tuple
        ``(pipeline, finalize_host_passes, finalize_device_passes)``, the form
        ``tvm.tirx.register_tir_pipeline`` takes.
    """
    lower, finalize_host, finalize_device = default_s_tir_pipeline()
    return (tvm.transform.Sequential([PeelGuardedTails(), with_loop_partition(lower),
                                      ElementAlignedArguments()], name="HybridTIR"),
            finalize_host, finalize_device)


def _noted(recorder, fusion: tvm.transform.Pass) -> list[tvm.transform.Pass]:
    """``fusion`` between the recorder's passes that follow ONNX nodes through it (the profile
    report's record of which nodes each kernel computes)."""
    if recorder is None:
        return [fusion]
    return [recorder.before_fusion(), fusion, recorder.after_fusion()]


def register() -> None:
    """Register ``"hybrid"`` with Relax's and TIR's pipeline registries (idempotent)."""
    if "hybrid" not in relax.pipeline.PIPELINE_MAP:
        relax.register_pipeline("hybrid")(hybrid_pipeline)
    tvm.tirx.register_tir_pipeline("hybrid", tir_pipeline)
