"""Causal self-attention over packed documents through the splash-attention Pallas kernel.

The kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) tiles q/k/v in 128-row
blocks, skips the blocks the causal mask hides and applies the segment-id mask inside each
tile, so no [T, T] logits or mask is ever stored: that is the temporary memory the written-out
XLA form spends. It is a TPU (Mosaic) kernel; on any other backend it runs in Pallas
interpret mode (slow; used by the tests to check it against the XLA form on a CPU).

It sees one sequence at a time ([heads, T, head_dim]): the batch is vmapped, and under a mesh
the call is a ``shard_map`` over the batch and head shardings of q (a Pallas call cannot be
partitioned by XLA itself); the length axis is never split.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec

BLOCK = 128  # rows per q / kv tile (the kernel needs multiples of the 128-lane width)


def check_length(seq_len: int) -> None:
    if seq_len % BLOCK:
        raise ValueError(f"ModelConfig.attention_impl='splash': the sequence length {seq_len} "
                         f"must be a multiple of {BLOCK} (use 'xla' or 'auto')")


def _kernel(num_heads: int, seq_len: int, interpret: bool):
    mask = sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len)) for _ in range(num_heads)])
    sizes = sa.BlockSizes(
        block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
        block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
        block_q_dq=BLOCK, block_kv_dq=BLOCK,
    )
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def _local(q, k, v, segment_ids, interpret: bool):
    """[B, T, N, H] (one shard) → [B, T, N, H]; q is already scaled by 1/√H."""
    _, t, n, _ = q.shape
    kernel = _kernel(n, t, interpret)

    def one(q1, k1, v1, seg):
        out = kernel(q1.swapaxes(0, 1), k1.swapaxes(0, 1), v1.swapaxes(0, 1),
                     segment_ids=sa.SegmentIds(q=seg, kv=seg))
        return out.swapaxes(0, 1)

    return jax.vmap(one)(q, k, v, segment_ids)


def splash_attention(q, k, v, segment_ids, *, spec: PartitionSpec | None, interpret: bool):
    """softmax(q kᵀ, causal ∧ same segment) v for q (scaled), k, v [B, T, N, H] and
    segment_ids [B, T]. ``spec`` is q's mesh PartitionSpec (None outside a mesh)."""
    check_length(q.shape[1])
    if spec is None:
        return _local(q, k, v, segment_ids, interpret)
    qkv_spec = PartitionSpec(spec[0], None, spec[2], None)
    seg_spec = PartitionSpec(spec[0], None)

    def body(q, k, v, seg):
        return _local(q, k, v, seg, interpret)

    return jax.shard_map(body, in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_spec),
                         out_specs=qkv_spec, check_vma=False)(q, k, v, segment_ids)
