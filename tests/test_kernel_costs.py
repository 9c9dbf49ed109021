"""Bytes and FLOPs per call, declared beside each op family's checks (`KernelCheck.cost`), against a count made
here from the check's own inputs and its reference's outputs: every tensor read and written once -- of a table or pool
only the rows the call reaches (the cos/sin rows at the positions, each sequence's pages, the experts routed to) --
and 2·M·N·K per matmul; and the share of the limit."""
import dataclasses
import math

import pytest
import torch

from tsdev_kernels import checks
from tsdev_kernels.ops import (activation, attention, fp8, fp8_block, linear, mla, moe, norm, rope,  # noqa: F401
                               sampling)

SERVING = checks.Serving(tokens=(1, 4, 24), hidden=256, intermediate=256, dtype=torch.float32, q_heads=4, kv_heads=2,
                         head_dim=32, page_size=16, max_context=64, vocab=512, experts=8, top_k=2, moe_intermediate=64,
                         device="cpu")
SERVINGS = [SERVING, dataclasses.replace(SERVING, fp8=True, fp8_blocks=True, kv_fp8=True),
            dataclasses.replace(SERVING, latent_dim=64, rope_dim=16),
            dataclasses.replace(SERVING, latent_dim=64, rope_dim=16, kv_fp8=True),
            dataclasses.replace(SERVING, device="cuda"),  # the GPU-only checks' shapes (drawn here on the CPU)
            dataclasses.replace(SERVING, device="cuda", dtype=torch.bfloat16, latent_dim=512, rope_dim=64),
            dataclasses.replace(SERVING, device="cuda", dtype=torch.bfloat16, latent_dim=512, rope_dim=64, kv_fp8=True)]
GPU_ONLY = {"rms_norm_gluon", "fused_add_rms_norm_gluon", "silu_and_mul_cute"}
ELEMENTWISE = {"silu_and_mul", "silu_and_mul_cute", "rms_norm", "fused_add_rms_norm", "rms_norm_gluon",
               "fused_add_rms_norm_gluon", "rope", "qk_norm_rope", "token_logprobs", "sample", "sample_top_k",
               "apply_penalties", "fp8_token_groups"}


def size(*values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def outputs(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def pages_read(cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, page_size: int) -> int:
    """The bytes of each sequence's rows of a paged pool, gathered through its page table."""
    total = 0
    for row, n in zip(table, lens.tolist()):
        rows = cache[row[: -(-n // page_size)].long()].flatten(0, 1)[:n]
        total += size(rows)
    return total


def causal_pairs(cu: torch.Tensor, lens: torch.Tensor) -> int:
    """(query row, key) pairs under the causal mask, counted from the mask itself."""
    pairs = 0
    for q, n in zip((cu[1:] - cu[:-1]).tolist(), lens.tolist()):
        pairs += int(torch.ones(q, n).tril(diagonal=n - q).sum())
    return pairs


def counted(check: checks.KernelCheck, args: tuple) -> tuple[int, int]:
    """(bytes, FLOPs) of one call, counted from the arguments and the reference's outputs."""
    op, out = check.op, outputs(check.reference(*args))
    if op.startswith("paged_"):
        q, k_cache, v_cache, cu, lens, table, k, v, slots, order, _ = args
        page = k_cache.shape[1]
        stored = (k.numel() + v.numel()) * k_cache.element_size()
        read = pages_read(k_cache, table, lens, page) + pages_read(v_cache, table, lens, page)
        return (size(q, cu, lens, table, k, v, slots, order, *out) + stored + read,
                4 * causal_pairs(cu, lens) * q.shape[1] * q.shape[2])
    if op.startswith("mla_"):
        q, cache, cu, lens, table, rows, slots, order, _, latent = args
        read = pages_read(cache, table, lens, cache.shape[1])
        stored = rows.numel() * cache.element_size()
        qk, pv = q.shape[-1], latent
        return (size(q, cu, lens, table, rows, slots, order, *out) + stored + read,
                2 * causal_pairs(cu, lens) * q.shape[1] * (qk + pv))
    if op.startswith("fused_moe"):
        x, w13, w2, weights, ids, *scales = args
        used = ids.flatten().unique().long()
        experts = [w13[used], w2[used], *(s[used] for s in scales)]
        tokens, top_k = ids.shape
        return (size(x, weights, ids, *experts, *out),
                tokens * top_k * (2 * w13.shape[1] * w13.shape[2] + 2 * w2.shape[1] * w2.shape[2]))
    if op in ("rope", "qk_norm_rope"):
        q, k, q_weight, k_weight, positions, cache = args
        norms = (q_weight, k_weight) if op == "qk_norm_rope" else ()
        return size(q, k, positions, cache[positions], *norms, *out), 0
    if op == "fp8_token_groups":
        (x,) = args
        return size(x, *fp8_block.quantize_fp8_token_groups(x)), 0
    if op == "fp8_block_linear":
        x, weight, scale_inv = args[:3]
        return size(*args, *out), 2 * x.shape[0] * weight.shape[0] * x.shape[1]
    read = size(*args, *out)
    if op in ELEMENTWISE:
        return read, 0
    x, weight = args[0], args[-1] if op == "gemv_norm_gate_up" else args[1]
    return read, 2 * x.shape[0] * weight.shape[0] * x.shape[1]


def cases():
    """op -> (check, a shape it is drawn at), the Hopper-only checks' (the Gluon MLA decode kernel) as on Hopper."""
    found = {}
    hopper, mla.on_hopper = mla.on_hopper, lambda device=None: True
    try:
        drawn = [(check, list(check.shapes(serving))) for check in checks.declared() for serving in SERVINGS]
    finally:
        mla.on_hopper = hopper
    for check, shapes in drawn:
        if shapes and check.op not in found:
            found[check.op] = (check, shapes[-1])
    return found


CASES = cases()


def test_every_declared_op_declares_its_cost_and_is_reached_here():
    declared = {c.op for c in checks.declared()}
    assert set(CASES) == declared  # every op has a shape at one of the servings above
    assert [op for op, (check, _) in CASES.items() if check.cost is None] == []


@pytest.mark.parametrize("op", sorted(CASES))
def test_the_declared_cost_is_what_the_call_reads_writes_and_multiplies(op):
    check, shape = CASES[op]
    dtype = torch.bfloat16 if torch.bfloat16 in check.tolerance else next(iter(check.tolerance))
    args = check.inputs(tuple(shape), dtype, "cpu", torch.Generator().manual_seed(3))
    declared_bytes, declared_flops = check.cost(*args)
    want_bytes, want_flops = counted(check, args)
    assert 0.9 * want_bytes <= declared_bytes <= 1.1 * want_bytes, (op, shape, declared_bytes, want_bytes)
    assert declared_flops == pytest.approx(want_flops, rel=0.01), (op, shape)
    assert (declared_flops == 0) == (op in ELEMENTWISE)


def test_the_share_of_the_limit_is_the_larger_of_memory_and_compute_time_over_the_time_taken():
    h100, h200 = checks.limits_of("NVIDIA H100 80GB HBM3"), checks.limits_of("NVIDIA H200")
    assert (h100.bandwidth, h200.bandwidth, h100.bf16, h100.fp8) == (3.0e12, 4.2e12, 989e12, 1979e12)
    assert checks.limits_of("NVIDIA A100-SXM4-80GB") is None  # unknown: no share rather than a wrong one
    # rms_norm [256 x 1024] bf16: 1 MiB in, 1 MiB out (and the weight): at 4.2 TB/s 0.50 µs
    share, bound = checks.share_of(2 * 256 * 1024 * 2 + 2048, 0, 0.61, h200)
    assert bound == "bandwidth" and share == pytest.approx((2 * 256 * 1024 * 2 + 2048) / 4.2e12 / 0.61e-6)
    share, bound = checks.share_of(10 ** 6, 2 * 4096 ** 3, 200.0, h100, "fp8")
    assert bound == "fp8 tensor cores" and share == pytest.approx(2 * 4096 ** 3 / 1979e12 / 200e-6)
    assert math.isclose(checks.share_of(3 * 10 ** 6, 0, 1.0, h100)[0], 1.0)


def test_a_timing_carries_the_cost_of_the_inputs_it_timed():
    """The share of the limit divides the bytes of the very inputs timed (drawn once, in time_call) by their time."""
    check = next(c for c in checks.declared() if c.op == "rms_norm")
    shape = tuple(check.shapes(SERVING)[0])
    timing = checks.time_call(check, shape, torch.float32, "cpu", calls=1, repeats=1)
    costs = [check.cost(*args) for args in checks.timing_inputs(check, shape, torch.float32, "cpu")]
    assert timing.how == "wall" and timing.us > 0
    assert timing.cost == (round(sum(c[0] for c in costs) / len(costs)), round(sum(c[1] for c in costs) / len(costs)))
    assert timing.cost[0] > 0
