"""The decode step of each model shape tsdev serves (random bf16 weights) against the time to read its weights once.

    python3 benchmarks/model_shapes.py                     # llama-3.2-1b, qwen2.5-1.5b, qwen3-0.6b at batch 1 and 256
    python3 benchmarks/model_shapes.py --shapes llama-3.2-1b --batch-sizes 1 8 --context 2048 --iters 50
    python3 benchmarks/model_shapes.py --shapes qwen3-30b-a3b-4l --batch-sizes 1 64 256   # MoE: 4 of 48 layers
    python3 benchmarks/model_shapes.py --shapes qwen3-8b --fp8-blocks --iters 30   # bf16 and block-FP8 (~26 GB)

Each shape's checkpoint is written on first use under `--dir` in the Hugging Face layout: config.json with the
model's `architectures`, a tokenizer of its vocabulary size (`build_tokenizer`), model.safetensors under the Hugging
Face tensor names (Llama: no q_norm / k_norm; Qwen2: q/k/v biases; tied embeddings stored once as
model.embed_tokens.weight), std 1/sqrt(fan_in) matrices as the default model's. qwen3-0.6b is the default model's
own checkpoint. The engine is built on it (`LLMEngine(EngineConfig(model=DIR, device="cuda", ...))`) and its decode
step timed as benchmarks/decode_step.py's "engine" column (`engine_step_time`): the steady-state `LLMEngine.step`
while `batch` requests decode, CUDA graphs and async scheduling, `--context` tokens of context on average.

floor: every weight read once per step (each parameter once: the tied embedding is the logits' weight) at 4.8 TB/s
(H200 HBM) and at the copy bandwidth measured in the run (~4.3 TB/s achievable); "step / floor" is against the
latter. A mixture of experts reads only the experts its tokens chose: its floor counts, per sparse layer, the
experts a uniform routing of `batch` tokens touches on average, E * (1 - (1 - k/E)^batch) (8 at batch 1, ~124 of 128
at 64 for Qwen3-30B-A3B), and of an untied embedding table only the batch's rows (decode_step.py's
`unread_weight_bytes`, which its floor uses too). qwen3-30b-a3b-4l is Qwen3-30B-A3B's shape (hidden 2048, 128
experts top 8, expert intermediate 768, 32/4 heads of 128) with 4 of its 48 layers and tied embeddings (6.1 GB to
write): per-layer numbers are what matter. qwen3-8b is Qwen3-8B's shape, all 36 layers, lm_head untied (16.4 GB to
write). --fp8-blocks adds each shape's block-FP8 copy (the same weights quantized as Qwen's *-FP8 releases store
them, lm_head kept bf16: 9.4 GB for qwen3-8b; qwen3-0.6b's is the embedded default-fp8): its step against the bf16
one at each batch, and the cosine of the two models' logits after random prompts (issue 50's targets: <= 0.6x at
batch 1, faster at 256, >= 0.99).
"+ KV" adds each sequence's KV cache to the bytes read (what bounds batch 256). The replay alone and its
kernels: `python3 benchmarks/decode_step.py --model DIR --breakdown` on the directory printed for the shape.
Prints markdown rows for docs/benchmarks.md; a shape the runtime refuses gets a row saying why.
"""
import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
import triton
from safetensors.torch import save_file

from decode_step import copy_bandwidth, engine_step_time, unread_weight_bytes
from tsdev_kernels.cache import cache_dir
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine, prompt_logits, thaw_heap
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.weights.default_model import (CHATML, DEFAULT_FP8, build_tokenizer, default_model_dir,
                                                 eos_token_ids, random_weights)

HBM_PEAK = 4.8e12  # bytes/s, H200
VERSION = 1  # bump when what `write_checkpoint` writes changes: checkpoints are cached by this name
# config.json of each shape but qwen3-0.6b (the default model's), with the published checkpoints' values
CONFIGS = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=1536,
        intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        use_sliding_window=False),
    "qwen3-30b-a3b-4l": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        attention_bias=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        attention_bias=False, tie_word_embeddings=False),
}
# Qwen's *-FP8 releases: every projection e4m3 with a multiplier per 128 x 128 block, activations quantized per
# token and group of 128 at run time; the embeddings, norms and lm_head stay bf16
FP8_BLOCKS = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
              "modules_to_not_convert": ["lm_head"]}
SHAPES = [*CONFIGS, "qwen3-0.6b"]
DEFAULT_SHAPES = ["llama-3.2-1b", "qwen2.5-1.5b", "qwen3-0.6b"]
COLUMNS = ["shape", "batch", "ms/step", "weights read GB", "floor ms @ 4.8 TB/s", "floor ms @ copy bw", "step / floor",
           "KV GB", "floor ms + KV", "step / (floor + KV)"]


def hf_weights(config: dict) -> dict[str, torch.Tensor]:
    """A config's tensors: the default model's (Qwen3: `random_weights`; Qwen3-MoE's experts one by one), for Llama
    and Qwen2 without q_norm / k_norm, and for Qwen2 the q/k/v biases (zeros: their values do not change the
    timing)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    weights = random_weights({**config, "head_dim": head_dim}, seed=0, std=None, dtype=torch.bfloat16)
    if not config["model_type"].startswith("qwen3"):
        weights = {name: w for name, w in weights.items() if not name.endswith(("q_norm.weight", "k_norm.weight"))}
    if config["model_type"] == "qwen2":
        sizes = dict(q=config["num_attention_heads"] * head_dim, k=config["num_key_value_heads"] * head_dim)
        for n in range(config["num_hidden_layers"]):
            for proj, size in (*sizes.items(), ("v", sizes["k"])):
                weights[f"model.layers.{n}.self_attn.{proj}_proj.bias"] = torch.zeros(size, dtype=torch.bfloat16)
    if not config["tie_word_embeddings"]:  # lm_head a matrix of its own (random_weights ties it)
        g = torch.Generator().manual_seed(1)
        weights["lm_head.weight"] = (torch.randn(config["vocab_size"], config["hidden_size"], generator=g)
                                     * config["hidden_size"] ** -0.5).bfloat16()
    return weights


def quantized_blocks(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` as a block-FP8 checkpoint stores them (FP8_BLOCKS): each projection's e4m3 weight and its
    `weight_scale_inv`, quantized on the GPU (tsdev_kernels.ops.fp8_block.quantize_fp8_blocks, transformers'
    fine-grained FP8 arithmetic); the rest as they are."""
    from tsdev_kernels.ops.fp8_block import quantize_fp8_blocks

    out = {}
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            q, scale_inv = quantize_fp8_blocks(w.cuda() if torch.cuda.is_available() else w)
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q.cpu(), scale_inv.cpu()
        else:
            out[name] = w
    return out


def write_checkpoint(name: str, root: Path, fp8_blocks: bool = False) -> Path:
    """The shape's checkpoint directory, written unless it is there (config.json last: it marks a whole one); the
    files as tsdev_runtime.weights.default_model.write_checkpoint writes the default model's. fp8_blocks: the same
    weights (same seed) stored as block-quantized FP8 (`FP8_BLOCKS`), in a directory of their own."""
    if name == "qwen3-0.6b":  # the embedded default (default-fp8: the same seed, block-quantized)
        return default_model_dir("cuda", DEFAULT_FP8 if fp8_blocks else None)
    out = root / f"{name}{'-fp8-blocks' if fp8_blocks else ''}-v{VERSION}"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = {"hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16", **CONFIGS[name]}
    if fp8_blocks:
        config["quantization_config"] = FP8_BLOCKS
    tokenizer = build_tokenizer(config["vocab_size"])
    tokenizer.save(str(out / "tokenizer.json"))
    eos = eos_token_ids(tokenizer)
    weights = hf_weights(config)
    save_file(quantized_blocks(weights) if fp8_blocks else weights, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    files = {
        "generation_config.json": {"eos_token_id": eos},
        "tokenizer_config.json": {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                  "model_max_length": config["max_position_embeddings"],
                                  "tokenizer_class": "PreTrainedTokenizerFast"},
        "config.json": {**config, "bos_token_id": None, "eos_token_id": eos[1]},
    }
    for file, content in files.items():
        (out / file).write_text(json.dumps(content, indent=2))
    return out


def shape_rows(name: str, args, bandwidth: float, fp8_blocks: bool = False) -> tuple[list[str], dict, list]:
    """Build the engine on the shape's checkpoint (fp8_blocks: its block-FP8 copy) and time its decode step at each
    batch size: (table rows, {batch: seconds per step}, the prefill logits of `cosine_prompts`)."""
    model_dir = write_checkpoint(name, args.dir, fp8_blocks)
    label = f"{name} block-FP8" if fp8_blocks else name
    try:
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", max_running=max(args.batch_sizes),
                                        max_model_len=max(2 * args.context, 1024)))
    except ValueError as exc:  # an architecture (or a config field) the runtime does not serve yet
        reason = str(exc).replace("\n", " ").replace("|", "/")
        return [f"| {label} | – | not served: {reason} |" + " |" * (len(COLUMNS) - 3)], {}, []
    c = engine.model_config
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied parameter counts once
    itemsize = getattr(torch, engine.describe().kv_cache_dtype).itemsize  # the KV pool's element, e.g. float8_e4m3fn
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize
    startup = ", ".join(f"{k} {v:.1f} s" for k, v in engine.startup_timings.items())
    print(f"{label}: {model_dir}, {weights / 1e9:.2f} GB of weights; startup: {startup}", flush=True)
    decoding = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rows, steps = [], {}
    for batch in args.batch_sizes:
        step = steps[batch] = engine_step_time(engine, batch, args.context, args.iters, decoding)
        kv = batch * args.context * kv_per_token
        read = weights - unread_weight_bytes(model, c.raw, batch)
        floor, floor_kv = read / bandwidth, (read + kv) / bandwidth
        values = [label, batch, f"{step * 1e3:.3f}", f"{read / 1e9:.2f}", f"{read / HBM_PEAK * 1e3:.3f}",
                  f"{floor * 1e3:.3f}", f"{step / floor:.2f}", f"{kv / 1e9:.2f}", f"{floor_kv * 1e3:.3f}",
                  f"{step / floor_kv:.2f}"]
        rows.append("| " + " | ".join(map(str, values)) + " |")
    logits = [prompt_logits(engine, prompt) for prompt in cosine_prompts(c.vocab_size)] if args.fp8_blocks else []
    return rows, steps, logits


def cosine_prompts(vocab_size: int, count: int = 8, length: int = 64) -> list[list[int]]:
    """Random prompts (fixed seed) for the block-FP8 model's logits against the bf16 model's."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab_size, (count, length), generator=g).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=DEFAULT_SHAPES)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--fp8-blocks", action="store_true",
                        help="also each shape stored as block-quantized FP8 (Qwen's *-FP8 format, the same weights): "
                             "its step against the bf16 one, and the cosine of their logits on random prompts")
    parser.add_argument("--dir", type=Path, default=cache_dir() / "model-shapes",
                        help="where the checkpoints are written (default: %(default)s)")
    args = parser.parse_args()

    bandwidth = copy_bandwidth(torch.device("cuda"))
    torch.cuda.empty_cache()
    rows, comparisons = [], []
    for name in args.shapes:
        for fp8_blocks in (False, True) if args.fp8_blocks else (False,):
            shape_rows_, steps, logits = shape_rows(name, args, bandwidth, fp8_blocks)
            rows += shape_rows_
            thaw_heap(collect=True)  # the shape's engine is garbage now: free it before the next one sizes its KV pool
            torch.cuda.empty_cache()
            if not fp8_blocks:
                plain_steps, plain_logits = steps, logits
            elif steps and plain_steps:
                cosines = [float(torch.nn.functional.cosine_similarity(a, b, dim=0))
                           for a, b in zip(plain_logits, logits)]
                comparisons += [f"| {name} | {batch} | {plain_steps[batch] * 1e3:.3f} | {steps[batch] * 1e3:.3f} | "
                                f"{steps[batch] / plain_steps[batch]:.2f} | {min(cosines):.4f} |"
                                for batch in args.batch_sizes]
    print(f"\n{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; bf16, random weights, context {args.context}, greedy; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s. Command: `python3 {shlex.join(sys.argv)}`\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * (len(COLUMNS) - 1))
    print("\n".join(rows))
    if comparisons:
        print(f"\n| shape | batch | bf16 ms/step | block-FP8 ms/step | FP8 / bf16 | logits cosine, lowest of "
              f"{len(cosine_prompts(1))} random prompts |")
        print("|---|---:|---:|---:|---:|---:|")
        print("\n".join(comparisons))


if __name__ == "__main__":
    main()
