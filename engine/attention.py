"""One layer's attention in one engine step.

Called by the model runner once per layer per step. On CUDA (`attend`), after the
runner wrote the step's K/V into the paged cache, two paths share the step:

- whole-prompt prefills (no cached prefix, at least DENSE_PREFILL_MIN_TOKENS new
  tokens) attend over their own fresh K/V through PyTorch's fused causal SDPA
  (the flash kernels Hugging Face uses too): a long prompt's recompute is never
  slower than the reference implementation. Its length is padded up to a bucket
  (:func:`dense_bucket_len`): the backend plans per shape (cuDNN builds a plan per
  new length, tens of milliseconds), so a few dozen buckets, all planned at
  start-up by the warm-up, serve every length. Trailing padding is exact under a
  causal mask: no real row attends to a padded key;
- everything else (decode, speculative verification, chunked prefill over a
  prefix, a prompt after a cache hit) goes through the paged Triton kernel, with
  split-KV for a few long sequences.

In the deterministic mode the runner makes no dense span and every sequence goes
through the paged kernel's batch-invariant form (fixed tile, KV split only at fixed
token positions).

The runner lays the step's sequences out paged-first, so the paged kernel reads a
prefix of the batch metadata without another transfer.

On CPU (`attend_reference`, outside the deterministic mode) the cache write and the
attention are kernels.reference's, bit for bit, with their validation, slot lists and
masks made at the step's first layer and reused by the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import paged_attention, validation

# Shorter prompts gain little from the fused kernel; keep them in one paged launch.
DENSE_PREFILL_MIN_TOKENS = 1024
DENSE_PREFILL_DTYPES = (torch.float16, torch.bfloat16)
# Buckets per doubling of the length: padding stays under 1/16 of the length (the
# attention op only; the GEMMs run on the real tokens), 16 plans per octave.
DENSE_BUCKETS_PER_OCTAVE = 16


def dense_bucket_len(num_tokens: int) -> int:
    """The padded length of a whole-prompt span of `num_tokens` (>= 1) tokens: the next
    multiple of 1/`DENSE_BUCKETS_PER_OCTAVE` of the power of two below it, at least 64."""
    if num_tokens < 1:
        raise ValueError(f"a dense span needs at least one token, got {num_tokens}")
    step = max(64, (1 << (num_tokens.bit_length() - 1)) // DENSE_BUCKETS_PER_OCTAVE)
    return -(-num_tokens // step) * step


def dense_bucket_lens(max_tokens: int) -> list[int]:
    """Every bucket a dense span of DENSE_PREFILL_MIN_TOKENS..`max_tokens` tokens can take
    (what the start-up warm-up plans); empty when no span can be that long."""
    lens: list[int] = []
    num_tokens = DENSE_PREFILL_MIN_TOKENS
    while num_tokens <= max_tokens:
        bucket = dense_bucket_len(num_tokens)
        lens.append(bucket)
        num_tokens = bucket + 1
    return lens


def dense_causal_attention(
    query: torch.Tensor,  # [n, H, D]
    key: torch.Tensor,  # [n, KVH, D]
    value: torch.Tensor,  # [n, KVH, D]
    scale: float,
) -> torch.Tensor:
    """Causal self-attention of one whole prompt through the fused SDPA kernel, run at
    the bucketed length -> [n, H, D] (rows of the real tokens only)."""
    num_tokens = query.shape[0]
    padded_len = dense_bucket_len(num_tokens)
    # [1, heads, tokens, head_dim]; SDPA broadcasts the KV heads over query groups.
    q, k, v = (_padded_heads_first(t, padded_len) for t in (query, key, value))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return dense[0, :, :num_tokens].transpose(0, 1)


def _padded_heads_first(x: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[n, heads, D] (any strides) -> a new contiguous [1, heads, padded_len, D], zeros
    after row n. Always a copy: the backend's plans are keyed by strides too, so every
    call at one bucket must look alike (a view of the fused QKV projection has other
    strides than a padded buffer, and would miss the plan the warm-up made)."""
    num_tokens, num_heads, head_dim = x.shape
    out = x.new_empty((1, num_heads, padded_len, head_dim))
    out[0, :, :num_tokens].copy_(x.transpose(0, 1))
    if padded_len > num_tokens:
        out[0, :, num_tokens:].zero_()
    return out


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention (tensors on the model's device, the rest host values).

    Sequences [0, num_paged_seqs) go through the paged kernel; `dense_spans` holds the
    [begin, end) token ranges of the rest, which follow them in the flat batch.
    Built once per step by the model runner; `attend` reads it once per layer.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs], KV length after this step
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int  # largest number of new tokens of one paged sequence
    max_seq_len: int  # upper bound of seq_lens (sizes split-KV)
    num_paged_seqs: int
    dense_spans: tuple[tuple[int, int], ...] = ()
    #: the paged sequences' views of the tensors above, made at the step's first layer and
    #: reused by the others (every layer reads the same rows)
    _paged_views: PagedViews | None = field(default=None, init=False, repr=False, compare=False)
    #: the CPU path's per-pass work (attend_reference), made at the pass's first layer, and
    #: the last layer that used it (a layer index not above it starts a new pass)
    _reference_plan: ReferencePlan | None = field(default=None, init=False, repr=False, compare=False)
    _reference_layer: int = field(default=-1, init=False, repr=False, compare=False)

    def paged_views(self) -> PagedViews:
        """The paged sequences' metadata views, made once per step."""
        if self._paged_views is None:
            num_paged = self.num_paged_seqs
            spans = self.dense_spans
            if spans:
                self._paged_views = PagedViews(
                    num_tokens=spans[0][0],
                    block_tables=self.block_tables[:num_paged],
                    seq_lens=self.seq_lens[:num_paged],
                    query_start_loc=self.query_start_loc[: num_paged + 1],
                )
            else:  # every sequence is paged: the tensors as they are
                self._paged_views = PagedViews(None, self.block_tables, self.seq_lens, self.query_start_loc)
        return self._paged_views


@dataclass
class PagedViews:
    """The paged sequences' rows of one step's metadata (AttentionMetadata.paged_views)."""

    #: tokens of the paged sequences (the first ones of the batch); None: all of them
    num_tokens: int | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    #: whether the paged kernel validated the tensors' shapes, dtypes and devices already
    #: (set by the first layer's call; the other layers pass tensors of the same kinds)
    checked: bool = False


def is_dense_prefill(
    num_computed_tokens: int, num_new_tokens: int, num_drafts: int, dtype: torch.dtype
) -> bool:
    """Whether a scheduled sequence takes the fused whole-prompt path (host-side decision)."""
    return (
        num_computed_tokens == 0
        and num_drafts == 0
        and num_new_tokens >= DENSE_PREFILL_MIN_TOKENS
        and dtype in DENSE_PREFILL_DTYPES
    )


def attend(
    query: torch.Tensor,  # [T, H, D], head_dim contiguous
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], this step's K/V already written
    metadata: AttentionMetadata,
    scale: float,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """-> [T, H, D] in query's dtype. Never syncs the host. `batch_invariant` (the
    deterministic mode, whose metadata has no dense spans) runs the paged kernel's
    batch-invariant form. Called once per layer with the step's one `metadata`: the
    paged kernel checks its inputs' shapes, dtypes and devices at the first layer only
    (every layer passes the same kinds of tensors), and the views are made once."""
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if metadata.num_paged_seqs:
        paged = metadata.paged_views()
        num_tokens = paged.num_tokens
        paged_attention(
            query if num_tokens is None else query[:num_tokens],
            kv_layer,
            paged.block_tables,
            paged.seq_lens,
            paged.query_start_loc,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            check_values=False,
            check_inputs=not paged.checked,
            out=out if num_tokens is None else out[:num_tokens],
            batch_invariant=batch_invariant,
        )
        paged.checked = True
    for begin, end in metadata.dense_spans:
        out[begin:end].copy_(
            dense_causal_attention(query[begin:end], key[begin:end], value[begin:end], scale)
        )
    return out


@dataclass
class ReferencePlan:
    """What every layer of one CPU step shares: the validated metadata's cache-write
    indices and, per sequence with new tokens, its blocks and causal mask."""

    #: tokens whose K/V are written (slot != -1), and their blocks and offsets
    write_token_ids: torch.Tensor
    write_block_ids: torch.Tensor
    write_offsets: torch.Tensor
    #: (first query row, end row, KV length, block ids [used blocks], mask [new, KV length])
    sequences: list[tuple[int, int, int, torch.Tensor, torch.Tensor]]


def reference_plan(query: torch.Tensor, kv_layer: torch.Tensor, metadata: AttentionMetadata) -> ReferencePlan:
    """Validate the step's metadata as kernels.reference does (shapes and values: this
    reads the tensors) and precompute what every layer needs. Raises ValueError."""
    num_tokens = query.shape[0]
    validation.check_attention_inputs(
        query, kv_layer, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc
    )
    num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
    validation.check_attention_values(
        num_tokens, num_blocks, block_size, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc
    )
    slot_mapping = metadata.slot_mapping
    validation.check_slot_mapping(slot_mapping, num_tokens, kv_layer.device)
    validation.check_slot_values(slot_mapping, num_blocks * block_size)
    token_ids = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping[token_ids]
    sequences = []
    starts = metadata.query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        if end == start:
            continue
        block_ids = metadata.block_tables[seq_idx, : (seq_len + block_size - 1) // block_size].long()
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        allowed = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
        sequences.append((start, end, seq_len, block_ids, allowed))
    return ReferencePlan(token_ids, slots // block_size, slots % block_size, sequences)


def attend_reference(
    layer_idx: int,
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], written in place
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The CPU path: write the step's K/V into the layer's blocks, then attend -> [T, H, D].
    Bit-identical to kernels.reference's reshape_and_cache_ref + paged_attention_ref (the
    same torch ops on the same values); the metadata is validated and planned at the
    pass's first layer (every layer passes the same kinds of tensors). Layers come in
    increasing `layer_idx` order within a pass: a `layer_idx` not above the previous call's
    starts a new pass (a graph's metadata is reused with new buffer contents)."""
    plan = metadata._reference_plan
    if plan is None or layer_idx <= metadata._reference_layer:
        plan = metadata._reference_plan = reference_plan(query, kv_layer, metadata)
    metadata._reference_layer = layer_idx
    if (
        key.shape != value.shape
        or tuple(key.shape[1:]) != tuple(kv_layer.shape[3:])
        or key.shape[0] != query.shape[0]
    ):
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[{query.shape[0]}, {kv_layer.shape[3]}, {kv_layer.shape[4]}]"
        )
    kv_layer[0, plan.write_block_ids, plan.write_offsets] = key[plan.write_token_ids]
    kv_layer[1, plan.write_block_ids, plan.write_offsets] = value[plan.write_token_ids]
    num_kv_heads = kv_layer.shape[3]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for start, end, seq_len, block_ids, allowed in plan.sequences:
        # kernels.reference.paged_attention_ref's per-sequence body, op for op
        kv = kv_layer[:, block_ids].flatten(1, 2)[:, :seq_len].float()
        num_new = end - start
        k = kv[0].transpose(0, 1)[:, None].expand(num_kv_heads, group_size, seq_len, head_dim)
        v = kv[1].transpose(0, 1)[:, None].expand(num_kv_heads, group_size, seq_len, head_dim)
        q = query[start:end].float().view(num_new, num_kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        out[start:end] = attn.permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim).to(query.dtype)
    return out
