"""Device mesh and THE logical-axis → mesh-axis rules table.

Every parameter and every large activation in ode-lm carries *logical* axis names
(``'embed'``, ``'mlp'``, ``'activation_batch'`` ...). This module is the only place
that maps them onto the physical mesh axes ``('data', 'fsdp', 'tensor')``.
"""

from __future__ import annotations

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
# Parameters (hypernetwork included) are FSDP-sharded on 'embed' and tensor-parallel on
# 'mlp' / 'heads' / 'vocab'. The time axes of the hypernetwork are small and replicated,
# so generating W(t) = W0 + sum_d g_d(t) A_d is a purely local computation whose result
# already has its kernel's sharding.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # --- parameters ---
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),            # head_dim
    ("qkv", None),           # the fused q/k/v axis of size 3
    ("position", None),      # learned absolute positions
    ("norm", None),          # 1-D norm scales/biases over the embedding
    ("layers", None),        # stacked discrete layers / ODE steps of materialised models
    ("time_embed", None),    # D: hypernetwork coefficient axis
    ("time_features", None), # 2S+1: sinusoidal time features
    ("time_hidden", None),   # hidden width of the per-weight time MLP
    # --- activations ---
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("activation_steps", None),
)
