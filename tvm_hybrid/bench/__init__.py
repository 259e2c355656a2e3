"""The benchmark harness: workloads, peer runtimes, side-by-side comparisons, peak rates.

Not the compiler: what the CLI's ``bench``/``demo`` commands, the profile report's peak column,
``python/benchmarks/`` and the tests use to build workloads and measure against ONNX Runtime,
OpenVINO and PyTorch.
"""
