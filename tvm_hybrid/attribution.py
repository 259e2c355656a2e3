"""Which ONNX nodes each compiled kernel computes.

TVM's ONNX importer keeps no node names. While a model is imported, :func:`record_nodes` notes
the Relax expression each ONNX node converts to; :func:`name_bindings` then renames the bindings
of ``main`` after their node (``node12_`` for the 13th node; bindings the converter emitted before a
node's result belong to that node). Relax passes keep a binding's name when they rewrite its
value, and :class:`KernelNodes` follows them through fusion to the kernel (a fused function
or a single ``call_tir``) that computes them. The profile report
(``profile.py``) shows them per kernel.
"""

from __future__ import annotations

import contextlib
import re

import tvm
from tvm import relax

# Binding names: ``node12_`` (Relax appends digits to repeated names: ``node12_1``).
_NAME = re.compile(r"^node(\d+)_")


@contextlib.contextmanager
def record_nodes(records: list):
    """Within the block, every ONNX node the importer converts appends ``(label, expr)``."""
    from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter

    original = ONNXGraphImporter._convert_operator

    def convert(self, op_name, inputs, attrs, opset):
        out = original(self, op_name, inputs, attrs, opset)
        if isinstance(out, relax.Call) and isinstance(out.ty, relax.TensorType):
            out = self.bb.emit(out)  # bind it now, so that its binding can be found by identity
        results = list(out.fields) if isinstance(out, relax.Tuple) else [out]
        records.append((op_name, attrs.get("tvm_custom", {}).get("name") or "", results))
        return out

    ONNXGraphImporter._convert_operator = convert
    try:
        yield records
    finally:
        ONNXGraphImporter._convert_operator = original


def node_labels(records: list, graph) -> list[str]:
    """``OpType 'name'`` per recorded node; unnamed nodes go by their first output (the
    importer converts ``graph``'s nodes in order, each ``If`` without a record)."""
    nodes = [node for node in graph.node if node.op_type != "If"]
    labels = []
    for index, (op, name, _) in enumerate(records):
        if not name and index < len(nodes) and nodes[index].op_type == op:
            name = nodes[index].output[0]
        labels.append(f"{op} {name!r}")
    return labels


def name_bindings(mod: tvm.IRModule, records: list) -> tvm.IRModule:
    """``mod`` with ``main``'s bindings renamed ``node<index>_`` after their ONNX node."""
    main = mod["main"]
    order = _bindings(main)
    owner: dict = {}
    pending = []
    for binding in order:
        pending.append(binding.var)
        for index, (_, _, results) in enumerate(records):
            if any(binding.value.same_as(e) or binding.var.same_as(e) for e in results):
                for var in pending:
                    owner[var] = index
                pending = []
                break
    for binding in order:  # the importer's output aliases (gv = n12) name the same node
        if binding.var not in owner and isinstance(binding.value, relax.Var) and \
                binding.value in owner:
            owner[binding.var] = owner[binding.value]
    if owner:
        mod["main"] = _Renamer(owner).visit_expr(main)
    return mod


@relax.expr_functor.mutator
class _Renamer(relax.PyExprMutator):
    def __init__(self, owner: dict):
        super().__init__()
        self.owner = owner

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        index = self.owner.get(binding.var)
        if index is None:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        name = f"node{index}_"
        if isinstance(binding.var, relax.DataflowVar):
            new = self.builder_.emit(value, name_hint=name)
        else:
            new = self.builder_.emit_output(value, name_hint=name)
        self.set_var_remap(binding.var, new)


def nodes_of_names(names, labels: list[str]) -> list[str]:
    """The labels of the ONNX nodes whose bindings have these names (first-seen order)."""
    found = []
    for name in names:
        match = _NAME.match(str(name))
        if match and int(match.group(1)) < len(labels):
            label = labels[int(match.group(1))]
            if label not in found:
                found.append(label)
    return found


class KernelNodes:
    """Passes around the two fusion steps that fill ``kernels[primfunc] = [binding names]``.

    A fusion pass replaces each group of ``main``'s bindings by one call of a new function
    (the same function for identical groups), whose result gets a new name. Groups keep
    ``main``'s order, and a binding no fusion touches keeps its variable, so the new calls are
    aligned with the old bindings: a call of a function holding ``k`` bindings takes the next
    ``k`` old ones not yet taken (skipping those constant folding removed). :meth:`before`
    notes ``main`` before a fusion, :meth:`after` aligns it after; names flow through the
    epilogue fusion, then ``FuseOps``, then ``FuseTIR`` (which keeps the variables).
    """

    def __init__(self, kernels: dict):
        self.kernels = kernels
        self._names: dict = {}  # var of main -> binding names (the ONNX nodes) it stands for
        self._before: list = []

    def _names_of(self, var) -> list[str]:
        return self._names.get(var, [var.name])

    def absorb(self, var, originals) -> None:
        """``var`` now stands for the bindings ``originals`` (a rewrite replaced them)."""
        names = [n for v in originals for n in self._names_of(v)]
        self._names[var] = list(dict.fromkeys(names))

    def before(self) -> tvm.transform.Pass:
        @tvm.transform.module_pass(opt_level=0, name="NoteBindingsBeforeFusion")
        def note(mod, _ctx):
            self._before = [b for b in _bindings(mod["main"]) if _uses_vars(b.value)]
            return mod

        return note

    def after(self) -> tvm.transform.Pass:
        @tvm.transform.module_pass(opt_level=0, name="AlignBindingsAfterFusion")
        def align(mod, _ctx):
            old = self._before
            still = {b.var for b in _bindings(mod["main"])}
            taken = [False] * len(old)
            position = {b.var: i for i, b in enumerate(old)}
            cursor = 0
            for binding in _bindings(mod["main"]):
                if binding.var in position:  # untouched by this fusion
                    taken[position[binding.var]] = True
                    continue
                count = _held_bindings(mod, binding.value)
                if not count:
                    continue
                names: list[str] = []
                while count and cursor < len(old):
                    if not taken[cursor] and old[cursor].var not in still:
                        taken[cursor] = True
                        names.extend(self._names_of(old[cursor].var))
                        count -= 1
                    cursor += 1
                self._names[binding.var] = names
            return mod

        return align

    def record(self) -> tvm.transform.Pass:
        """After ``FuseTIR``: file the names under the PrimFunc each binding calls."""

        @tvm.transform.module_pass(opt_level=0, name="RecordKernelNodes")
        def record(mod, _ctx):
            for binding in _bindings(mod["main"]):
                callee = _callee(binding.value)
                if callee is not None:
                    self.kernels.setdefault(callee, []).extend(self._names_of(binding.var))
            return mod

        return record


def _uses_vars(expr) -> bool:
    """Whether ``expr`` reads a variable (constant-only bindings are folded away)."""
    found = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(1) if isinstance(
        e, relax.Var) else None)
    return bool(found)


def _held_bindings(mod: tvm.IRModule, value) -> int:
    """How many bindings the fused Relax function ``value`` calls holds (0 if none)."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar)):
        return 0
    func = mod[value.op]
    if not isinstance(func, relax.Function):
        return 0
    return len(_bindings(func))


def _bindings(func: relax.Function) -> list:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return []
    return [binding for block in body.blocks for binding in block.bindings]


def _callee(value) -> str | None:
    """The global function a binding calls (directly or through ``call_tir``), if any."""
    if not isinstance(value, relax.Call):
        return None
    if isinstance(value.op, tvm.ir.GlobalVar):
        return value.op.name_hint
    if isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.call_tir":
        target = value.args[0]
        return target.name_hint if isinstance(target, tvm.ir.GlobalVar) else None
    return None
