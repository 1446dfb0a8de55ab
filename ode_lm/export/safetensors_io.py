"""Writing (optionally sharded) safetensors checkpoints the way Hugging Face lays them out.

One ``model.safetensors`` below ``max_shard_bytes``; above it ``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json`` mapping every tensor name to its shard, which
``from_pretrained`` follows. numpy + ml_dtypes only, so export needs no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

DTYPES = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def cast(tensors: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Floating tensors to ``dtype`` (fp32|bf16), contiguous; integer tensors unchanged."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}: expected one of {tuple(DTYPES)}")
    out = {}
    for name, x in tensors.items():
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16:
            x = x.astype(DTYPES[dtype])
        out[name] = np.ascontiguousarray(x)
    return out


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (no race)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _save_file(tensors: Mapping[str, np.ndarray], path: str, metadata: Mapping[str, str]) -> None:
    """``safetensors`` writes a private (0600) temp file and renames it; give the result the
    mode any other file gets (0666 & ~umask), so a shared export is readable like its JSON."""
    save_file(dict(tensors), path, metadata=dict(metadata))
    os.chmod(path, 0o666 & ~_umask())


def save_sharded(
    tensors: Mapping[str, np.ndarray],
    out_dir: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Write ``tensors`` into ``out_dir``; returns the shard file names (in order)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be > 0")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in tensors:  # greedy fill in insertion order, one tensor never split
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        _save_file(shards[0], os.path.join(out_dir, WEIGHTS_NAME), meta)
        return [WEIGHTS_NAME]
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        _save_file(shard, os.path.join(out_dir, fname), meta)
        weight_map.update({k: fname for k in shard})
    total = sum(int(x.nbytes) for x in tensors.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def load_sharded(out_dir: str) -> dict[str, np.ndarray]:
    """Read back what ``save_sharded`` wrote (single file or index + shards)."""
    index = os.path.join(out_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [WEIGHTS_NAME]
    out: dict[str, np.ndarray] = {}
    for fname in files:
        path = os.path.join(out_dir, fname)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: safetensors file missing from the export")
        out.update(load_file(path))
    return out
