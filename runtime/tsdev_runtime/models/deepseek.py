"""DeepSeek-V2 and -V3: multi-head latent attention (MLA) and mixtures of experts with shared experts, as transformers
defines them (its DeepseekV2/V3 model files are the oracle of tests/test_deepseek_model.py).

Attention. q comes from `q_proj` (V2-Lite) or `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (q_lora_rank set: V2, V3),
per head qk_nope_head_dim features without position and qk_rope_head_dim rotated ones. `kv_a_proj_with_mqa` gives each
token's latent (kv_lora_rank, normed by `kv_a_layernorm`) and one rotated key shared by every head; `kv_b_proj`
expands the latent into each head's nope key and value. tsdev serves the absorbed form (docs/mla.md): the KV pool
keeps only [latent | rope key] per token and layer (`LatentAttention`, kernels/tsdev_kernels/ops/mla.py); each head's
q_nope is multiplied into the latent space by W_UK (kv_b_proj's key rows of that head) before attention, and the
output, in the latent space, by W_UV (its value rows) after; long prompts expand the cached rows instead. W_UK and
W_UV are derived from kv_b_proj at each load into tensors allocated once (`w_uk`, `w_uv`): CUDA graphs read them, so a
later load refreshes them in place.
DeepSeek rotates interleaved pairs of features (x0, x1), (x2, x3)...; tsdev gathers the even features before the odd
ones (q and k alike, so every dot product is unchanged) and rotates halves, as its rope kernel does.

Mixture of experts. Layers from `first_k_dense_replace` on are sparse: routed experts (`StackedExperts`) plus
`n_shared_experts` experts every token runs (one MLP of their summed width). V2 routes by softmax top-k times
`routed_scaling_factor`; V3 by sigmoid scores with a correction bias, limited to the best `topk_group` of `n_group`
groups, renormalised and scaled (runtime/tsdev_runtime/moe/router.py).

Tensor parallelism: each rank holds its heads (q_b_proj / q_proj, kv_b_proj and o_proj by heads) and the whole latent
projection, so every rank's latent cache is the same; experts as Qwen3-MoE's, split on their intermediate features."""
import os

import torch
from torch import nn

from tsdev_kernels.ops import fp8_block
from tsdev_kernels.ops.rope import rope_settings, yarn_mscale
from tsdev_runtime import distributed
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.activation import SiluAndMul
from tsdev_runtime.layers.attention import LatentAttention
from tsdev_runtime.layers.linear import Linear, MergedLinear, RowParallelLinear, norm_linear
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.models.llama import LlamaForCausalLM
from tsdev_runtime.moe.experts import StackedExperts
from tsdev_runtime.moe.router import GroupedTopKRouter, SoftmaxRouter
from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: transformers builds them with its default


def softmax_scale(raw: dict) -> float:
    """qk_head_dim^-0.5, times mscale^2 under YaRN with `mscale_all_dim` (DeepSeek scales every feature's product)."""
    scale = (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]) ** -0.5
    _, scaling = rope_settings(raw)
    if scaling and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def interleaved_to_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., D] with pairs (x0, x1), (x2, x3)... -> [x0, x2, ..., x1, x3, ...]: the pairs become (i, i + D/2)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    """From the normed hidden state to o_proj's output, through the latent cache (module docstring)."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        raw, hidden, heads = config.raw, config.hidden_size, config.num_attention_heads
        self.nope, self.rope_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
        self.v_dim, self.latent = raw["v_head_dim"], raw["kv_lora_rank"]
        _, self.num_heads = distributed.shard(heads, "the attention heads")  # this rank's
        qk, bias = self.nope + self.rope_dim, bool(raw.get("attention_bias", False))
        self.q_lora_rank = raw.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = MergedLinear(self.q_lora_rank, {"q_b": heads * qk})
        else:
            self.q_proj = MergedLinear(hidden, {"q": heads * qk})
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = MergedLinear(self.latent, {"kv_b": heads * (self.nope + self.v_dim)})
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = rope
        self.interleaved = raw.get("rope_interleave", True)  # V2 always; V3 unless its config says otherwise
        # derived from kv_b_proj at each load, in place (graphs read them): this rank's heads
        self.register_buffer("w_uk", torch.empty(self.num_heads, self.nope, self.latent), persistent=False)
        self.register_buffer("w_uv", torch.empty(self.num_heads, self.latent, self.v_dim), persistent=False)
        self.derived = False  # a load has filled w_uk and w_uv
        self.attn = LatentAttention(self.num_heads, self.latent, self.rope_dim, self.nope, self.v_dim,
                                    softmax_scale(raw), self.w_uk, self.w_uv)

    def process_weights_after_loading(self) -> None:
        """W_UK [heads, nope, latent] and W_UV (transposed: [heads, latent, v]) from kv_b_proj's rows, head by head
        (nope rows, then value rows), into the tensors allocated at construction."""
        proj = self.kv_b_proj
        weight = (fp8_block.dequantize_fp8_blocks(proj.weight, proj.weight_scale_inv, proj.block)
                  if proj.quantization == "fp8_block" else proj.weight)
        per_head = weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        if self.derived and os.environ.get(DEBUG_DERIVED_ENV) == "rebuild":  # the drill's negative control
            self.w_uk, self.w_uv = torch.empty_like(self.w_uk), torch.empty_like(self.w_uv)
        self.w_uk.copy_(per_head[:, : self.nope])
        self.w_uv.copy_(per_head[:, self.nope:].transpose(1, 2))
        self.derived = True

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        T = hidden.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora_rank else self.q_proj(hidden)
        q_nope, q_pe = q.view(T, self.num_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.latent, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        if self.interleaved:
            q_pe, k_pe = interleaved_to_halves(q_pe), interleaved_to_halves(k_pe)
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.reshape(T, 1, self.rope_dim))
        rows = torch.cat([latent[:, None], k_pe], dim=-1)  # this step's cache rows [T, 1, latent + rope]
        # the graph cut: under prefill graphs attention runs outside the graph (Attention.graph_cut); W_UK and W_UV
        # are applied inside it (LatentAttention: absorbed, or expanded for long prompts)
        o = self.attn(torch.cat([q_nope, q_pe], dim=-1), rows, rows[..., : self.latent])  # [T, heads, v]
        return self.o_proj(o.flatten(1))


class DeepseekMLP(nn.Module):
    """The dense layers' MLP, and the shared experts' (`intermediate_size`: their summed width)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size, bias = intermediate_size or config.intermediate_size, bool(config.raw.get("mlp_bias", False))
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, *, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) -> gate|up -> silu(gate) * up -> down_proj: (the output, x + residual)."""
        gated, residual = norm_linear(norm, self.gate_up_proj, x, residual, act=self.act_fn)  # one kernel at one row
        return self.down_proj(gated), residual

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts from the normed state: gate|up, silu(gate) * up, then down_proj's product without its
        sum over the tensor-parallel ranks (DeepseekMoE sums once for them and the routed experts; the bias, as
        RowParallelLinear adds it, with rank 0's part)."""
        down = self.down_proj
        return down.project(self.act_fn(self.gate_up_proj(x)), down.bias if distributed.rank() == 0 else None)


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts, this rank's partial sums added before the one all-reduce."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        raw, hidden = config.raw, config.hidden_size
        experts, top_k, width = num_experts(raw), raw["num_experts_per_tok"], raw["moe_intermediate_size"]
        scaling = float(raw.get("routed_scaling_factor", 1.0))
        if config.architecture == "DeepseekV3ForCausalLM":
            self.gate = GroupedTopKRouter(hidden, experts, top_k, raw["n_group"], raw["topk_group"],
                                          bool(raw.get("norm_topk_prob", True)), scaling)
        else:
            self.gate = SoftmaxRouter(hidden, experts, top_k, scaling, raw.get("topk_method", "greedy"),
                                      raw.get("n_group"), raw.get("topk_group"))
        self.experts = StackedExperts(experts, hidden, width)
        shared = raw.get("n_shared_experts") or 0
        self.shared_experts = DeepseekMLP(config, width * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return distributed.all_reduce(out)


def num_experts(raw: dict) -> int:
    return int(raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts") or 0)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.sparse = num_experts(config.raw) > 0 and layer >= config.raw.get("first_k_dense_replace", 0)
        self.self_attn = DeepseekAttention(config, rope)
        self.mlp = DeepseekMoE(config) if self.sparse else DeepseekMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the next norm adds them. The input norm runs
        alone (the attention projects its output twice: q and the latent), and so does the post-attention norm before
        the experts (their router reads it)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if not self.sparse:
            return self.mlp(hidden, residual, norm=self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekForCausalLM(LlamaForCausalLM):
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

    def __init__(self, config: ModelConfig):
        super().__init__(config, DeepseekDecoderLayer, rotary_dim=config.raw["qk_rope_head_dim"])
        self.num_layers = config.num_hidden_layers

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """V3's checkpoints carry multi-token-prediction layers after the last (model.layers.61 of 61): not served."""
        if not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) >= self.num_layers
