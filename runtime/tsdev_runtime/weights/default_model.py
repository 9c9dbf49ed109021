"""The embedded default model: a Qwen3-architecture checkpoint with random weights, made on first use.

It lives in the user cache directory in the ordinary Hugging Face layout, so the same loader serves it
and a real downloaded checkpoint. Small on CPU; the Qwen3-0.6B shape on CUDA so kernel timings are real.
Nothing is fetched: the byte-level BPE tokenizer is trained on a text shipped with the package, then
filled with generated merges up to exactly the model's vocabulary, so every id the model can sample decodes
to text (see `build_tokenizer`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tsdev_runtime.weights.chatml import EMBEDDED_TEMPLATE

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VERSION = 5  # bump when the default checkpoint's contents change: it is cached by this name

SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 torch_dtype="float32"),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, torch_dtype="bfloat16"),
    # `tsdev serve --model default-moe`: Qwen3-MoE, a dense layer (`mlp_only_layers`) between sparse ones
    "tiny-moe": dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                     torch_dtype="float32"),
    "qwen3-moe-small": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                            num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, mlp_only_layers=[],
                            torch_dtype="bfloat16"),
    # `tsdev serve --model default-fp8` on the CPU: the default's kind, shaped so that every stacked shard fills whole
    # 128-row blocks of FP8 scales (on a GPU the default shape does)
    "tiny-blocks": dict(vocab_size=1024, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
                        torch_dtype="float32"),
    # `tsdev serve --model default-moe-fp8` on the CPU: default-moe's kind with each expert's 128 intermediate
    # features one block (on a GPU the default-moe shape, 512, fills four)
    "tiny-moe-blocks": dict(vocab_size=1024, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[1],
                            torch_dtype="float32"),
    # `tsdev serve --model default-mla`: DeepSeek-V3's kind (latent attention with q LoRA, YaRN, grouped sigmoid
    # routing with a shared expert, a dense first layer); on a GPU V3's attention shapes exactly (128 heads, latent 512,
    # rope 64, q LoRA 1536, hidden 7168) with three layers and 16 experts of V3's width, so kernel timings are real
    "tiny-mla": dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                     num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                     v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     max_position_embeddings=4096, original_max_position_embeddings=1024, torch_dtype="float32"),
    "deepseek-v3-small": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=3,
                              num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                              qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, moe_intermediate_size=2048, n_shared_experts=1,
                              first_k_dense_replace=1, max_position_embeddings=163840,
                              original_max_position_embeddings=4096, torch_dtype="bfloat16"),
}
DEFAULT = "default"  # the model name that serves the embedded dense model (as no model at all does)
DEFAULT_MOE = "default-moe"  # ... the embedded mixture of experts
DEFAULT_FP8 = "default-fp8"  # ... the embedded dense model stored as block-quantized FP8 (Qwen's *-FP8 format)
DEFAULT_MOE_FP8 = "default-moe-fp8"  # ... the embedded mixture of experts stored that way
DEFAULT_MLA = "default-mla"  # ... the embedded DeepSeek-V3-kind model (multi-head latent attention)
DEFAULT_NAMES = (None, DEFAULT, DEFAULT_MOE, DEFAULT_FP8, DEFAULT_MOE_FP8, DEFAULT_MLA)  # what `--model` takes for one
EMBEDDED_NAMES = tuple(name for name in DEFAULT_NAMES if name)  # the names a user may type


def _embedded(device: str, name: str | None) -> tuple[str, bool]:
    """The shape (a key of SHAPES) of the embedded checkpoint `name` for this device; whether it is stored as FP8."""
    gpu = device.startswith("cuda")
    moe, fp8 = name in (DEFAULT_MOE, DEFAULT_MOE_FP8), name in (DEFAULT_FP8, DEFAULT_MOE_FP8)
    if name == DEFAULT_MLA:
        return ("deepseek-v3-small" if gpu else "tiny-mla"), fp8
    if gpu:
        return ("qwen3-moe-small" if moe else "qwen3-0.6b"), fp8
    return {(False, False): "tiny", (True, False): "tiny-moe", (False, True): "tiny-blocks",
            (True, True): "tiny-moe-blocks"}[moe, fp8], fp8


def checkpoint_dir(device: str, name: str | None = None) -> Path:
    """Where the embedded checkpoint `name` (None: the default; DEFAULT_MOE, DEFAULT_FP8, DEFAULT_MOE_FP8,
    DEFAULT_MLA) for this device is (or will be) written: this module imports no torch until it writes one."""
    from tsdev_kernels.cache import cache_dir  # here: `tsdev serve` reads this module's names before the kernels

    shape, fp8 = _embedded(device, name)
    return cache_dir() / f"default-{shape}{'-fp8' if fp8 else ''}-v{VERSION}"


def default_model_dir(device: str, name: str | None = None) -> Path:
    """The embedded checkpoint `name` for this device (`checkpoint_dir`), created (once, atomically) if it is not
    there yet; while another process writes it (`write_ahead`'s), this waits for that one instead of writing too."""
    final = checkpoint_dir(device, name)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _writing(final):
        if (final / "config.json").is_file():  # written meanwhile, by the process that held the lock
            return final
        logging.getLogger("tsdev_runtime.startup").info("writing the default checkpoint %s (once, on first use)",
                                                        final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            shape, fp8 = _embedded(device, name)
            write_checkpoint(tmp, SHAPES[shape], fp8_blocks=fp8)
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race with another process: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _writing(final: Path):
    """Held by the one process writing `final` (an exclusive lock on a file beside it; released when that process
    ends, however it ends); without fcntl (not Linux or macOS) nothing is held and each writes its own copy."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_ahead(device: str, name: str | None = None) -> subprocess.Popen | None:
    """Start writing the embedded checkpoint `name` for `device` in a process of its own when it is not there yet:
    `tsdev serve` does so on a GPU before it imports torch, so that a fresh machine's first start writes it (2.4-4.1 s
    on the H100 and H200 hosts: the tokenizer, the weights drawn, the file) beside its own imports; its load then
    waits for that process (`default_model_dir`). None when the checkpoint is there."""
    if (checkpoint_dir(device, name) / "config.json").is_file():
        return None
    return subprocess.Popen([sys.executable, "-m", "tsdev_runtime.weights.default_model", device, name or ""],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def write_checkpoint(out: Path, shape: dict, seed: int = 0, std: float | None = None, fp8_blocks: bool = False) -> None:
    """Write config, tokenizer and random weights for a Qwen3 model of `shape` into `out`; `fp8_blocks`: its
    projections stored as block-quantized FP8 (e4m3 and a float32 multiplier per 128 x 128 block, as Qwen's *-FP8
    releases and transformers' fine-grained FP8 quantizer store them).

    Matrices get std 1/sqrt(fan_in) unless `std` is given: each layer then keeps its input's scale, so
    greedy output varies from token to token (with small weights a tied-embedding model only echoes its
    last token, and an edit to a layer would not show in its output).
    """
    tokenizer = build_tokenizer(shape["vocab_size"])
    tokenizer.save(str(out / "tokenizer.json"))
    eos = eos_token_ids(tokenizer)
    config = dict(**_family_config(shape), attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=eos[1])
    if fp8_blocks:
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": EMBEDDED_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "model_max_length": shape["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast"},
        indent=2))
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, shape["torch_dtype"])
    weights = random_weights(shape, seed, std, dtype)
    if fp8_blocks:
        from tsdev_kernels.ops.fp8_block import quantize_fp8_blocks

        for name in [n for n in weights if n.endswith("proj.weight")]:
            weights[name], weights[name.removesuffix("weight") + "weight_scale_inv"] = (
                quantize_fp8_blocks(weights[name]))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def _family_config(shape: dict) -> dict:
    """config.json's family fields for `shape`: Qwen3, Qwen3-MoE (experts) or DeepSeek-V3 (a latent rank)."""
    if "kv_lora_rank" in shape:
        shape = dict(shape)
        original = shape.pop("original_max_position_embeddings")
        yarn = {"type": "yarn", "factor": shape["max_position_embeddings"] / original,
                "original_max_position_embeddings": original, "mscale": 1.0, "mscale_all_dim": 1.0,
                "beta_fast": 32, "beta_slow": 1}
        return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", rope_theta=10000.0,
                    rope_scaling=yarn, rope_interleave=True, num_key_value_heads=shape["num_attention_heads"],
                    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                    tie_word_embeddings=False, **shape)
    moe = "num_experts" in shape
    return dict(architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
                model_type="qwen3_moe" if moe else "qwen3",
                **(dict(decoder_sparse_step=1, norm_topk_prob=True) if moe else {}),
                rope_theta=1_000_000.0, rope_scaling=None, tie_word_embeddings=True, **shape)


def random_weights(shape: dict, seed: int, std: float | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each matrix from a generator of its own (seeded by `seed` and its name), drawn on every core at once: the
    0.6B default in about a second on a 16-core host, where one generator for all took 4-5 s."""
    import torch

    h = shape["hidden_size"]
    matrices, ones = {"model.embed_tokens.weight": (shape["vocab_size"], h)}, {"model.norm.weight": h}
    if "kv_lora_rank" in shape:  # untied
        matrices["lm_head.weight"] = (shape["vocab_size"], h)
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        attention, norms = (_latent_attention if "kv_lora_rank" in shape else _attention)(shape, p + "self_attn.")
        matrices |= {**attention, **_mlp_matrices(shape, n)}
        ones |= {**norms, p + "input_layernorm.weight": h, p + "post_attention_layernorm.weight": h}

    def normal(item: tuple[str, tuple[int, int]]) -> tuple[str, torch.Tensor]:
        name, (rows, fan_in) = item
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return name, (torch.randn(rows, fan_in, generator=g) * (std or fan_in**-0.5)).to(dtype)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        weights = dict(pool.map(normal, matrices.items()))
    # DeepSeek-V3's routing bias, float32 as its checkpoints store it (zero: the scores alone choose)
    biases = {name.removesuffix("weight") + "e_score_correction_bias": torch.zeros(rows, dtype=torch.float32)
              for name, (rows, _) in matrices.items() if "kv_lora_rank" in shape and name.endswith("mlp.gate.weight")}
    return weights | biases | {name: torch.ones(size, dtype=dtype) for name, size in ones.items()}


def _attention(shape: dict, p: str) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Qwen3's attention: (rows, fan_in) of q, k, v and o; the q and k norms' sizes."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return ({p + "q_proj.weight": (q, h), p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h),
             p + "o_proj.weight": (h, q)}, {p + "q_norm.weight": d, p + "k_norm.weight": d})


def _latent_attention(shape: dict, p: str) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """DeepSeek-V3's: q LoRA, the latent projection (with the rope key), its expansion, o; the two LoRA norms."""
    h, heads, q_rank, latent = (shape[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank",
                                                    "kv_lora_rank"))
    nope, rope, v = shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]
    matrices = {p + "q_a_proj.weight": (q_rank, h), p + "q_b_proj.weight": (heads * (nope + rope), q_rank),
                p + "kv_a_proj_with_mqa.weight": (latent + rope, h),
                p + "kv_b_proj.weight": (heads * (nope + v), latent), p + "o_proj.weight": (h, heads * v)}
    return matrices, {p + "q_a_layernorm.weight": q_rank, p + "kv_a_layernorm.weight": latent}


def _mlp_matrices(shape: dict, layer: int) -> dict[str, tuple[int, int]]:
    """(rows, fan_in) of a dense MLP's three projections, or (a sparse layer of a mixture of experts) the router's,
    each expert's and the shared experts'."""
    p, h = f"model.layers.{layer}.mlp.", shape["hidden_size"]
    experts = shape.get("num_experts") or shape.get("n_routed_experts")
    dense = layer in shape.get("mlp_only_layers", ()) or layer < shape.get("first_k_dense_replace", 0)
    if not experts or dense:
        return _swiglu(p, h, shape["intermediate_size"])
    i, matrices = shape["moe_intermediate_size"], {p + "gate.weight": (experts, h)}
    for e in range(experts):
        matrices |= _swiglu(f"{p}experts.{e}.", h, i)
    if shape.get("n_shared_experts"):
        matrices |= _swiglu(p + "shared_experts.", h, i * shape["n_shared_experts"])
    return matrices


def _swiglu(p: str, h: int, i: int) -> dict[str, tuple[int, int]]:
    return {p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h), p + "down_proj.weight": (h, i)}


def eos_token_ids(tokenizer) -> list[int]:
    """Every special token ends a request: decoded with `skip_special_tokens` (as the engine decodes) they
    are empty, so a sampled <|im_start|> (a new turn) stops like <|im_end|> and <|endoftext|> do."""
    return [tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")]


def build_tokenizer(vocab_size: int):
    """The default model's tokenizer, with exactly `vocab_size` ids, each of which decodes to text.

    A byte-level BPE trained on corpus.txt (a few hundred tokens) is filled with generated merges until
    it has `vocab_size` tokens: word-piece pairs (`Ġthe` + `re`), earliest-learned pieces first, so every
    added token is a word or word piece of ASCII letters (never a partial UTF-8 character) that encoding
    can produce. Special tokens decode to "" (skipped) and are EOS (`eos_token_ids`). It depends only on
    corpus.txt and `tokenizers`, not on the machine or the Python version. About 1 s for 151,936 ids.
    """
    from tokenizers import Tokenizer

    tokenizer = train_tokenizer(vocab_size)
    data = json.loads(tokenizer.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    pair = (lambda a, b: f"{a} {b}") if merges and isinstance(merges[0], str) else (lambda a, b: [a, b])
    for a, b in _word_pairs(vocab, vocab_size):
        vocab[a + b] = len(vocab)
        merges.append(pair(a, b))
    tokenizer = Tokenizer.from_str(json.dumps(data))
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


_WORD, _LOWER = re.compile("\u0120?[A-Za-z]+"), re.compile("[a-z]+")  # \u0120 (Ġ): the byte-level space


def _word_pairs(vocab: dict[str, int], size: int):
    """Yield (head, tail) pieces whose concatenation is a new word piece, until `vocab` (which the caller
    extends with each pair) has `size` tokens. Pairs go by the sum of their pieces' ranks, so pieces
    learned early (frequent ones) combine first; a round's new pieces join the next round."""
    heads = [t for t in sorted(vocab, key=vocab.get) if _WORD.fullmatch(t)]
    tails = [t for t in heads if _LOWER.fullmatch(t)]
    while len(vocab) < size:
        new = []
        for s in range(len(heads) + len(tails) - 1):
            for i in range(max(0, s - len(tails) + 1), min(s, len(heads) - 1) + 1):
                word = heads[i] + tails[s - i]
                if word not in vocab:
                    yield heads[i], tails[s - i]
                    new.append(word)
                    if len(vocab) >= size:
                        return
        if not new:
            raise ValueError(f"corpus.txt gives too few word pieces to fill a vocabulary of {size}")
        heads += new
        tails += [t for t in new if _LOWER.fullmatch(t)]


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 4096), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = (Path(__file__).parent / "corpus.txt").read_text()
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    return tokenizer


if __name__ == "__main__":  # `write_ahead`'s process: python -m tsdev_runtime.weights.default_model DEVICE NAME
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # (its one line: on stderr, as the server's)
    default_model_dir(sys.argv[1], sys.argv[2] or None)
