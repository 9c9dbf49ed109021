"""Kernels for the runtime: one module per op family under `tsdev_kernels.ops`.

See `tsdev_kernels.ops` for how each public op picks its Triton kernel or its torch reference.
"""
