"""``--verify``: load an export back and compare its logits with ode-lm's on a fixed batch.

`hf` exports are loaded by transformers on torch CPU (the optional ``[hf]`` extra), `raw`
exports by ode-lm itself. The reference is the *source* model's forward: for an ODE that is
the solve at the exported M steps, so the check also covers materialisation.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

TOLERANCE = {"fp32": 1e-4, "bf16": 0.25}


def fixed_batch(vocab_size: int, max_len: int, batch: int = 2, length: int = 16) -> np.ndarray:
    rng = np.random.default_rng(1234)
    return rng.integers(0, vocab_size, size=(batch, min(length, max_len)), dtype=np.int64)


def reference_logits(model: nnx.Module, tokens: np.ndarray, num_steps: int | None) -> np.ndarray:
    import jax.numpy as jnp

    from ode_lm.models.solve import Solve

    return np.asarray(model(jnp.asarray(tokens, jnp.int32), solve=Solve(None, num_steps)))


def require_hf() -> None:
    """Fail before any file is written when ``--verify`` of an hf export cannot run."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"--verify of an hf export needs {' and '.join(missing)} (not "
                          "installed); install them with: pip install -e '.[hf]'")


def needs_remote_code(export_dir: str) -> bool:
    """True for exports that ship modelling files (``auto_map`` in config.json)."""
    import json
    import os

    with open(os.path.join(export_dir, "config.json")) as f:
        return "auto_map" in json.load(f)


def hf_logits(export_dir: str, tokens: np.ndarray) -> np.ndarray:
    """Loaded as a user would: stock classes without ``trust_remote_code``."""
    require_hf()
    import torch
    import transformers

    kw = {"trust_remote_code": True} if needs_remote_code(export_dir) else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        export_dir, dtype=torch.float32, **kw)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens))
    return out.logits.float().numpy()


def raw_logits(export_dir: str, tokens: np.ndarray, num_steps: int | None) -> np.ndarray:
    from ode_lm.export.raw import load_raw

    model, _ = load_raw(export_dir)
    return reference_logits(model, tokens, num_steps)
