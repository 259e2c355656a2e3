"""Microkernel families, one module each; every module here is imported (and so registered)
by :mod:`tvm_hybrid.microkernels`."""
