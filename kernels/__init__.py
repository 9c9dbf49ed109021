"""Kernels for the runtime: one module per op family under `kernels.ops`.

See `kernels.ops` for how each public op picks its Triton kernel or its torch reference.
"""
