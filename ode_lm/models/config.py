"""ModelConfig: one frozen dataclass describes every model ode-lm builds.

``architecture`` picks the family member (the DiffEqFormer ODE or a discrete baseline),
``flavour`` picks the block internals (GPT-2, Llama, Pythia/GPT-NeoX). ``num_steps`` is a
*default* for the ODE solve: every forward call may override it. The defaults are the
paper's architecture and recipe (``configs/recipes/paper.gin`` pins them); a run that should
hold at any N includes ``configs/recipes/depth_robust.gin``.
"""

from __future__ import annotations

import dataclasses

from ode_lm.config_types import (
    check_types,
    require,
    require_at_least,
    require_fraction,
    require_one_of,
    require_positive,
)
from ode_lm.models.tableaus import ADAPTIVE_SOLVERS, SOLVERS  # noqa: F401  (the names' home)

FLAVOURS = ("gpt2", "llama", "neox")
ARCHITECTURES = ("ode", "sequential", "parallel")
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "dots_saveable")
WEIGHT_GENERATION = ("auto", "in_scan", "precompute")
# auto: splash (Pallas) on TPU, cuDNN on GPU, the written-out XLA form on CPU
ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    flavour: str = "gpt2"
    architecture: str = "ode"  # ode = DiffEqFormer; sequential / parallel = discrete baselines
    vocab_size: int = 256
    d_model: int = 64
    num_heads: int = 2
    mlp_dim: int | None = None  # None -> 4 * d_model
    max_seq_len: int = 1024  # learned positions (gpt2) / RoPE cache length
    # ODE
    num_steps: int = 12  # default solver steps N (a setting, not a parameter count)
    solver: str = "euler"
    time_embed_dim: int = 20  # D
    sinusoidal_dim: int = 128  # S -> time features of size 2S+1
    # φ(t) frequencies time_scale·ω_k, ω_k = max_period^(−k/S): the paper's 1000 / 10⁴ give
    # periods far below dt (W(t) is only defined on the training grid); a scale of a few
    # radians makes W(t) smooth on [0, 1] (configs/recipes/depth_robust.gin).
    time_scale: float = 1000.0
    time_max_period: float = 10000.0
    time_dependent: bool = True  # False: autonomous weight-shared ODE (ablation)
    # auto: precompute when the N·stages generated weight sets are no larger than the D
    # coefficient sets (N·stages <= D), else generate W(t) inside the scan step.
    weight_generation: str = "auto"
    random_grid_offset: bool = False
    # adaptive solvers (evaluation / analysis / generation): default tolerances
    rtol: float = 1e-3
    atol: float = 1e-6
    # discrete baselines
    num_layers: int = 12
    # numerics
    dtype: str = "float32"  # compute dtype; params are always float32
    remat: str = "none"
    attention_impl: str = "auto"  # one of ATTENTION_IMPLS (models/common.attention_impl)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0  # neox: fraction of head_dim that is rotated
    dropout_rate: float = 0.0
    init_std: float = 0.02

    def __post_init__(self):
        check_types(self)
        for name, allowed in (("flavour", FLAVOURS), ("architecture", ARCHITECTURES),
                              ("solver", SOLVERS), ("dtype", DTYPES), ("remat", REMAT),
                              ("weight_generation", WEIGHT_GENERATION),
                              ("attention_impl", ATTENTION_IMPLS)):
            require_one_of(self, name, allowed)
        require_at_least(self, 1, "vocab_size", "d_model", "num_heads", "mlp_dim", "max_seq_len",
                         "num_steps", "time_embed_dim", "sinusoidal_dim", "num_layers")
        require(self, "d_model", self.d_model % self.num_heads == 0,
                f"not divisible by num_heads={self.num_heads}")
        require_positive(self, "time_scale", "rtol", "norm_eps", "rope_theta", "init_std")
        require(self, "time_max_period", self.time_max_period > 1.0, "must be > 1")
        require(self, "atol", self.atol >= 0, "must be >= 0")
        require(self, "rotary_fraction", 0.0 < self.rotary_fraction <= 1.0, "must be in (0, 1]")
        require_fraction(self, "dropout_rate")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim if self.mlp_dim is not None else 4 * self.d_model

    @property
    def time_feature_dim(self) -> int:
        return 2 * self.sinusoidal_dim + 1

    @property
    def tied_embeddings(self) -> bool:
        return self.flavour == "gpt2"

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)
