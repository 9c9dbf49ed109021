"""Kernels for the runtime: one module per op family under `tsdev_kernels.ops`.

See `tsdev_kernels.ops` for how each public op picks its Triton kernel or its torch reference.
"""
import os

# Triton 3.9 fuses a*b+c into FMAs unless told otherwise, and warns (at every first compile) that 3.10 will not: the
# kernels' numerics -- their checks' tolerances, bit-identical reverts, the golden tokens -- were measured with fusion
# on, so it stays on, said explicitly, until the other way is measured. A user's own setting wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
