"""Template-restricted tuning: search only the expert templates' knobs, with MetaSchedule's
builders, runners (local or RPC), traces and databases.

>>> path = tvm_hybrid.tune("model.onnx", trials=64)
>>> model = tvm_hybrid.compile("model.onnx", tuning_records=path)
"""

from __future__ import annotations

from .measure import RPCError, RPCSettings
from .records import load_records
from .space import TemplateSpace, template_space
from .tune import extract_tasks, tune

__all__ = ["RPCError", "RPCSettings", "TemplateSpace", "extract_tasks", "load_records",
           "template_space", "tune"]
