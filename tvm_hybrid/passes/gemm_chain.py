"""``FuseGemmChains``: consecutive GEMM layers (an MLP) into one kernel, the paper's coarse-grain
fusion of MLP chains.

After ``FuseOps`` every packed GEMM and its epilogue is its own fused function (an fp32
``matmul`` with the epilogue :class:`~.fuse_epilogues.FuseGemmEpilogues` grouped, an integer
GEMM with its requantization to the next layer's ``u8``), so an MLP of ``L`` layers is ``L``
kernels: ``L`` parallel loops (each a fork and a
join of the thread pool) and ``L`` VM calls, every intermediate written to memory by one loop
and read back by the next. This pass merges a chain of such functions, where each layer's
output feeds only the next layer's GEMM, into one function; the chain template
(``schedules/gemm_chain.py``) then runs all layers in one parallel loop over row blocks, so a
block's intermediate rows stay in the core's caches (and the threads never wait on each other
between layers).

The cost model (:func:`chain_wins`): every core then reads every layer's weights, not its
share, so a chain is formed only while the weights stay in the caches (a core's L2 or half
the shared L3) and the batch is small enough that the per-layer kernels' forks, joins and
calls are a visible share, with a few rows per thread at least (more where weights beyond the
L2, or within it beside more layers' weights that evict them between calls, stream from an
Intel L3, :func:`streamed_rows_per_thread`), and each layer's row block
keeps a register tile nearly as good as its per-layer kernel's (``thin_tiles``).
``TVM_HYBRID_GEMM_CHAINS`` (``auto``, ``off``, ``all``) overrides it, to measure one against
the other.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tvm
from tvm import DataType, relax
from tvm.target import Target

from ..errors import OptionError
from ..host import CacheSizes, cache_sizes
from ..schedules.gemm.heuristics import target_threads
from ..schedules.gemm_chain import ChainShape, chain_variants, thin_tiles
from .packed_gemm import KERNEL_NAMES
from .relax_rewrite import static_shape

#: The Composite name of a merged chain (what the profile report and tests see).
CHAIN_COMPOSITE = "hybrid.gemm_chain"
#: The environment variable choosing the mode (:func:`chain_mode`).
CHAINS_VARIABLE = "TVM_HYBRID_GEMM_CHAINS"
CHAIN_MODES = ("auto", "off", "all")
#: Fewest rows per thread a chain is formed for.
MIN_ROWS_PER_THREAD = 4
#: Most rows a chain is formed for (larger batches keep the per-layer kernels' N split).
MAX_CHAIN_ROWS = 256
#: Fewest rows per thread for a chain whose weights fit the L2 share while those of the
#: chainable GEMM layers around it exceed it (``chain_wins``). MLP_2's last two layers (0.65
#: MB of its 2.2 MB of int8 weights) chained at batch 8, 4 rows per thread, ran 0.91-0.93x as
#: fast as their per-layer kernels on a 2-core Emerald Rapids VM, the model 1.098x faster
#: unchained (31 of 31 rounds, same process); its fp32 chains of the last layers at batches
#: 16-32 (8-16 rows per thread) measured 0.97-1.03x either way and are kept.
EVICTED_ROWS_PER_THREAD = 8
#: Share of a core's L2 the chain's weights may take (each core streams all of them).
_L2_SHARE = 0.75
#: Fewest rows per thread a chain is formed for when its weights exceed the L2 share and
#: stream from an Intel L3 to every core (:func:`streamed_rows_per_thread`).
INTEL_L3_ROWS_PER_THREAD = 32


@dataclasses.dataclass
class _Layer:
    binding: relax.VarBinding
    func: relax.Function
    rows: int
    shape: tuple[int, int, int]  # (n, k, panel) as packed
    dtype: str  # the GEMM's A operand: "float32", "uint8" (VNNI) or "int16" (AVX2 s16)
    weight_bytes: int


#: The packed GEMM kernels a chain takes, by the dtype of their ``A`` operand.
_CHAINED = {KERNEL_NAMES["float32"]: ("float32",),
            KERNEL_NAMES["uint8"]: ("uint8", "int16")}


def _layer(mod: tvm.IRModule, binding: relax.Binding) -> _Layer | None:
    """The fused GEMM layer (fp32 or integer) ``binding`` calls, with a 2-D input of unpadded
    rows, else None."""
    if not isinstance(binding, relax.VarBinding):
        return None
    call = binding.value
    if not (isinstance(call, relax.Call) and isinstance(call.op, relax.GlobalVar)):
        return None
    func = mod[call.op]
    if not (isinstance(func, relax.Function) and (func.attrs or {}).get("Primitive")):
        return None
    body = func.body
    if not (isinstance(body, relax.SeqExpr) and len(body.blocks) == 1 and body.blocks[0].bindings):
        return None
    first = body.blocks[0].bindings[0].value
    if not (isinstance(first, relax.Call) and first.op.same_as(tvm.ir.Op.get("relax.call_tir"))):
        return None
    kernel, args = first.args[0], first.args[1].fields
    if not (len(args) >= 2 and args[0].same_as(func.params[0])):
        return None
    x_shape, packed, out_shape = (static_shape(e) for e in (args[0], args[1], binding.var))
    if x_shape is None or out_shape is None or packed is None or len(packed) not in (3, 4):
        return None
    if len(x_shape) != 2 or len(out_shape) != 2 or x_shape[0] != out_shape[0]:
        return None
    dtype = str(args[0].ty.dtype)
    if dtype not in _CHAINED.get(kernel.name_hint.rstrip("0123456789"), ()):
        return None
    panels, groups, panel = packed[:3]
    k = groups * (packed[3] if len(packed) == 4 else 1)
    weights = sum(int(np.prod(shape)) * _itemsize(a)
                  for a in call.args[1:] if (shape := static_shape(a)) is not None)
    return _Layer(binding, func, x_shape[0], (panels * panel, k, panel), dtype, weights)


def _itemsize(expr: relax.Expr) -> int:
    return DataType(str(expr.ty.dtype)).bits // 8


def chain_wins(rows: int, weight_bytes: int, caches: CacheSizes, threads: int,
               streamed_rows: int = MIN_ROWS_PER_THREAD,
               model_weight_bytes: int | None = None) -> bool:
    """The cost model: chain ``rows``-row layers whose weights total ``weight_bytes``.

    At least :data:`MIN_ROWS_PER_THREAD` rows per thread (thinner blocks would run on thin
    register tiles, while the per-layer kernels split ``N`` over the cores), at most
    :data:`MAX_CHAIN_ROWS` rows (measured from 4 rows per thread up to there on 2 cores:
    1.03-1.40x over the per-layer kernels, ``python/benchmarks/mlp_chain.py``), and the
    weights within a core's L2 or half the L3, since every core reads all of them (from
    memory they would cost each core the whole stream). Weights beyond the L2 share stream
    from the L3 to every core on each call: then at least ``streamed_rows`` rows per thread
    (:func:`streamed_rows_per_thread`). A chain's weights within that share also come from
    the L3 where the chainable GEMM layers around it (``model_weight_bytes``: those of its
    dataflow block, the chain's included) exceed it, their weights evicting the chain's
    between calls: there the chain needs :data:`EVICTED_ROWS_PER_THREAD` rows per thread, or
    else the streamed case's conditions (``streamed_rows`` rows per thread, weights within
    half the L3)."""
    if not MIN_ROWS_PER_THREAD * threads <= rows <= MAX_CHAIN_ROWS:
        return False
    share = _L2_SHARE * caches.l2
    if weight_bytes <= share and (model_weight_bytes is None or model_weight_bytes <= share
                                  or rows >= EVICTED_ROWS_PER_THREAD * threads):
        return True
    return weight_bytes <= caches.l3 // 2 and rows >= streamed_rows * threads


def streamed_rows_per_thread(target: Target) -> int:
    """Fewest rows per thread for a chain whose weights stream from the L3 (``chain_wins``).

    A chain makes every core read all the weights, the per-layer kernels each core its share.
    From an AMD Zen L3 that costs little: MLP_2 (8.8 MB of fp32 weights, 2.2 MB in int8)
    chained at batch 8 ran 1.06x (fp32) and 1.18x (QDQ) faster than its per-layer kernels on
    a 2-core Zen 4. From an Intel server L3 a core reads far slower: on a 2-core Emerald Rapids
    VM the same chains ran 0.75x and 0.54x as fast at batch 8, 0.93x and 0.79x at batch 24,
    0.98x and 1.03x at batch 32, and 1.10x and 1.05x at batch 64 (``mlp_chain.py --batches
    8,16,24,32,64``): :data:`INTEL_L3_ROWS_PER_THREAD` rows per thread there. Targets named
    for AMD cores (``znver*``) take :data:`MIN_ROWS_PER_THREAD`, all others the Intel bar."""
    mcpu = str(target.attrs.get("mcpu", ""))
    return MIN_ROWS_PER_THREAD if mcpu.startswith("znver") else INTEL_L3_ROWS_PER_THREAD


def chain_mode(value: str | None = None) -> str:
    """The chain mode ``value``, else :data:`CHAINS_VARIABLE`'s: ``"auto"`` (default: the
    cost model decides), ``"off"`` (per-layer kernels only) or ``"all"`` (every chain the
    template can take); :class:`OptionError` for anything else."""
    given = value if value is not None else \
        os.environ.get(CHAINS_VARIABLE, "").strip().lower() or "auto"
    if given not in CHAIN_MODES:
        source = "mode" if value is not None else CHAINS_VARIABLE
        raise OptionError(f"{source} must be one of {', '.join(CHAIN_MODES)}, got {given!r}")
    return given


@tvm.transform.module_pass(opt_level=0, name="FuseGemmChains")
class FuseGemmChains:
    """Merge chains of fused GEMM layers (fp32 or integer: VNNI, AVX2 s16 or ``vpmaddubsw``)
    into one function each, before ``FuseTIR`` (module docstring). bf16 layers and layers
    the GEMM template puts on AMX tiles stay on their own.

    Parameters
    ----------
    target
        The CPU target (its core count); the host's caches size the chains.
    mode
        ``"auto"`` (the cost model), ``"off"`` or ``"all"`` (every chain the template can
        take, to measure against the per-layer kernels); None reads :data:`CHAINS_VARIABLE`.
    recorder
        A :class:`~tvm_hybrid.kernel_info.KernelRecorder`: a chain's kernel is attributed the
        ONNX nodes of all its layers.
    """

    def __init__(self, target: Target, mode: str | None = None, recorder=None):
        self.target = target
        self.recorder = recorder
        self.threads = target_threads(target)
        self.caches = cache_sizes()
        self.mode = chain_mode(mode)
        self.streamed_rows = streamed_rows_per_thread(target)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.mode == "off":
            return mod
        count = 0
        builder = relax.BlockBuilder(mod)
        updates = {}
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or (func.attrs or {}).get("Primitive"):
                continue
            blocks = []
            changed = False
            for block in func.body.blocks:
                if isinstance(block, relax.DataflowBlock):
                    block, merged, count = self._block(mod, builder, block, count)
                    changed |= merged
                blocks.append(block)
            if changed:
                body = relax.SeqExpr(blocks, func.body.body)
                updates[gvar] = relax.Function(func.params, body, func.ret_ty, func.is_pure,
                                               func.attrs, func.span)
        if not count:
            return mod
        mod = builder.get()
        for gvar, func in updates.items():
            mod[gvar] = func
        return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(mod))

    def _block(self, mod, builder, block: relax.DataflowBlock, count: int):
        uses = relax.analysis.udchain(block)
        layers = {b.var: _layer(mod, b) for b in block.bindings}
        # next_of[v]: the layer that is the only user of layer v's output, as its GEMM input.
        next_of = {}
        for var, layer in layers.items():
            if layer is None or not isinstance(var, relax.DataflowVar):
                continue
            users = list(uses.get(var, []))
            if len(users) != 1 or layers.get(users[0]) is None:
                continue
            user = layers[users[0]]
            call = user.binding.value
            if call.args[0].same_as(var) and not any(a.same_as(var) for a in call.args[1:]) \
                    and user.rows == layer.rows:
                next_of[var] = users[0]
        heads = [v for v in next_of if v not in set(next_of.values())]
        # Every chainable layer's weights: between calls they evict a chain's.
        block_weights = sum(layer.weight_bytes for layer in layers.values() if layer is not None)
        replace, drop = {}, set()
        for head in heads:
            chain = [head]
            while chain[-1] in next_of:
                chain.append(next_of[chain[-1]])
            members = [layers[v] for v in chain]
            chosen = self._longest_winning(members, block_weights)
            if len(chosen) < 2:
                continue
            gvar, args = self._merge(mod, builder, chosen, count)
            count += 1
            last = chosen[-1].binding
            replace[last.var] = relax.VarBinding(last.var, relax.Call(gvar, args))
            drop.update(layer.binding.var for layer in chosen[:-1])
            if self.recorder is not None:
                self.recorder.absorbed(last.var, [layer.binding.var for layer in chosen])
        if not replace:
            return block, False, count
        bindings = [replace.get(b.var, b) for b in block.bindings if b.var not in drop]
        return relax.DataflowBlock(bindings, block.span), True, count

    def _longest_winning(self, members: list[_Layer], block_weights: int) -> list[_Layer]:
        """The first run of two or more layers the template can take and the cost model
        accepts (in ``"all"`` mode: the template alone)."""
        chosen: list[_Layer] = []
        for layer in members:
            candidate = [*chosen, layer]
            if self._accepts(candidate, block_weights):
                chosen = candidate
            elif len(chosen) >= 2:
                break
            else:
                chosen = [layer]
        return chosen

    def _accepts(self, layers: list[_Layer], block_weights: int) -> bool:
        if len(layers) < 2:
            return True
        shape = ChainShape(layers[0].rows, tuple(layer.shape for layer in layers),
                           tuple(layer.dtype for layer in layers))
        variants = chain_variants(shape, self.target)
        if not variants:
            return False
        if self.mode == "all":
            return True
        weights = sum(layer.weight_bytes for layer in layers)
        return (chain_wins(shape.m, weights, self.caches, self.threads, self.streamed_rows,
                           block_weights)
                and not thin_tiles(shape, variants[0], self.target))

    @staticmethod
    def _merge(mod: tvm.IRModule, builder: relax.BlockBuilder, layers: list[_Layer], index: int):
        """Add one function computing ``layers`` in order; return it and its arguments."""
        params, args, body_args = [], [], []
        previous = None
        for n, layer in enumerate(layers):
            call = layer.binding.value
            inner = []
            for i, (param, arg) in enumerate(zip(layer.func.params, call.args)):
                if n and i == 0:
                    inner.append(previous)
                    continue
                var = relax.Var(f"l{n}_{param.name}", param.ty)
                params.append(var)
                args.append(arg)
                inner.append(var)
            previous = relax.Var(f"layer{n}", layer.binding.var.ty)
            body_args.append((call.op, inner, previous))
        bindings = [relax.VarBinding(out, relax.Call(op, inner)) for op, inner, out in body_args]
        name = f"fused_hybrid_gemm_chain{index}"
        func = relax.Function(params, relax.SeqExpr([relax.DataflowBlock(bindings)], previous),
                              layers[-1].binding.var.ty)
        func = func.inline_functions({op: mod[op] for op, _, _ in body_args})
        func = func.with_attrs({"Composite": CHAIN_COMPOSITE, "Primitive": True})
        gvar = builder.add_func(builder.normalize(func), name)
        return gvar, args
