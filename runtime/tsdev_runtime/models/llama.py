"""Llama (3.x): attention with rotary positions (scaled: llama3, linear, yarn), SwiGLU MLP, RMSNorm before each.

Each family's file defines its own decoder layer, read top to bottom (qwen2.py, qwen3.py, qwen3_moe.py, deepseek.py);
the stack around the layers is this file's `LlamaModel` and `LlamaForCausalLM` (the embedding, the layers a family
passes in, the final norm, the logits). The residual stream is added by the norm after it (`RMSNorm(x, residual)`:
one kernel), so a layer returns its output and the stream before that output is added. A norm before a projection
runs as `norm_linear(norm, proj, ...)`: one GEMV kernel at one row on CUDA (a decode step at batch 1), the modules one
after another elsewhere (runtime/tsdev_runtime/layers/linear.py).

Under tensor parallelism each rank builds its part: its attention heads and key/value heads (replicated when there
are fewer than ranks), its part of the MLP's intermediate features and of the vocabulary
(`tsdev_runtime.layers.linear`, `tsdev_runtime.layers.embedding`)."""
import torch
from torch import nn

from tsdev_kernels.ops.rope import rope_settings
from tsdev_runtime import distributed
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.activation import SiluAndMul
from tsdev_runtime.layers.attention import Attention
from tsdev_runtime.layers.embedding import LMHead, VocabEmbedding
from tsdev_runtime.layers.linear import MergedLinear, RowParallelLinear, norm_linear
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.weights.layout import RankSlice


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, qkv_bias: bool, o_bias: bool):
        super().__init__()
        # this rank's heads; the projections take the model's sizes and keep this rank's part
        _, self.num_heads = distributed.shard(config.num_attention_heads, "the attention heads")
        first_kv, self.num_kv_heads = distributed.shard_kv_heads(config.num_key_value_heads)
        d = self.head_dim = config.head_dim
        hidden, all_q, all_kv = config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d
        kv_rows = RankSlice((all_kv, hidden), 0, first_kv * d, self.num_kv_heads * d)
        self.qkv_proj = MergedLinear(hidden, {"q": all_q, "k": kv_rows, "v": kv_rows}, bias=qkv_bias)
        self.o_proj = RowParallelLinear(all_q, hidden, bias=o_bias)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, *,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) -> q|k|v -> rotary -> attention -> o_proj: (the output, x + residual)."""
        d = self.head_dim
        qkv, residual = norm_linear(norm, self.qkv_proj, x, residual)  # the norm in q|k|v's kernel at one row
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = self.rotary_emb(positions, q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d))
        # the graph cut: under prefill graphs, everything above and below is captured and attention runs
        # outside the graph (Attention.graph_cut)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, d))
        return self.o_proj(o.flatten(1)), residual


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size, bias = config.intermediate_size, bool(config.raw.get("mlp_bias", False))
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, *, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) -> gate|up -> silu(gate) * up -> down_proj: (the output, x + residual)."""
        gated, residual = norm_linear(norm, self.gate_up_proj, x, residual, act=self.act_fn)  # one kernel at one row
        return self.down_proj(gated), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int,
                 attention_bias: tuple[bool, bool] | None = None):
        """`attention_bias`: whether q|k|v and o_proj have biases (default: config.json's attention_bias, both)."""
        super().__init__()
        bias = bool(config.raw.get("attention_bias", False))
        self.self_attn = LlamaAttention(config, rope, *(attention_bias or (bias, bias)))
        self.mlp = LlamaMLP(config)
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


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, decoder_layer: type[nn.Module], rotary_dim: int):
        """`decoder_layer(config, rope, index)` builds each layer; `rotary_dim`: the features each query and key
        rotates."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # one rotary table for every layer of this model (it is large: max positions x head_dim floats); never
        # shared between models, whose memory sleeps and wakes on its own
        theta, scaling = rope_settings(config.raw)
        rope = RotaryEmbedding(rotary_dim, config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(decoder_layer(config, rope, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = embeds, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # the Hugging Face names this class serves (runtime/tsdev_runtime/models/__init__.py)
    architectures = ("LlamaForCausalLM",)

    def __init__(self, config: ModelConfig, decoder_layer: type[nn.Module] = LlamaDecoderLayer,
                 rotary_dim: int | None = None):
        """A family's causal LM passes its decoder layer (and `rotary_dim` where not every head feature rotates)."""
        super().__init__()
        self.model = LlamaModel(config, decoder_layer, rotary_dim or config.head_dim)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(self.embed(input_ids), positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward_embeds(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward from token embeddings (prefill graphs keep the lookup outside the graph, and cut it at
        each layer's attention)."""
        return self.model(embeds, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)
