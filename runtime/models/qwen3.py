"""Qwen3 (dense): attention with per-head q/k RMSNorm, SwiGLU MLP, optional tied embeddings.

Under tensor parallelism each rank builds its part: its attention heads and key/value heads, its part of the MLP's
intermediate features and of the vocabulary (`runtime.layers.linear`, `runtime.layers.embedding`)."""
import torch
from torch import nn

from runtime import distributed
from runtime.config import ModelConfig
from runtime.layers.activation import SiluAndMul
from runtime.layers.attention import Attention
from runtime.layers.embedding import LMHead, VocabEmbedding
from runtime.layers.linear import MergedLinear, RowParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        # this rank's heads; the projections take the model's sizes and keep this rank's part
        _, self.num_heads = distributed.shard(config.num_attention_heads, "the attention heads")
        _, self.num_kv_heads = distributed.shard(config.num_key_value_heads, "the key/value heads")
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        all_q, all_kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": all_q, "k": all_kv, "v": all_kv})
        self.o_proj = RowParallelLinear(all_q, config.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over norm(hidden + residual); returns (its output, hidden + residual). The norm runs inside
        the q|k|v projection (`Linear.project_normed`)."""
        qkv, residual = self.qkv_proj.project_normed(hidden, residual, norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        # the graph cut: under prefill graphs, everything above and below is captured and attention runs
        # outside the graph (Attention.graph_cut)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(o.flatten(1)), residual


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size})
        self.down_proj = RowParallelLinear(size, config.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """SwiGLU over norm(x + residual); returns (its output, x + residual). The norm and the activation run
        inside the gate|up projection (`Linear.project_normed`)."""
        act, residual = self.gate_up_proj.project_normed(x, residual, norm, self.act)
        return self.down_proj(act), residual


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rope)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # one rotary table for every layer of this model (it is large: max positions x head_dim floats); never
        # shared between models, whose memory sleeps and wakes on its own
        rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rope) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(input_ids), positions)

    def forward_embeds(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = embeds, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (merged module, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model = Qwen3Model(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward_embeds(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward from token embeddings (prefill graphs keep the lookup outside the graph, and cut it at
        each layer's attention)."""
        return self.model.forward_embeds(embeds, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)
