"""Depth materialisation: the ODE at M Euler steps as a plain M-layer parallel transformer.

Layer k holds the static weights W(t_{k+1}) (Euler evaluates at the step's end time) with dt
folded into the output projections of both branches (``out_*``, ``mlp_out_*``), so
x_{k+1} = x_k + Attn_k(Norm1_k(x_k)) + MLP_k(Norm2_k(x_k)) is exactly the Euler step. The
result is a ``ParallelLM`` — the baseline family, and GPT-NeoX for the neox flavour.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm.models import solvers
from ode_lm.models.baselines import ParallelLM
from ode_lm.models.lm import DiffEqFormer
from ode_lm.models.vector_field import OUTPUT_PROJECTIONS


def _copy(dst: nnx.Variable, value: jax.Array) -> None:
    dst.set_value(jnp.asarray(value, jnp.float32))


def materialize(model: DiffEqFormer, num_steps: int | None = None,
                solver: str = "euler") -> ParallelLM:
    """A ``ParallelLM`` with M = ``num_steps`` layers whose logits equal the ODE's at M steps."""
    if not isinstance(model, DiffEqFormer):
        raise TypeError(f"materialize: expected a DiffEqFormer, got {type(model).__name__}")
    if solver != "euler":
        raise ValueError(f"materialize: solver={solver!r}; only 'euler' is a stack of parallel "
                         "blocks (midpoint/rk4 steps are not)")
    m = model.config.num_steps if num_steps is None else num_steps
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"materialize: num_steps={m!r} must be a positive int")
    cfg = model.config.replace(architecture="parallel", num_layers=m)
    grid = solvers.FixedGrid(m)
    stacked = jax.vmap(model.weights_at)(grid.times("euler")[:, 0])
    for name in OUTPUT_PROJECTIONS:
        if name in stacked:
            stacked[name] = stacked[name] * grid.dt
    out = nnx.eval_shape(lambda: ParallelLM(cfg, nnx.Rngs(0)))
    for name, var in out.blocks.weights.items():
        _copy(var, stacked[name])
    _copy(out.embeddings.token, model.embeddings.token[...])
    if model.embeddings.position is not None:
        _copy(out.embeddings.position, model.embeddings.position[...])
    _copy(out.head.norm_scale, model.head.norm_scale[...])
    if model.head.norm_bias is not None:
        _copy(out.head.norm_bias, model.head.norm_bias[...])
    if model.head.kernel is not None:
        _copy(out.head.kernel, model.head.kernel[...])
    return out
