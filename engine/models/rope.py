"""Rotary position embeddings, with inverse frequencies from transformers' own
rope-init functions so every `rope_scaling` / `rope_parameters` form works."""

from __future__ import annotations

from typing import Any

import torch


def rope_parameters(hf_config: Any) -> dict:
    """The RoPE dict of a config in either layout: transformers 5.x keeps
    `rope_parameters` (with `rope_theta` inside); 4.x keeps `rope_scaling` and a
    top-level `rope_theta`. Returns a dict with at least `rope_type` and `rope_theta`."""
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def compute_inv_freq(
    hf_config: Any, device: torch.device, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq float32 [rotary_dim // 2], attention_scaling). `seq_len` matters
    only for the length-dependent types (dynamic, longrope)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        dim = int(head_dim * getattr(hf_config, "partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unknown rope type {rope_type!r}; supported: default, {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device, seq_len=seq_len)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """cos/sin tables per position. Length-independent types are computed once;
    `dynamic` and `longrope` recompute their frequencies from the longest position
    of the step, as Hugging Face does per forward call."""

    def __init__(self, hf_config: Any, device: torch.device) -> None:
        self.hf_config = hf_config
        self.device = device
        self.rope_type = rope_parameters(hf_config)["rope_type"]
        self.original_max_len = getattr(hf_config, "original_max_position_embeddings", None) or (
            rope_parameters(hf_config).get("original_max_position_embeddings")
            or hf_config.max_position_embeddings
        )
        self.inv_freq, self.attention_scaling = compute_inv_freq(hf_config, device)
        self._dynamic_seq_len: int | None = None

    @property
    def depends_on_length(self) -> bool:
        """True for types whose frequencies change with the sequence length."""
        return self.rope_type in ("dynamic", "longrope")

    def _update_for_length(self, seq_len: int) -> None:
        # HF recomputes once the sequence outgrows the original length and resets below it.
        target = seq_len if seq_len > self.original_max_len else None
        if target != self._dynamic_seq_len:
            self.inv_freq, self.attention_scaling = compute_inv_freq(
                self.hf_config, self.device, seq_len=target
            )
            self._dynamic_seq_len = target

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [num_tokens] -> cos, sin [num_tokens, rotary_dim] in `dtype`."""
        if self.depends_on_length and positions.numel():
            # the only host read of the forward pass; other types never sync here
            self._update_for_length(int(positions.max()) + 1)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, rotary_dim] (rotate-half layout)."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
