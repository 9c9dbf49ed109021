"""Issue 65's MoE A/B: tsdev's whole fused-MoE layer (`moe.fused_moe_triton`: the alignment, both GEMMs, the
activations' quantization, the sum over k) beside vLLM's Triton `fused_moe_kernel` at the same shape, in one run on
one GPU, bf16 / FP8 per-channel / block-FP8 128x128.

The peer is never part of tsdev: `bash scripts/peer-vllm-moe.sh` puts vLLM's kernels (fused_moe_kernel,
write_zeros_to_output, _per_token_group_quant_fp8, imports reduced to torch and triton) into the git-ignored
.peer/vllm_moe/ as `vllm_kernels.py`, with vLLM's tuned JSON files under its configs/ (taken from the PyPI wheel of
the release this launch fits); pass another folder with --peer; carry it to the GPU. The
peer's side is its two GEMM launches with the config vLLM would pick (its file for this GPU, else the nearest GPU's
the same way tsdev's lookup goes, else vLLM's default), plus for FP8 its activation quantization: per token in torch
(vLLM runs a CUDA op) or per group of 128 with its Triton kernel. The alignment, the SiLU-and-mul and the sum vLLM
runs as CUDA ops are left out of its time (tsdev's alignment feeds both), so the comparison favours the peer.
Both sides replay from CUDA graphs, the same routing each replay (at one token its 8 experts' 75 MB of bf16
weights against the H100's 50 MB L2: part may stay cached, alike for both); the outputs are compared to each other.

    python3 benchmarks/moe_vs_peer.py                                       # Qwen3-30B-A3B's layer
    python3 benchmarks/moe_vs_peer.py --experts 256 --intermediate 2048 --hidden 7168 --tokens 1 16 64 256
"""
import argparse
import datetime
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from tsdev_kernels.ops import fp8, fp8_block, moe

E4M3_MAX = 448.0


def load_peer(folder: Path):
    spec = importlib.util.spec_from_file_location("vllm_kernels", folder / "vllm_kernels.py")
    if spec is None or not (folder / "vllm_kernels.py").exists():
        sys.exit(f"no {folder / 'vllm_kernels.py'}: run `bash scripts/peer-vllm-moe.sh` (on a machine with network; "
                 "then carry .peer), or pass --peer FOLDER")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_config(folder: Path, experts: int, intermediate: int, kind: str, tokens: int) -> tuple[dict, str]:
    """vLLM's config for this shape, kind and token count: its file for this GPU (H200s named NVIDIA_H200), else the
    sibling Hopper's, else its defaults."""
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    gpu = "NVIDIA_H200" if "H200" in gpu else gpu
    suffix = {"bf16": "", "fp8": ",dtype=fp8_w8a8", "block": ",dtype=fp8_w8a8,block_shape=[128,128]"}[kind]
    sibling = {"NVIDIA_H200": "NVIDIA_H100_80GB_HBM3", "NVIDIA_H100_80GB_HBM3": "NVIDIA_H200"}.get(gpu)
    for name in (gpu, sibling):
        path = folder / "configs" / f"E={experts},N={intermediate},device_name={name}{suffix}.json"
        if name and path.exists():
            table = {int(m): c for m, c in json.loads(path.read_text()).items() if m != "triton_version"}
            return table[min(table, key=lambda m: abs(m - tokens))], path.name
    if kind == "block":
        return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=32, num_warps=4,
                    num_stages=3), "vLLM's default"
    if tokens <= experts:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1), "vLLM's default"
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8), "vLLM's default"


def peer_gemm(peer, a, w, out, a_scale, w_scale, weights, align, top_k, cfg, kind, mul_weight):
    """One of vLLM's GEMMs: a [M, K] -> out [M, top_k, N] through w [E, N, K], as its invoke_fused_moe_kernel
    launches it."""
    sorted_ids, expert_ids, padded = align
    cfg = dict(cfg)
    bm, bn = cfg.pop("BLOCK_SIZE_M"), cfg.pop("BLOCK_SIZE_N")
    bk, group_m = cfg.pop("BLOCK_SIZE_K"), cfg.pop("GROUP_SIZE_M")
    launch = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    em = sorted_ids.numel()
    if a.shape[0] < bm:
        em = min(em, a.shape[0] * top_k * bm)
    block = kind == "block"
    if block:
        bk = min(bk, 128)
    n, k = w.shape[1], w.shape[2]
    s_asm, s_ask = (a_scale.stride(0), a_scale.stride(1) if block else 0) if a_scale is not None else (0, 0)
    s_bse, s_bsk, s_bsn = ((w_scale.stride(0), w_scale.stride(2) if block else 0, w_scale.stride(1))
                           if w_scale is not None else (0, 0, 0))
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    peer.fused_moe_kernel[grid](
        a, w, out, None, a_scale, w_scale, weights, sorted_ids, expert_ids, padded, n, k, em, weights.numel(),
        a.stride(0), a.stride(1), w.stride(0), w.stride(2), w.stride(1), out.stride(1), out.stride(2),
        s_asm, s_ask, s_bse, s_bsk, s_bsn, 0, 0,
        group_n=128 if block else 0, group_k=128 if block else 0, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=group_m, SPLIT_K=1, MUL_ROUTED_WEIGHT=mul_weight, top_k=top_k, compute_type=tl.bfloat16,
        use_fp8_w8a8=kind != "bf16", use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=kind == "fp8",
        HAS_BIAS=False, **launch)


def peer_quantize(peer, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's activation quantization: per token (its CUDA op's arithmetic, in torch) or per group of 128 (its Triton
    kernel)."""
    if kind == "fp8":
        scale = (x.float().abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1 / (E4M3_MAX * 512))
        return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], x.shape[1] // 128, dtype=torch.float32, device=x.device)
    peer._per_token_group_quant_fp8[(x.numel() // 128,)](x, q, s, 128, x.shape[1], x.stride(0), 1e-10, -E4M3_MAX,
                                                         E4M3_MAX, use_ue8m0=False, BLOCK=128, num_warps=1,
                                                         num_stages=1)
    return q, s


def peer_layer(peer, x, w13, w2, s13, s2, weights, ids, kind, cfg, experts):
    """vLLM's layer with tsdev's alignment: GEMM 1, SiLU-and-mul, GEMM 2 with the routing weights, the sum over k.
    Returns a function of no arguments per part: (gemms and quantization, everything)."""
    t, top_k = ids.shape
    inter = w2.shape[2]
    align = moe.moe_align_triton(ids, experts, cfg["BLOCK_SIZE_M"])
    flat_weights = weights.reshape(-1).contiguous()
    c1 = torch.empty(t, top_k, 2 * inter, dtype=x.dtype, device=x.device)
    c2 = torch.empty(t, top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)

    def gemm1():
        a, a_s = (x, None) if kind == "bf16" else peer_quantize(peer, x, kind)
        peer_gemm(peer, a, w13, c1, a_s, s13, flat_weights, align, top_k, cfg, kind, False)

    def gemm2():
        a, a_s = (act, None) if kind == "bf16" else peer_quantize(peer, act, kind)
        peer_gemm(peer, a, w2, c2, a_s, s2, flat_weights, align, 1, cfg, kind, True)

    def silu_and_mul():
        gate_up = c1.view(-1, 2 * inter)
        torch.mul(torch.nn.functional.silu(gate_up[:, :inter]), gate_up[:, inter:], out=act)

    def whole():
        gemm1()
        silu_and_mul()
        gemm2()
        return c2.sum(1)

    return (gemm1, gemm2), whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--kinds", nargs="+", default=["bf16", "fp8", "block"], choices=["bf16", "fp8", "block"])
    parser.add_argument("--peer", type=Path, default=Path(".peer/vllm_moe"),
                        help="the git-ignored folder with vLLM's kernels and configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_vs_peer.py times kernels on a CUDA GPU; none is visible")
    peer = load_peer(args.peer)
    E, K, I, H = args.experts, args.topk, args.intermediate, args.hidden
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") * I**-0.5).bfloat16()
    (q13, r13), (q2, r2) = fp8.quantize_fp8_rows(w13), fp8.quantize_fp8_rows(w2)
    (b13, bs13), (b2, bs2) = ([torch.stack(t) for t in zip(*(fp8_block.quantize_fp8_blocks(m) for m in w))]
                              for w in (w13, w2))
    ours_args = {"bf16": ((w13, w2), {}),
                 "fp8": ((q13, q2), dict(w13_scale=r13.squeeze(-1), w2_scale=r2.squeeze(-1))),
                 "block": ((b13, b2), dict(w13_scale=bs13, w2_scale=bs2, block=fp8_block.BLOCK))}
    peer_args = {"bf16": (w13, w2, None, None), "fp8": (q13, q2, r13, r2), "block": (b13, b2, bs13, bs2)}
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; E {E}, top {K}, I {I}, H {H}. Command: `python3 benchmarks/moe_vs_peer.py "
          f"{shlex.join(sys.argv[1:])}`\n")
    print("| kind | tokens | tsdev layer us | tsdev, the GEMMs quantizing inside us | vLLM GEMMs (+ quantization) us | "
          "vLLM whole us | tsdev / vLLM GEMMs | max rel diff | vLLM config |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    graphed = lambda fn: triton.testing.do_bench_cudagraph(fn) * 1e3  # noqa: E731
    for kind in args.kinds:
        (a13, a2), scales = ours_args[kind]
        for T in args.tokens:
            x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
            weights, ids = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
            weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
            cfg, source = peer_config(args.peer, E, I, kind, T)
            gemms, whole = peer_layer(peer, x, *peer_args[kind], weights, ids, kind, cfg, E)
            ours_us = graphed(lambda: moe.fused_moe_triton(x, a13, a2, weights, ids, **scales))
            inside_us = float("nan")  # block FP8: the GEMMs quantizing their own tiles (`quantize_inside`)
            if kind == "block":
                config = moe.moe_config(E, I, H, a13.dtype, T, device=x.device, block=fp8_block.BLOCK)
                inside_us = graphed(lambda: moe.fused_moe_triton(x, a13, a2, weights, ids, **scales,
                                                                 config=dict(config, quantize_inside=True)))
            peer_us = graphed(lambda: [gemm() for gemm in gemms])
            peer_whole_us = graphed(whole)
            ours = moe.fused_moe_triton(x, a13, a2, weights, ids, **scales).float()
            theirs = whole().float()
            diff = ((ours - theirs).abs().max() / theirs.abs().max()).item()
            print(f"| {kind} | {T} | {ours_us:.1f} | {inside_us:.1f} | {peer_us:.1f} | {peer_whole_us:.1f} | "
                  f"{ours_us / peer_us:.2f} | "
                  f"{diff:.1e} | {source} |", flush=True)


if __name__ == "__main__":
    main()
