"""The eager forward pass on a real GPU (marker `gpu`): a step that replays no CUDA graph
never makes the host wait for the device inside the forward pass (a wait per layer
would add the device time to the host time), and a bf16 engine runs the one-launch glue
kernels (the residual adds fused into the norms, RoPE into the cache write).

Run: `python3 -m pytest tests/engine/test_gpu_eager_step.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.elementwise import rotary_qk, silu_and_mul
from kernels.rms_norm import add_rms_norm, rms_norm
from tests.engine.hf_reference import random_prompt

pytestmark = pytest.mark.gpu


class SyncsAreErrors:
    """Forward hooks: `torch.cuda.set_sync_debug_mode("error")` for the model's forward pass
    alone (sampling reads the tokens afterwards, which is the step's one intended wait)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.num_passes = 0
        self.handles = [
            model.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("error")),
            model.register_forward_hook(self._after),
        ]

    def _after(self, *_) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self.num_passes += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eager_steps_never_sync_inside_the_forward_pass(tiny_model_dir, dtype):
    # enforce_eager: every step runs the eager pass (with the glue kernels in bf16)
    llm = LLM(
        tiny_model_dir("llama"), dtype=dtype, device="cuda", max_num_seqs=8, warmup=False, enforce_eager=True
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prefix = random_prompt(300, seed=1)
    llm.generate([prefix], SamplingParams(max_tokens=1))  # its full blocks stay in the prefix cache
    guard = SyncsAreErrors(engine.model)
    try:
        # a 52-token chunk over the cached 288 tokens, then decode steps of 1 and 8 sequences
        outputs = llm.generate([prefix + random_prompt(40, seed=2)], params)
        outputs += llm.generate([random_prompt(50 + i, seed=10 + i) for i in range(8)], params)
    finally:
        guard.remove()
    assert outputs[0].metrics.num_local_cached_tokens == 288
    assert guard.num_passes >= 12 and all(len(o.token_ids) == 6 for o in outputs)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_bf16_engine_runs_the_glue_kernels(tiny_model_dir, enforce_eager):
    llm = LLM(
        tiny_model_dir("qwen3"), dtype="bfloat16", device="cuda", warmup=False, enforce_eager=enforce_eager
    )
    layer = llm.engine.model.model.layers[0]
    assert layer.input_layernorm.impl is rms_norm and layer.self_attn.q_norm.impl is rms_norm
    assert (
        layer.input_layernorm.add_impl is add_rms_norm
        and layer.post_attention_layernorm.add_impl is add_rms_norm
    )
    assert layer.self_attn.rotary_impl is rotary_qk and layer.mlp.act_impl is silu_and_mul
    # RoPE runs in the runner's cache write (kernels.rotary_cache), in graphs and eager steps
    assert layer.self_attn.attention_rotates
    outputs = llm.generate([random_prompt(30, seed=3)], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outputs[0].token_ids) == 4
