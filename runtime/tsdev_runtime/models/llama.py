"""Llama (3.x): attention with rotary positions (scaled: llama3, linear, yarn), SwiGLU MLP, RMSNorm before each.

Qwen2 and Qwen3 are this model with a difference or two (`runtime/tsdev_runtime/models/qwen2.py`, `qwen3.py`), as in
Hugging Face's modular definitions. Under tensor parallelism each rank builds its part: its attention heads and
key/value heads (replicated when there are fewer than ranks), its part of the MLP's intermediate features and of the
vocabulary (`tsdev_runtime.layers.linear`, `tsdev_runtime.layers.embedding`)."""
import torch
from torch import nn

from tsdev_kernels.ops.rope import rope_settings
from tsdev_runtime import distributed
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.activation import SiluAndMul
from tsdev_runtime.layers.attention import Attention
from tsdev_runtime.layers.embedding import LMHead, VocabEmbedding
from tsdev_runtime.layers.linear import MergedLinear, NormedProjection, RowParallelLinear
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.weights.layout import RankSlice


class LlamaAttention(nn.Module):
    """From q|k|v (projected by the decoder layer's `attn_input`, which runs the norm before it) to o_proj's output."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        # this rank's heads; the projections take the model's sizes and keep this rank's part
        _, self.num_heads = distributed.shard(config.num_attention_heads, "the attention heads")
        first_kv, self.num_kv_heads = distributed.shard_kv_heads(config.num_key_value_heads)
        d = self.head_dim = config.head_dim
        hidden, all_q, all_kv = config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d
        kv_rows = RankSlice((all_kv, hidden), 0, first_kv * d, self.num_kv_heads * d)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = MergedLinear(hidden, {"q": all_q, "k": kv_rows, "v": kv_rows}, bias=qkv_bias)
        self.o_proj = RowParallelLinear(all_q, hidden, bias=o_bias)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)

    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        """Whether q|k|v and o_proj have biases."""
        bias = bool(config.raw.get("attention_bias", False))
        return bias, bias

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(positions, q, k)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = self.rotate(positions, q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d))
        # the graph cut: under prefill graphs, everything above and below is captured and attention runs
        # outside the graph (Attention.graph_cut)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, d))
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    """gate|up, silu(gate) * up, down. The first two run in the decoder layer's `mlp_input`, with the norm before
    them (one kernel at one row on CUDA): this forward takes their output, silu(gate) * up, to down_proj's."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size, bias = intermediate_size or config.intermediate_size, bool(config.raw.get("mlp_bias", False))
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, gated: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """The whole MLP from its own input (a mixture of experts' shared experts): gate|up, silu(gate) * up, then
        down_proj's product without its sum over the tensor-parallel ranks (the caller sums; the bias, as
        RowParallelLinear adds it, with rank 0's part)."""
        down = self.down_proj
        return down.project(self.act_fn(self.gate_up_proj(x)), down.bias if distributed.rank() == 0 else None)


class LlamaDecoderLayer(nn.Module):
    """RMSNorm, attention, RMSNorm, MLP, each norm adding the residual stream first. What a family changes is a
    subclass's (qwen2.py, qwen3.py, qwen3_moe.py, deepseek.py): `attention_class`, `make_mlp`, `make_attn_input`,
    `make_mlp_input`."""
    attention_class = LlamaAttention

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = self.attention_class(config, rope)
        self.mlp = self.make_mlp(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # each norm with the projection after it, fused into one kernel where that pays (decode at batch 1)
        self.attn_input = self.make_attn_input()
        self.mlp_input = self.make_mlp_input()

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return LlamaMLP(config)

    def make_attn_input(self) -> NormedProjection:
        """The input norm and q|k|v: what reaches the attention's forward."""
        return NormedProjection(self.input_layernorm, self.self_attn.qkv_proj)

    def make_mlp_input(self) -> NormedProjection:
        """The post-attention norm, gate|up and SwiGLU's activation: what reaches the MLP's forward."""
        return NormedProjection(self.post_attention_layernorm, self.mlp.gate_up_proj, self.mlp.act_fn)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the next norm adds them."""
        qkv, residual = self.attn_input(hidden, residual)  # input_layernorm, then q|k|v
        hidden = self.self_attn(positions, qkv)  # rotary, attention, o_proj
        mlp_in, residual = self.mlp_input(hidden, residual)  # post_attention_layernorm (then gate|up, SwiGLU)
        return self.mlp(mlp_in), residual


class LlamaModel(nn.Module):
    decoder_layer_class = LlamaDecoderLayer  # a family's model names its own

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # one rotary table for every layer of this model (it is large: max positions x head_dim floats); never
        # shared between models, whose memory sleeps and wakes on its own
        theta, scaling = rope_settings(config.raw)
        rope = RotaryEmbedding(self.rotary_dim(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, rope, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        """The features each query and key rotates."""
        return config.head_dim

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = embeds, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # the Hugging Face names this class serves (runtime/tsdev_runtime/models/__init__.py)
    architectures = ("LlamaForCausalLM",)
    model_class = LlamaModel  # a family's causal LM names its model (whose decoder layer carries the differences)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model = self.model_class(config)
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
