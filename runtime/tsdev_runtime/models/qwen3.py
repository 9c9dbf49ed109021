"""Qwen3 (dense): Llama with a per-head RMSNorm of q and of k before the rotation (`qk_norm_rope`: one kernel).

The decoder layer reads top to bottom: input_layernorm -> attention -> post_attention_layernorm -> MLP, each norm adding
the residual stream first. The fusions are the calls you see: `norm_linear` runs each norm with the projection after
it (one GEMV kernel at one row on CUDA: a decode step at batch 1; gate|up's also with silu(gate) * up), `qk_norm_rope`
the q/k norms inside the rotation. The stack around the layers is Llama's (`LlamaForCausalLM`)."""
import torch
from torch import nn

from tsdev_runtime import distributed
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.activation import SiluAndMul
from tsdev_runtime.layers.attention import Attention
from tsdev_runtime.layers.linear import MergedLinear, RowParallelLinear, norm_linear
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.layers.rotary import RotaryEmbedding, qk_norm_rope
from tsdev_runtime.models.llama import LlamaForCausalLM
from tsdev_runtime.weights.layout import RankSlice


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        # this rank's heads; the projections take the model's sizes and keep this rank's part
        _, self.num_heads = distributed.shard(config.num_attention_heads, "the attention heads")
        first_kv, self.num_kv_heads = distributed.shard_kv_heads(config.num_key_value_heads)
        d = self.head_dim = config.head_dim
        hidden, all_q, all_kv = config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d
        kv_rows = RankSlice((all_kv, hidden), 0, first_kv * d, self.num_kv_heads * d)
        bias = bool(config.raw.get("attention_bias", False))
        self.qkv_proj = MergedLinear(hidden, {"q": all_q, "k": kv_rows, "v": kv_rows}, bias=bias)
        self.o_proj = RowParallelLinear(all_q, hidden, bias=bias)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, *,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) -> q|k|v -> q_norm, k_norm -> rotary -> attention -> o_proj: (the output,
        x + residual)."""
        d = self.head_dim
        qkv, residual = norm_linear(norm, self.qkv_proj, x, residual)  # the norm in q|k|v's kernel at one row
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = qk_norm_rope(self.q_norm, self.k_norm, self.rotary_emb, positions,  # one kernel
                            q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d))
        # the graph cut: under prefill graphs, everything above and below is captured and attention runs
        # outside the graph (Attention.graph_cut)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, d))
        return self.o_proj(o.flatten(1)), residual


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size})
        self.down_proj = RowParallelLinear(size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, *, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) -> gate|up -> silu(gate) * up -> down_proj: (the output, x + residual)."""
        gated, residual = norm_linear(norm, self.gate_up_proj, x, residual, act=self.act_fn)  # one kernel at one row
        return self.down_proj(gated), residual


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rope)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_layernorm -> self_attn -> post_attention_layernorm -> mlp, each norm adding the residual stream
        first (`norm=`: it runs in the kernel of the projection after it). Returns (this layer's output, the residual
        stream before it is added): the next norm adds them."""
        hidden, residual = self.self_attn(positions, hidden, residual, norm=self.input_layernorm)
        hidden, residual = self.mlp(hidden, residual, norm=self.post_attention_layernorm)
        return hidden, residual


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)

    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen3DecoderLayer)
