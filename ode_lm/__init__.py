"""ode-lm: pretraining Neural ODE Transformers (DiffEqFormer) in JAX."""

__version__ = "0.1.0"
