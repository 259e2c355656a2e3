"""Entry point of the ``tvm.backends`` group: ``import tvm`` calls :func:`autoload`.

It runs while ``tvm`` is still importing, so it only sets thread defaults (TVM's pool does not
exist yet) and registers the "hybrid" pipeline; nothing heavy is imported.
"""

from __future__ import annotations


def autoload() -> None:
    """Register the hybrid pipeline with Relax and set tvm_hybrid's thread defaults."""
    from .thread_pool import configure_defaults

    configure_defaults()
    from .pipeline import register

    register()
