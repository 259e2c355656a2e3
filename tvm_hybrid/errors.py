"""Exceptions raised by tvm_hybrid.

Every failure a user can cause (a bad model file, an op TVM cannot import, a wrong input, an
unknown target) surfaces as a subclass of :class:`TVMHybridError` whose message names the
problem, instead of a traceback from deep inside TVM.
"""

from __future__ import annotations


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type name if it has none): TVM's errors run to
    pages of C++ context, the user needs the line that says what failed."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class TVMHybridError(Exception):
    """Base class of every error tvm_hybrid raises on purpose."""


class ModelLoadError(TVMHybridError):
    """The model file is missing, unreadable or not a valid ONNX model."""


class UnsupportedModelError(TVMHybridError):
    """The model uses operators (or features) TVM's importer cannot translate."""


class InputError(TVMHybridError):
    """An input given at call time has the wrong count, shape or dtype."""


class TargetError(TVMHybridError):
    """The target is unknown, malformed, or asks for an ISA the CPU lacks."""


class CompileError(TVMHybridError):
    """TVM failed while compiling a model that imported correctly."""


class TuningRecordsError(TVMHybridError):
    """A tuning-records file is missing, malformed or made for another target."""


class RPCError(TVMHybridError):
    """The RPC tracker cannot be reached, or it has no server under the requested key."""


class OptionError(TVMHybridError, ValueError):
    """An option has a value tvm_hybrid does not know (a precision, a pipeline, a count)."""


class TemplateError(CompileError):
    """An expert template failed on a function it had matched (raised in strict mode,
    ``TVM_HYBRID_STRICT=1``; otherwise the function falls back with a warning)."""
