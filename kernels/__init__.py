"""Kernels for the runtime: one module per op family under `kernels.ops`.

Every op has a plain-torch reference (`*_ref`). The public function of each op
is the one the runtime calls; it picks the fastest implementation available for
its inputs (Triton on CUDA once it exists, the reference otherwise), so a kernel
plugs in without the runtime changing.
"""
