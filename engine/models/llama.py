"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (QKV bias, tied
embeddings) and Qwen3 (per-head q/k RMSNorm).

Parameter names equal the Hugging Face checkpoint names, so weights load by name;
after loading, q/k/v and gate/up projections are fused into one GEMM each.
The forward pass works on the flat token batch of one engine step; attention is
delegated to a callable supplied by the model runner (paged KV cache, connector
hooks), so this file knows nothing about blocks or devices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models import glue
from engine.models.rope import RotaryEmbedding

#: (layer_idx, query [T, H, D], key [T, KVH, D], value [T, KVH, D]) -> [T, H, D]; for a
#: layer whose `Attention.attention_rotates` is set, (layer_idx, query, key, value, cos
#: [T, R], sin [T, R]) with query and key before RoPE, which the callable applies
#: (the model runner's one-launch RoPE + KV-cache write: `fuse_rotary_into_attention`)
AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Hugging Face does. Given a residual
    stream too, `forward(x, residual)` adds x to it first and returns (the norm of the
    sum, the sum): a decoder layer's add-then-norm, one launch with the glue kernels."""

    def __init__(self, dim: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps
        self.impl: Callable = glue.rms_norm
        self.add_impl: Callable = glue.add_rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.impl(x, self.weight, self.eps)
        return self.add_impl(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        hf = config.hf_config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        # Qwen2 always has a QKV bias; others say so through `attention_bias`.
        qkv_bias = config.family == "qwen2" or bool(getattr(hf, "attention_bias", False))
        out_bias = config.family != "qwen2" and bool(getattr(hf, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=out_bias, **factory)
        self.rotary_impl: Callable = glue.rotary_qk
        #: True: the attention callable gets query and key before RoPE, with cos and sin,
        #: and rotates them itself (set by `fuse_rotary_into_attention`)
        self.attention_rotates = False
        self.qk_norm = config.family == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps, **factory)

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj by one qkv_proj (one GEMM per layer); called once after loading."""
        self.qkv_proj = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.attention_rotates:
            out = attention(self.layer_idx, q, k, v, cos, sin)
        else:
            q, k = self.rotary_impl(q, k, cos, sin)
            out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, **factory) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; the Llama family uses 'silu'")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, **factory)
        self.act_impl: Callable = glue.silu_and_mul

    def fuse_projections(self) -> None:
        """Replace gate/up_proj by one gate_up_proj; called once after loading."""
        self.intermediate_size = self.gate_proj.out_features
        self.gate_up_proj = _fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_impl(gate, up))


def _fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs."""
    first = linears[0]
    # skip_init: no random init of a tensor about to be overwritten (slow for offloaded
    # layers, which are fused in CPU memory)
    fused = nn.utils.skip_init(
        nn.Linear,
        first.in_features,
        sum(linear.out_features for linear in linears),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([linear.bias for linear in linears]))
    return fused.requires_grad_(False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, **factory) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = Attention(config, layer_idx, **factory)
        self.mlp = MLP(config.hidden_size, hf.intermediate_size, getattr(hf, "hidden_act", "silu"), **factory)
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps, **factory)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos, sin, attention: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried as (hidden, residual), their sum made by the next
        norm (fused with it): Hugging Face's `h + attn(norm(h))`, `h + mlp(norm(h))` with
        the same roundings. `residual` None: `hidden` is the stream itself (the first
        layer). -> (the MLP's output, the stream before it); `final_hidden` adds them."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attention)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def run_layers(
    layers, hidden: torch.Tensor, cos, sin, attention: AttentionFn
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run decoder `layers` in order from the residual stream `hidden` -> (the last
    layer's output, the stream before it) for `final_norm` or `final_hidden`."""
    residual = None
    for layer in layers:
        hidden, residual = layer(hidden, residual, cos, sin, attention)
    return hidden, residual


def final_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The final norm of the residual stream (hidden + residual), its add fused with it."""
    return norm(hidden) if residual is None else norm(hidden, residual)[0]


def final_hidden(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream itself (what a pipeline stage hands the next one)."""
    return hidden if residual is None else residual + hidden


def empty_embedding(num_embeddings: int, embedding_dim: int, **factory) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is left for the loader to fill. Its own random init
    would, on the meta device, import torch._dynamo (about a second of every start) for
    values never used."""
    weight = torch.empty(num_embeddings, embedding_dim, **factory)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, **factory) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **factory) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, hf.rms_norm_eps, **factory)


class LlamaFamilyForCausalLM(nn.Module):
    """Causal LM over a flat batch: `forward(input_ids [T], positions [T], attention)`
    returns the final hidden states [T, hidden]; `compute_logits(hidden [N, hidden])`
    returns float32 logits [N, vocab]. Called once per engine step; no state of its own
    besides weights and RoPE tables."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        self.model = DecoderModel(config, **factory)
        self.tie_word_embeddings = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        #: the LM head's GEMM (engine.deterministic swaps in a batch-invariant one)
        self.logits_linear: Callable = F.linear
        # RoPE tables are plain tensors, not parameters: made on the real device by the loader.
        self.rotary: RotaryEmbedding | None = (
            None if device.type == "meta" else RotaryEmbedding(config.hf_config, device)
        )

    def fuse_projections(self) -> None:
        """Called once by the loader after the weights are in place (names stay HF's until then)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def use_glue_kernels(self) -> None:
        """Run the norms (each residual add fused into the norm after it), RoPE and
        SiLU-and-mul as one Triton launch each (CUDA, 16-bit dtypes); called once at
        start-up by the engine core, before `make_batch_invariant`.

        The eager torch glue costs several kernels per op; a `torch.compile`d op costs tens
        of microseconds of host time per call in guards and wrappers, 129 calls per step of
        a 32-layer model: an eager step (no CUDA graph) was bound by that host time."""
        from kernels.elementwise import rotary_qk, silu_and_mul
        from kernels.rms_norm import add_rms_norm, rms_norm

        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = rms_norm
                module.add_impl = add_rms_norm
            elif isinstance(module, Attention):
                module.rotary_impl = rotary_qk
            elif isinstance(module, MLP):
                module.act_impl = silu_and_mul

    def set_rope_device(self, device: torch.device) -> None:
        """Called by the loader once the weights live on `device`."""
        self.rotary = RotaryEmbedding(self.config.hf_config, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        hidden, residual = run_layers(self.model.layers, hidden, cos, sin, attention)
        return final_norm(self.model.norm, hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return self.logits_linear(hidden, weight).float()


def fuse_rotary_into_attention(model: nn.Module) -> int:
    """Let the attention callable rotate query and key in every layer whose RoPE is the
    one-launch kernel (`use_glue_kernels`, outside the deterministic mode): the model
    runner rotates them in the kernel that writes the step's K/V into the paged cache
    (kernels.rotary_cache, the same numerics as kernels.elementwise.rotary_qk), one launch
    per layer fewer. Called once by the model runner (CUDA) before graphs are captured;
    its attention callables accept cos and sin. Returns the number of layers changed."""
    from kernels.elementwise import rotary_qk

    changed = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.rotary_impl is rotary_qk:
            module.attention_rotates = True
            changed += 1
    return changed
