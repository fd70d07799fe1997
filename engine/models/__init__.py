"""Model implementations. One Llama-family decoder covers Llama 2/3, Mistral, Qwen2 and Qwen3."""

from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.loader import load_model

__all__ = ["LlamaFamilyForCausalLM", "load_model"]
