"""Speculative-decoding verification: the rejection sampler (Triton kernel + torch reference).

Inputs are flattened across the batch like vLLM V1: request ``i`` owns the draft rows
``[start_i, start_i + num_draft_tokens[i])`` of every ``[num_draft_tokens_total, ...]``
tensor. For each request the sampler walks its drafts in order:

- greedy request: a draft is accepted only when it equals the target argmax; at the first
  mismatch the target argmax is emitted instead;
- sampled request: a draft ``d`` is accepted when ``u * q(d) < p(d)`` (accept with
  probability ``min(1, p/q)``); at the first rejection a token is drawn from the normalized
  residual ``max(0, p - q)`` with the exponential race ``argmax(residual / noise)``;
  n-gram drafts pass ``draft_probs=None``, meaning ``q`` is a point mass on the draft;
- when every draft is accepted the bonus token is appended.

The output row of a request holds the accepted drafts, then one more token (the recovered
or the bonus token), then ``-1`` placeholders up to ``max_spec_len + 1`` columns. Every
output slot is written, so no caller ever reads uninitialized memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.launch import check_kernel_device, next_power_of_2

PLACEHOLDER_TOKEN_ID = -1


@triton.jit(do_not_specialize=["max_spec_len"])
def _rejection_sample_kernel(
    out_ptr,  # [batch, max_spec_len + 1] int64
    draft_token_ids_ptr,  # [num_draft_tokens_total] int32 or int64
    cu_num_draft_tokens_ptr,  # [batch] int64, inclusive prefix sums
    draft_probs_ptr,  # [num_draft_tokens_total, vocab] float32 (unused without HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens_total, vocab] float32
    target_argmax_ptr,  # [num_draft_tokens_total] int32 or int64
    bonus_token_ids_ptr,  # [batch] int32 or int64
    is_greedy_ptr,  # [batch] bool
    uniform_ptr,  # [num_draft_tokens_total] float32
    recovery_noise_ptr,  # [batch, vocab] float32, strictly positive Exp(1) samples
    vocab_size,
    max_spec_len,
    stride_out,
    stride_draft_probs,
    stride_target_probs,
    stride_noise,
    PLACEHOLDER: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_SPEC: tl.constexpr,  # power of two >= max_spec_len + 1
    BLOCK_VOCAB: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_num_draft_tokens_ptr + req).to(tl.int64)
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0).to(tl.int64)
    num_drafts = end - start
    is_greedy = tl.load(is_greedy_ptr + req)

    pos = tl.arange(0, BLOCK_SPEC).to(tl.int64)
    is_draft = pos < num_drafts
    rows = start + pos
    draft_ids = tl.load(draft_token_ids_ptr + rows, mask=is_draft, other=0).to(tl.int64)
    if is_greedy:
        argmax_ids = tl.load(target_argmax_ptr + rows, mask=is_draft, other=0).to(tl.int64)
        accepted = draft_ids == argmax_ids
    else:
        p = tl.load(target_probs_ptr + rows * stride_target_probs + draft_ids, mask=is_draft, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + rows * stride_draft_probs + draft_ids, mask=is_draft, other=1.0)
        else:
            q = tl.full([BLOCK_SPEC], 1.0, tl.float32)
        u = tl.load(uniform_ptr + rows, mask=is_draft, other=1.0)
        accepted = u * q < p
    # The first rejected position, or num_drafts when every draft is accepted.
    num_accepted = tl.min(tl.where(is_draft & ~accepted, pos, num_drafts), axis=0)

    # The token after the accepted drafts: bonus, target argmax (greedy) or a residual sample.
    last_token = tl.load(bonus_token_ids_ptr + req).to(tl.int64)
    if num_accepted < num_drafts:
        row = start + num_accepted
        if is_greedy:
            last_token = tl.load(target_argmax_ptr + row).to(tl.int64)
        else:
            last_token = _sample_residual(
                draft_probs_ptr + row * stride_draft_probs,
                target_probs_ptr + row * stride_target_probs,
                recovery_noise_ptr + req * stride_noise,
                tl.load(draft_token_ids_ptr + row).to(tl.int64),
                vocab_size,
                HAS_DRAFT_PROBS,
                BLOCK_VOCAB,
            )

    tokens = tl.where(pos < num_accepted, draft_ids, PLACEHOLDER)
    tokens = tl.where(pos == num_accepted, last_token, tokens)
    tl.store(out_ptr + req * stride_out + pos, tokens, mask=pos < max_spec_len + 1)


@triton.jit
def _sample_residual(
    draft_probs_row_ptr,  # [vocab] float32
    target_probs_row_ptr,  # [vocab] float32
    noise_row_ptr,  # [vocab] float32
    draft_token_id,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
):
    """Sample from max(0, p - q) by argmax(residual / noise). Falls back to sampling p when the
    residual is all zero: with p == q a draft is rejected only through float rounding."""
    best_residual_score = -1.0
    best_residual_id = 0
    best_target_score = -1.0
    best_target_id = 0
    for block_start in range(0, vocab_size, BLOCK_VOCAB):
        ids = block_start + tl.arange(0, BLOCK_VOCAB).to(tl.int64)
        in_vocab = ids < vocab_size
        p = tl.load(target_probs_row_ptr + ids, mask=in_vocab, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_row_ptr + ids, mask=in_vocab, other=0.0)
        else:
            q = tl.where(ids == draft_token_id, 1.0, 0.0)
        noise = tl.load(noise_row_ptr + ids, mask=in_vocab, other=1.0)
        # Masked lanes load p = q = 0 and score 0, so they never beat an earlier in-vocab lane.
        # IEEE division (not the approximate default) so the GPU matches the torch reference.
        residual_score = tl.div_rn(tl.maximum(p - q, 0.0), noise)
        target_score = tl.div_rn(p, noise)
        block_best, block_best_id = tl.max(residual_score, axis=0, return_indices=True)
        if block_best > best_residual_score:
            best_residual_score = block_best
            best_residual_id = block_start + block_best_id
        block_best, block_best_id = tl.max(target_score, axis=0, return_indices=True)
        if block_best > best_target_score:
            best_target_score = block_best
            best_target_id = block_start + block_best_id
    return tl.where(best_residual_score > 0.0, best_residual_id, best_target_id).to(tl.int64)


def _check_inputs(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform_samples: torch.Tensor,
    recovery_noise: torch.Tensor,
    max_spec_len: int,
) -> None:
    """Raise ValueError naming the first argument whose shape, dtype, device or draft id is wrong."""
    batch = len(num_draft_tokens)
    if max_spec_len < 0:
        raise ValueError(f"max_spec_len must be >= 0, got {max_spec_len}")
    for i, n in enumerate(num_draft_tokens):
        if not 0 <= n <= max_spec_len:
            raise ValueError(f"num_draft_tokens[{i}]={n} is outside [0, max_spec_len={max_spec_len}]")
    num_draft_tokens_total = sum(num_draft_tokens)
    if target_probs.dim() != 2:
        raise ValueError(
            f"target_probs must be [num_draft_tokens_total, vocab], got {tuple(target_probs.shape)}"
        )
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    expected = {
        "draft_token_ids": (draft_token_ids, (num_draft_tokens_total,), (torch.int32, torch.int64)),
        "target_probs": (target_probs, (num_draft_tokens_total, vocab_size), (torch.float32,)),
        "target_argmax": (target_argmax, (num_draft_tokens_total,), (torch.int32, torch.int64)),
        "bonus_token_ids": (bonus_token_ids, (batch,), (torch.int32, torch.int64)),
        "is_greedy": (is_greedy, (batch,), (torch.bool,)),
        "uniform_samples": (uniform_samples, (num_draft_tokens_total,), (torch.float32,)),
        "recovery_noise": (recovery_noise, (batch, vocab_size), (torch.float32,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (num_draft_tokens_total, vocab_size), (torch.float32,))
    for name, (tensor, shape, dtypes) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {dtypes}, got {tensor.dtype}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but target_probs is on {device}")
    if vocab_size == 0:
        raise ValueError("target_probs has an empty vocabulary")
    # Draft ids index the probability rows, so their values are checked too (a sync on CUDA).
    if num_draft_tokens_total:
        low, high = (int(v) for v in torch.aminmax(draft_token_ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(f"draft_token_ids must be in [0, {vocab_size}), got min {low} max {high}")


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int
    num_draft_tokens: Sequence[int],  # batch ints (CPU metadata from the scheduler)
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab] float32, None = point mass
    target_probs: torch.Tensor,  # [num_draft_tokens_total, vocab] float32
    target_argmax: torch.Tensor,  # [num_draft_tokens_total] int, argmax of the target logits
    bonus_token_ids: torch.Tensor,  # [batch] int, sampled from the target after the last draft
    is_greedy: torch.Tensor,  # [batch] bool
    uniform_samples: torch.Tensor,  # [num_draft_tokens_total] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [batch, vocab] float32, Exp(1) samples, strictly positive
    max_spec_len: int,
    out: torch.Tensor | None = None,  # [batch, max_spec_len + 1] int64
) -> torch.Tensor:
    """Verify the drafts of one engine step; returns ``[batch, max_spec_len + 1]`` int64 token ids.

    Called by the model runner once per step that carries drafts. Writes only ``out`` (every
    slot of it); reads nothing beyond the rows of drafts a request owns. Random numbers come in
    as arguments so that per-request seeded generators make the result reproducible.
    """
    _check_inputs(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        target_argmax,
        bonus_token_ids,
        is_greedy,
        uniform_samples,
        recovery_noise,
        max_spec_len,
    )
    check_kernel_device("target_probs", target_probs)
    batch = len(num_draft_tokens)
    device = target_probs.device
    if out is None:
        out = torch.empty((batch, max_spec_len + 1), dtype=torch.int64, device=device)
    elif out.shape != (batch, max_spec_len + 1) or out.dtype != torch.int64 or out.device != device:
        raise ValueError(
            f"out must be int64 of shape {(batch, max_spec_len + 1)} on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if batch == 0:
        return out
    if out.stride(1) != 1:
        raise ValueError("out must be contiguous along its last dimension")
    # from pinned memory, without waiting: a pageable copy would wait for the forward pass
    cu_num_draft_tokens = torch.tensor(
        list(itertools.accumulate(num_draft_tokens)), dtype=torch.int64, pin_memory=device.type == "cuda"
    ).to(device, non_blocking=True)
    target_probs = target_probs.contiguous() if target_probs.stride(1) != 1 else target_probs
    if draft_probs is not None and draft_probs.stride(1) != 1:
        draft_probs = draft_probs.contiguous()
    if recovery_noise.stride(1) != 1:
        recovery_noise = recovery_noise.contiguous()
    vocab_size = target_probs.shape[1]
    _rejection_sample_kernel[(batch,)](
        out,
        draft_token_ids.contiguous(),
        cu_num_draft_tokens,
        draft_probs if draft_probs is not None else target_probs,
        target_probs,
        target_argmax.contiguous(),
        bonus_token_ids.contiguous(),
        is_greedy.contiguous(),
        uniform_samples.contiguous(),
        recovery_noise,
        vocab_size,
        max_spec_len,
        out.stride(0),
        draft_probs.stride(0) if draft_probs is not None else 0,
        target_probs.stride(0),
        recovery_noise.stride(0),
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_SPEC=next_power_of_2(max_spec_len + 1),
        BLOCK_VOCAB=min(next_power_of_2(vocab_size), 1024),
    )
    return out


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int
    num_draft_tokens: Sequence[int],  # batch ints
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab] float32, None = point mass
    target_probs: torch.Tensor,  # [num_draft_tokens_total, vocab] float32
    target_argmax: torch.Tensor,  # [num_draft_tokens_total] int
    bonus_token_ids: torch.Tensor,  # [batch] int
    is_greedy: torch.Tensor,  # [batch] bool
    uniform_samples: torch.Tensor,  # [num_draft_tokens_total] float32
    recovery_noise: torch.Tensor,  # [batch, vocab] float32
    max_spec_len: int,
    out: torch.Tensor | None = None,  # [batch, max_spec_len + 1] int64
) -> torch.Tensor:
    """Pure-torch reference of :func:`rejection_sample`: same signature, same result bit for bit."""
    _check_inputs(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        target_argmax,
        bonus_token_ids,
        is_greedy,
        uniform_samples,
        recovery_noise,
        max_spec_len,
    )
    batch = len(num_draft_tokens)
    result = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    start = 0
    for req, num_drafts in enumerate(num_draft_tokens):
        rows = slice(start, start + num_drafts)
        draft_ids = draft_token_ids[rows].long().cpu()
        if bool(is_greedy[req]):
            accepted = draft_ids == target_argmax[rows].long().cpu()
        else:
            p = target_probs[rows].cpu().gather(1, draft_ids[:, None])[:, 0]
            q = (
                draft_probs[rows].cpu().gather(1, draft_ids[:, None])[:, 0]
                if draft_probs is not None
                else torch.ones_like(p)
            )
            accepted = uniform_samples[rows].cpu() * q < p
        rejected_positions = torch.nonzero(~accepted).flatten()
        num_accepted = int(rejected_positions[0]) if len(rejected_positions) else num_drafts
        result[req, :num_accepted] = draft_ids[:num_accepted]
        if num_accepted == num_drafts:
            result[req, num_accepted] = int(bonus_token_ids[req])
        elif bool(is_greedy[req]):
            result[req, num_accepted] = int(target_argmax[start + num_accepted])
        else:
            row = start + num_accepted
            p = target_probs[row].cpu()
            if draft_probs is not None:
                q = draft_probs[row].cpu()
            else:
                q = torch.zeros_like(p)
                q[int(draft_token_ids[row])] = 1.0
            noise = recovery_noise[req].cpu()
            residual_score = torch.clamp(p - q, min=0.0) / noise
            score = residual_score if bool(residual_score.max() > 0) else p / noise
            result[req, num_accepted] = int(score.argmax())
        start += num_drafts
    if out is None:
        return result.to(target_probs.device)
    out.copy_(result)
    return out
