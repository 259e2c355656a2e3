#!/usr/bin/env bash
# Creates a fresh virtualenv, installs the project with its test extra, and runs the README's
# test command. Used by .ci/run; works the same by hand from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-$(mktemp -d)/venv}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q ".[test]"
"$VENV/bin/python" -m ruff check tvm_hybrid tests tutorials python
# The AVX2-only path (no AVX-512, no VNNI) of the kernels, whatever this host has: the ISA test
# files again as a Haswell would run them (TVM_HYBRID_HOST_CPU only takes features away).
TVM_HYBRID_HOST_CPU=haswell "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_int8.py tests/test_qdq.py tests/test_bf16.py tests/test_gemm_engine.py \
    tests/test_numerics.py tests/test_amx.py tests/test_conv_gemm.py tests/test_conv_epilogues.py \
    tests/test_attention.py tests/test_quantized_attention.py tests/test_attention_op.py \
    tests/test_qdq_conv.py tests/test_gemm_chain.py tests/test_depthwise_template.py \
    tests/test_gemm_tail.py tests/test_transposed_tail.py tests/test_weight_prefetch.py
# The README's test command (the fast default: cases marked slow are deselected):
"$VENV/bin/python" -m pytest -q
# The slow cases: the largest light CNNs of the ONNX conformance data, the zoo's largest models,
# MetaSchedule's own searches.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m slow
