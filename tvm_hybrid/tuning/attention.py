"""Tuning the fused attention template: its knobs, measured on regenerated kernels.

The attention kernel is generated from its knobs (``schedules/attention/kernel.py``), not
scheduled, so no MetaSchedule trace can express a choice. Its tasks are the attention
workloads of the model (``AttentionShape``, read from each kernel's attribute); a search
measures the template's knob sets (``schedules/attention/heuristics.variants``: the heuristic's
first, then blocks and tiles around it) as standalone kernels, keeps the heuristic unless the
best beats it again in an interleaved re-measurement, and the records keep the chosen knobs by
workload. Compiling with the records applies them (``tuned_knobs``, read by
``FuseAttention``).
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..schedules.attention import SHAPE_ATTR, AttentionShape, attention_kernel, variants
from ..schedules.attention.amx_kernel import amx_attention_kernel
from ..schedules.attention.bf16_kernel import bf16_attention_kernel
from ..schedules.attention.quantized_kernel import quantized_attention_kernel
from .measure import Measurer
from .search import median

#: The best must beat the heuristic by this fraction again to be kept (as for the GEMMs).
CONFIRM_MARGIN = 0.03
CONFIRM_ROUNDS = 3


@dataclasses.dataclass
class AttentionRecord:
    """What tuning measured for one attention workload, and the knobs it keeps."""

    shape: AttentionShape
    measured: dict[str, float] = dataclasses.field(default_factory=dict)  # knobs key -> s
    kept: dict | None = None  # AttentionKnobs.as_dict()
    heuristic: str | None = None

    @property
    def key(self) -> str:
        return self.shape.key

    def as_json(self) -> dict:
        return {"shape": self.key, "kept": self.kept, "heuristic": self.heuristic,
                "measured": {k: (v if math.isfinite(v) else None)
                             for k, v in self.measured.items()}}

    @classmethod
    def from_json(cls, data: dict) -> AttentionRecord:
        measured = {k: (math.inf if v is None else float(v))
                    for k, v in data.get("measured", {}).items()}
        return cls(AttentionShape.from_key(data["shape"]), measured, data.get("kept"),
                   data.get("heuristic"))


def attention_workloads(mod: tvm.IRModule) -> list[AttentionShape]:
    """The distinct attention workloads (fp32, int8 and bf16) of a prepared module (its fused
    attention kernels)."""
    found = []
    for func in mod.functions.values():
        attrs = getattr(func, "attrs", None) or {}
        if isinstance(func, tvm.tirx.PrimFunc) and SHAPE_ATTR in attrs:
            shape = AttentionShape.from_key(str(attrs[SHAPE_ATTR]))
            if shape not in found:
                found.append(shape)
    return found


def _module(shape: AttentionShape, knobs) -> tvm.IRModule:
    """The kernel of ``shape`` with ``knobs`` (an int8 or bf16 attention's main kernel: its
    preparation does not depend on the knobs)."""
    kernel = quantized_attention_kernel if shape.quant is not None else \
        (amx_attention_kernel if knobs.qk.per_block else bf16_attention_kernel) if shape.bf16 \
        else attention_kernel
    return tvm.IRModule({"main": kernel(shape, knobs).with_attr("global_symbol", "main")})


def tune_attention(shape: AttentionShape, target: Target, measurer: Measurer, budget: int,
                   record: AttentionRecord | None = None, advance=None) -> AttentionRecord:
    """Measure up to ``budget`` knob sets of ``shape`` (those already in ``record`` are not
    measured again) and keep the best that beats the heuristic again."""
    record = record or AttentionRecord(shape)
    candidates = variants(target, shape)
    if not candidates:
        return record
    heuristic = candidates[0]
    record.heuristic = heuristic.key
    args_info = ms.arg_info.ArgInfo.from_prim_func(_module(shape, heuristic)["main"])
    todo = [k for k in candidates if k.key not in record.measured][:max(0, budget)]
    for knobs in todo:
        (seconds,) = measurer.measure([_module(shape, knobs)], args_info)
        record.measured[knobs.key] = median(seconds)
        if advance is not None:
            advance(1)
    by_key = {k.key: k for k in candidates}
    done = [(s, k) for k, s in record.measured.items() if k in by_key and math.isfinite(s)]
    if not done:
        return record
    best = by_key[min(done)[1]]
    kept = heuristic
    if best.key != heuristic.key:
        runs = measurer.measure([_module(shape, heuristic), _module(shape, best)], args_info,
                                rounds=CONFIRM_ROUNDS)
        if median(runs[1]) < median(runs[0]) * (1 - CONFIRM_MARGIN):
            kept = best
    record.kept = kept.as_dict()
    return record
