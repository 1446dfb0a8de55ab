"""The benchmark sizes of ``ode-lm bench`` (``tiny``, ``cpu_small``, ``gpu_large``), read
from ``configs/models/<name>.gin`` so each model size has one source.

A model gin file binds ``ModelConfig.*`` (literals or ``%MACRO``s defined in the same file)
and the ``BATCH_SIZE`` macro that the data configs read; that is all a bench needs. The file
is read with gin's parser alone: nothing is registered, and gin's global config is untouched,
so a bench never disturbs a caller's gin state.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from ode_lm.models.config import ModelConfig

MODELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs" / "models"
PRESETS = ("tiny", "cpu_small", "gpu_large")  # each is configs/models/<name>.gin


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark shape: model width/depth, batch and the hypernetwork sizes (D, S).

    ``model_bindings``: every ``ModelConfig.*`` binding of the gin file (the fields above
    are read from them), applied by :meth:`model_config`.
    """

    name: str
    d_model: int
    num_heads: int
    num_steps: int  # ODE steps N = layers of the vanilla baseline
    seq_len: int
    batch_size: int
    vocab_size: int
    time_embed_dim: int = 20  # D
    sinusoidal_dim: int = 16  # S
    flavour: str = "gpt2"
    dtype: str = "float32"
    model_bindings: tuple[tuple[str, Any], ...] = ()

    def model_config(self, architecture: str = "ode", **overrides: Any) -> ModelConfig:
        base = ModelConfig(**dict(self.model_bindings)).replace(
            flavour=self.flavour, architecture=architecture, vocab_size=self.vocab_size,
            d_model=self.d_model, num_heads=self.num_heads, max_seq_len=self.seq_len,
            num_steps=self.num_steps, num_layers=self.num_steps,
            time_embed_dim=self.time_embed_dim, sinusoidal_dim=self.sinusoidal_dim,
            dtype=self.dtype,
        )
        return base.replace(**overrides)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def read_model_gin(path: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(macros, ``ModelConfig`` bindings) of one model gin file, macros resolved."""
    from ode_lm.gin_setup import model_file_bindings

    return model_file_bindings(pathlib.Path(path))


def load_preset(name: str, models_dir: str | pathlib.Path = MODELS_DIR) -> BenchConfig:
    """The bench shape of ``<models_dir>/<name>.gin`` (batch: its ``BATCH_SIZE`` macro)."""
    path = pathlib.Path(models_dir) / f"{name}.gin"
    if not path.is_file():
        raise FileNotFoundError(f"--config={name!r}: {path} not found")
    macros, bindings = read_model_gin(path)
    if "BATCH_SIZE" not in macros:
        raise ValueError(f"{path}: no BATCH_SIZE macro (the bench's batch size)")
    bindings.pop("architecture", None)  # each bench picks its own
    model = ModelConfig(**bindings)
    return BenchConfig(
        name, model.d_model, model.num_heads, model.num_steps, model.max_seq_len,
        int(macros["BATCH_SIZE"]), model.vocab_size, model.time_embed_dim,
        model.sinusoidal_dim, model.flavour, model.dtype,
        model_bindings=tuple(sorted(bindings.items())),
    )


CONFIGS: dict[str, BenchConfig] = {name: load_preset(name) for name in PRESETS}


def get_config(name: str) -> BenchConfig:
    if name not in CONFIGS:
        raise ValueError(f"--config={name!r}: expected one of {sorted(CONFIGS)}")
    return CONFIGS[name]
