"""Weight-loading bandwidth: plain (safetensors, then a copy per tensor) vs pinned (reader threads fill a
page-locked staging buffer, copied to the GPU asynchronously while the next part is read).

    python3 benchmarks/load_weights.py                               # the default model (Qwen3-0.6B shape, 1.2 GB)
    python3 benchmarks/load_weights.py --synthetic-8b /tmp/qwen3-8b  # a 16 GB Qwen3-8B-shaped checkpoint, written once
    python3 benchmarks/load_weights.py --slot-mib 64 256 1024 --threads 4 8 16   # sweep the staging shape

Each round loads plain, then pinned (once per staging shape), into the same model; the first round may
read from disk, the later ones from the page cache (`--cold`: each load reads the disk). The pinned load is checked bit
for bit against the plain one. Ratios are from the same run (docs/benchmarks.md's rule: a baseline beside the change).
"""
import argparse
import cProfile
import json
import math
import os
import pstats
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from tsdev_runtime.config import ModelConfig, parse_size
from tsdev_runtime.models import build_model
from tsdev_runtime.weights import pinned
from tsdev_runtime.weights.default_model import default_model_dir
from tsdev_runtime.weights.loader import load_weights

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
SHARD_BYTES = 4 << 30
DEFAULT_SLOT_BYTES = pinned.SLOT_BYTES


def write_synthetic(out: Path, shape: dict) -> None:
    """A Qwen3 checkpoint of `shape` in bf16 (untied lm_head), sharded like Hugging Face's; the values are
    slices of one random pool at per-tensor offsets (fast to make, and no two tensors alike)."""
    if (out / "config.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (shape["vocab_size"], h), "lm_head.weight": (shape["vocab_size"], h),
              "model.norm.weight": (h,)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    pool = (torch.randn(1 << 26, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    shards, current, size = [], {}, 0
    for name, s in shapes.items():
        n = math.prod(s)
        if size and size + 2 * n > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = s, size + 2 * n
    shards.append(current)
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, s in names.items():
            n, offset = math.prod(s), zlib.crc32(name.encode()) % pool.numel()
            tensors[name] = pool.roll(offset).repeat(-(-n // pool.numel()))[:n].view(s)
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        print(f"wrote {file} ({sum(t.numel() for t in tensors.values()) * 2 / 1e9:.1f} GB)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=False, torch_dtype="bfloat16", **shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: marks the checkpoint complete


def evict_page_cache(model_dir: Path) -> None:
    """Drop the checkpoint's clean pages from the page cache (no root needed), so the next load reads the disk."""
    for path in model_dir.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cuda_model(model_dir: Path):
    config = ModelConfig.from_dir(model_dir)
    return build_model(config, "cuda", getattr(torch, config.torch_dtype))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def identical(model, reference: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p.detach().reshape(-1).view(torch.uint8), reference[n].reshape(-1).view(torch.uint8))
               for n, p in model.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic-8b", type=Path, metavar="DIR",
                        help="write (once) and load a 16 GB Qwen3-8B-shaped checkpoint")
    parser.add_argument("--model", type=Path, help="a checkpoint directory instead of the default model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-limit", default="16GiB", help="--load-memory-limit")
    parser.add_argument("--slot-mib", type=int, nargs="*", default=[0], help="staging slot sizes; 0: the default")
    parser.add_argument("--threads", type=int, nargs="*", default=[pinned.READ_THREADS])
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions of the last pinned load")
    parser.add_argument("--cold", action="store_true",
                        help="evict the checkpoint from the page cache before every load (posix_fadvise DONTNEED)")
    args = parser.parse_args()
    if args.synthetic_8b:
        begin = time.perf_counter()
        write_synthetic(args.synthetic_8b, QWEN3_8B)
        print(f"checkpoint ready in {time.perf_counter() - begin:.1f} s", flush=True)
    model_dir = args.model or args.synthetic_8b or default_model_dir("cuda")
    limit = parse_size(args.memory_limit)
    model = cuda_model(model_dir)
    print(f"{model_dir}: {sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9:.2f} GB of parameters "
          f"on {torch.cuda.get_device_name()}", flush=True)
    reference, best, weights = None, {}, None
    cold = evict_page_cache if args.cold else lambda _: None
    for r in range(args.rounds):
        cold(model_dir)
        if weights is None:
            weights = load_weights(model, model_dir, "plain")
            report = weights.report
        else:
            report = weights.load(model_dir, "plain")
        print(f"round {r + 1} {report}", flush=True)
        best["plain"] = max(best.get("plain", 0.0), report.gb_per_s)
        reference = reference or snapshot(model)
        for slot_mib in args.slot_mib:
            for threads in args.threads:
                pinned.SLOT_BYTES, pinned.READ_THREADS = (slot_mib << 20) or DEFAULT_SLOT_BYTES, threads
                for p in model.parameters():
                    p.data.zero_()
                cold(model_dir)
                report = weights.load(model_dir, "pinned", memory_limit=limit)
                same = "identical" if identical(model, reference) else "DIFFERENT FROM PLAIN"
                print(f"round {r + 1} {report}; {same}", flush=True)
                key = f"pinned {pinned.SLOT_BYTES >> 20} MiB slots x {threads} threads"
                best[key] = max(best.get(key, 0.0), report.gb_per_s)
    if args.profile:
        profiled = cProfile.Profile()
        profiled.runcall(weights.load, model_dir, "pinned", memory_limit=limit)
        pstats.Stats(profiled).sort_stats("tottime").print_stats(15)
    print("best of the rounds:")
    for key, gbps in best.items():
        print(f"  {key}: {gbps:.1f} GB/s ({gbps / best['plain']:.2f}x plain)")


if __name__ == "__main__":
    main()
