"""
Tuning inside the expert templates
==================================

Stock MetaSchedule searches a huge generic space: minutes per kernel, hours per model. The
expert GEMM template leaves only a few knobs per kernel: the microkernel (register tile), the
block sizes (which also set how the blocks are shared among threads) and the tile loop order.
``tvm_hybrid.tune`` searches exactly those, starting from the heuristic's choice, so that
tuning can only help and takes seconds to minutes.

This tutorial tunes a small MLP, shows the knob space and the records, compiles with the
records (nothing is measured then), and shows the command line and remote (RPC) measurement.
"""

# %%
# The knob space of one kernel
# ----------------------------
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import make_target
from tvm_hybrid.tuning import extract_tasks, load_records

mlp = workloads.mlp(32, (256, 512, 512, 64), name="mlp")
model, inputs = mlp.model, mlp.inputs
target = make_target("host")

tasks = extract_tasks(model, target)  # the fused kernels the GEMM template covers
for task in tasks:
    space = task.space
    heuristic = space.heuristic()
    print(f"{task.name}: {space.size()} configurations; the heuristic picks "
          f"{heuristic[0].describe()}")
    print("  one move away:", ", ".join(k[0].describe() for k in space.neighbours(heuristic)[:4]),
          "...")

# %%
# Tune
# ----
# ``trials`` counts measured configurations over all kernels. Every kernel measures the
# heuristic's configuration first; the rest are shared in proportion to FLOPs. The search moves
# from the best configurations so far to their neighbours (block sizes one divisor up or down,
# the other loop order, other microkernels). A winner is kept only if it beats the heuristic
# again in an interleaved re-measurement. The records file is rewritten after every round, so
# an interrupted run resumes where it stopped.
work_dir = Path(tempfile.mkdtemp(prefix="tvm_hybrid_tutorial_"))
start = time.perf_counter()
records = tvm_hybrid.tune(model, target, trials=12, work_dir=work_dir)
print(f"tuned in {time.perf_counter() - start:.1f} s -> {records}")

for task in load_records(records).tasks.values():
    info = task.summary()
    print(f"{info['name']}: {info['trials']} trials, heuristic {info['heuristic_ms']:.4f} ms, "
          f"best {info['best_ms']:.4f} ms, kept {info['kept']}")

# %%
# Compile with the records
# ------------------------
# MetaSchedule's ApplyDatabase replays each kernel's best trace; nothing is measured. Records
# made for another target are refused with a clear error.
tuned = tvm_hybrid.compile(model, target, tuning_records=records)
untuned = tvm_hybrid.compile(model, target)
np.testing.assert_allclose(tuned(**inputs), untuned(**inputs), rtol=1e-4, atol=1e-5)
print(f"untuned {untuned.benchmark(**inputs)['median_ms']:.3f} ms, "
      f"tuned {tuned.benchmark(**inputs)['median_ms']:.3f} ms")

try:
    tvm_hybrid.compile(model, {"kind": "llvm", "mcpu": "haswell"}, tuning_records=records)
except tvm_hybrid.TuningRecordsError as err:
    print("another target:", err)

shutil.rmtree(work_dir)  # the tutorial's records are not needed any more

# %%
# MetaSchedule's own search over the same knobs
# ---------------------------------------------
# ``search="evolutionary"`` hands the template to MetaSchedule as its space generator: one
# design space per (microkernel, loop order), whose block sizes are ``sample_perfect_tile``
# decisions that only ``MutateTileSize`` changes, ranked by a cost model (``cost_model="random"``,
# or ``"xgb"`` with the optional xgboost package). ``others="metaschedule"`` also tunes the
# kernels no template covers (softmax, layer norm) with MetaSchedule's stock rules.
# ``tvm_hybrid.tuning.template_space(target)`` is that space generator, for your own
# ``ms.tune_tasks`` calls.

# %%
# The command line
# ----------------
# The same, from a shell (a progress bar shows the task, the trials and the best time so far)::
#
#     tvm-hybrid tune model.onnx --trials 64 -o records.json
#     tvm-hybrid compile model.onnx -o model.so --tuning-records records.json
#
# Measuring on other machines
# ---------------------------
# With TVM's own RPC tracker and servers, the candidates are compiled here and timed there::
#
#     python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port 9190          # once
#     python -m tvm.exec.rpc_server --tracker HOST:9190 --key my-xeon    # on each device
#     tvm-hybrid tune model.onnx --trials 64 -o records.json \
#         --target '{"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16}' \
#         --rpc-tracker HOST:9190 --rpc-key my-xeon
#
# (``tvm_hybrid.tune(..., rpc=tvm_hybrid.tuning.RPCSettings("HOST:9190", "my-xeon"))`` in
# Python.) The tracker needs the ``tornado`` package: ``pip install "tvm_hybrid[rpc]"``.
