"""What each compiled kernel is: its ONNX nodes, how it was scheduled and why, its FLOPs.

The pipeline fills a :class:`KernelRecorder` while it compiles (the bindings each kernel holds,
after fusion; each kernel before scheduling). :func:`describe_kernels` turns that and the
scheduled module into one :class:`KernelInfo` per kernel:

* ``schedule``: ``"template"`` (an expert template, with its microkernel and knobs),
  ``"fallback"`` (the parallel/vectorise rule) or ``"stock"`` (TVM's unscheduled lowering);
* ``detail``: the template's choice, or for other kernels why no template took it (shape, op,
  dtype), so a user knows what to do (``tvm-hybrid tune --others metaschedule``, say);
* ``flops`` and ``kind`` (fp32, int8, bf16) of GEMM-like kernels, for GFLOP/s and % of peak.
"""

from __future__ import annotations

import dataclasses
import re

import tvm
import tvm.ir.prim.expr as prim
from tvm import s_tir, tirx

from .attribution import KernelNodes, nodes_of_names

_KINDS = {"float32": "fp32", "uint8": "int8", "int16": "int8", "bfloat16": "bf16"}


@dataclasses.dataclass
class KernelInfo:
    """One compiled kernel (see the module docstring)."""

    name: str
    nodes: list[str]
    schedule: str
    detail: str
    flops: float = 0.0
    kind: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class KernelRecorder:
    """Collects, during one compile, what :func:`describe_kernels` needs."""

    def __init__(self):
        self.bindings: dict[str, list[str]] = {}
        self.unscheduled: dict[str, tirx.PrimFunc] = {}
        self._nodes = KernelNodes(self.bindings)

    def before_fusion(self) -> tvm.transform.Pass:
        """A pass to run just before each fusion pass (epilogue patterns, ``FuseOps``)."""
        return self._nodes.before()

    def after_fusion(self) -> tvm.transform.Pass:
        """A pass to run just after each fusion pass."""
        return self._nodes.after()

    def record_kernels(self) -> tvm.transform.Pass:
        """A pass to run after ``FuseTIR``."""
        return self._nodes.record()

    def snapshot(self) -> tvm.transform.Pass:
        """A pass to run just before TIR scheduling."""

        @tvm.transform.module_pass(opt_level=0, name="SnapshotKernels")
        def snapshot(mod, _ctx):
            for gvar, func in mod.functions.items():
                if isinstance(func, tirx.PrimFunc):
                    self.unscheduled[gvar.name_hint] = func
            return mod

        return snapshot


def describe_kernels(lowered: tvm.IRModule, recorder: KernelRecorder | None,
                     labels: list[str], target) -> dict[str, KernelInfo]:
    """One :class:`KernelInfo` per PrimFunc of ``lowered`` (the scheduled module)."""
    from .schedules.gemm.template import TEMPLATE_ANNOTATION

    infos = {}
    for gvar, func in lowered.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gvar.name_hint
        script = func.script()
        notes = re.findall(rf'"{re.escape(TEMPLATE_ANNOTATION)}": "([^"]+)"', script)
        before = recorder.unscheduled.get(name) if recorder else None
        flops, kind = _gemm_flops(before) if before is not None else (0.0, "")
        if notes:
            schedule, detail = "template", "; ".join(notes)
        else:
            # dlight marks what a rule scheduled; what none took keeps TVM's stock lowering.
            scheduled = func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled"))
            schedule = "fallback" if scheduled else "stock"
            detail = template_hint(before, target) if before is not None else ""
        nodes = nodes_of_names(recorder.bindings.get(name, []), labels) if recorder else []
        infos[name] = KernelInfo(name, nodes, schedule, detail, flops, kind)
    return infos


def _gemm_flops(func: tirx.PrimFunc) -> tuple[float, str]:
    """FLOPs (2 per multiply-add) of the multiply-accumulate blocks (GEMMs, convolutions) of an
    unscheduled kernel, and their number kind."""
    from .schedules.gemm.template import prepare

    try:
        gemms = prepare(s_tir.Schedule(func)) or []
    except Exception:  # noqa: BLE001 - not analysable
        gemms = []
    if gemms:
        flops = sum(2.0 * g.shape.batch * g.shape.m * g.shape.n * g.shape.k for g in gemms)
        return flops, _KINDS.get(gemms[0].dtype, "")
    flops, kind = 0.0, ""
    try:
        sch = s_tir.Schedule(func)
        blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 - opaque functions: no count
        return 0.0, ""
    for block in blocks:
        if not any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars):
            continue
        body = block.body
        if not (isinstance(body, tirx.BufferStore) and isinstance(body.value, prim.Add)
                and _has_mul(body.value.b)):
            continue
        extents = [iv.dom.extent for iv in block.iter_vars]
        if not all(isinstance(e, prim.IntImm) for e in extents):
            continue
        count = 1
        for extent in extents:
            count *= int(extent.value)
        flops += 2.0 * count
        kind = kind or _KINDS.get(str(body.buffer.dtype), "")
    return flops, kind


def _has_mul(expr) -> bool:
    while isinstance(expr, prim.Cast):
        expr = expr.value
    return isinstance(expr, prim.Mul)


def template_hint(func: tirx.PrimFunc, target) -> str:
    """Why the expert template did not take ``func`` (unscheduled), in a user's words."""
    from .microkernels import microkernels_for
    from .schedules.accumulate import reduction_blocks
    from .schedules.gemm.template import candidate_kernels, prepare

    try:
        sch = s_tir.Schedule(func)
        gemms = prepare(sch)
    except Exception as err:  # noqa: BLE001
        return f"not analysable ({type(err).__name__})"
    if gemms is None:
        return "opaque loops: no schedule rule applies"
    if not gemms:
        names = " ".join(sch.get(b).name_hint.lower() for b in reduction_blocks(sch))
        if "conv" in names:
            return ("a convolution the templates do not cover (depthwise, grouped, strided or "
                    "too narrow for the direct template): the generic schedule")
        for word, what in (("softmax", "a softmax"), ("norm", "a normalisation"),
                           ("pool", "a pooling")):
            if word in names:
                return f"{what}: a memory-bound reduction, vectorised by the fallback rule"
        if names:
            return ("a reduction that is not a GEMM: the generic schedule; try tvm-hybrid "
                    "tune --others metaschedule")
        return "elementwise or data movement: memory-bound, no template needed"
    for gemm in gemms:
        shape = f"{gemm.shape.m}x{gemm.shape.n}x{gemm.shape.k}"
        if gemm.shape.k < 2:
            return f"GEMM {shape} with K = 1 (an outer product): memory-bound"
        if not microkernels_for(target, gemm.dtype):
            return f"GEMM {shape} on {gemm.dtype}: this target has no such microkernel"
        if not candidate_kernels(gemm, target):
            return (f"GEMM {shape}: no register tile divides M and N without a tail (the "
                    "template has no tails yet); try tvm-hybrid tune --others metaschedule")
    return "the template applies to its GEMMs but another block failed to schedule"
