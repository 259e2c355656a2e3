"""How schedule rules decline and fail, and the strict mode that makes failures loud.

A rule *declines* a function it does not cover (returns None, or raises
:class:`NotApplicable` from deep inside its analysis): the next rule tries. A template that has
matched a function and then fails while scheduling it (TVM's ``ScheduleError``, e.g. a
tensorize that does not match) has a bug or a gap, and its function would run on the generic
fallback, 10-100x slower, with numerically correct results that no test would notice. So:

* rules catch only :class:`NotApplicable` and ``s_tir.ScheduleError``; anything else (a Python
  error in a rule) propagates with its traceback. The fallback rule, the last one, also catches
  TVM's ``InternalError`` (a check inside a schedule primitive), so that one function's TVM bug
  costs that function its schedule rather than the model its compile (:func:`rule_failed`);
* a template's ``ScheduleError`` is a warning naming the template and the function, or, with
  ``TVM_HYBRID_STRICT=1`` (the test suite and CI set it), a
  :class:`~tvm_hybrid.errors.TemplateError` carrying TVM's error as its cause.
"""

from __future__ import annotations

import logging
import os

import tvm_ffi
from tvm import s_tir, tirx

from ..errors import TemplateError, first_line

logger = logging.getLogger("tvm_hybrid.schedules")

# Raised inside a pass (Python -> C++ -> Python): registered, it arrives as itself, not as a
# RuntimeError with its message.
tvm_ffi.register_error(TemplateError)

#: Environment variable: ``1`` turns a failing template into an error (module docstring).
STRICT_VARIABLE = "TVM_HYBRID_STRICT"


class NotApplicable(Exception):  # noqa: N818 - a decision, not an error
    """A rule does not cover this function (raised inside its analysis; the rule returns None)."""


def strict() -> bool:
    """True when :data:`STRICT_VARIABLE` asks failing templates to raise."""
    return os.environ.get(STRICT_VARIABLE, "").strip() not in ("", "0", "false", "no")


def function_name(func) -> str:
    """The name a PrimFunc carries (``global_symbol``), else its blocks' names (fused
    functions are named only later, after scheduling)."""
    if not isinstance(func, tirx.PrimFunc):
        return "<not a PrimFunc>"
    if func.attrs is not None and "global_symbol" in func.attrs:
        return str(func.attrs["global_symbol"])
    sch = s_tir.Schedule(func)
    try:
        blocks = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except s_tir.ScheduleError:  # no root block (one opaque block of loops)
        return "an unnamed function without blocks"
    return f"the function of blocks {', '.join(blocks)}"


def template_failed(template: str, func, what: str, err: Exception) -> None:
    """Report that ``template`` matched ``func`` (``what``: its workload) and then failed.

    Raises
    ------
    TemplateError
        In strict mode, with ``err`` as its cause.
    """
    message = (f"the {template} failed on {function_name(func)} ({what}): {first_line(err)}")
    if strict():
        raise TemplateError(message) from err
    logger.warning("%s; it falls back to the generic schedule (slower)", message)


def rule_failed(func, err: Exception) -> None:
    """Report that the fallback rule tripped a TVM internal check on ``func``, which then takes
    TVM's stock lowering (single-threaded and scalar).

    Raises
    ------
    TemplateError
        In strict mode, with ``err`` as its cause.
    """
    message = (f"the fallback schedule (ParallelVectorize) hit a TVM internal error on "
               f"{function_name(func)}: {first_line(err)}")
    if strict():
        raise TemplateError(message) from err
    logger.warning("%s; it takes TVM's stock lowering (single-threaded, scalar)", message)
