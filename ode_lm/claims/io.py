"""Atomic JSON files for the suite's records and its ``claims.json``."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def _clean(obj: Any) -> Any:
    """NaN / inf as None (strict JSON); tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(obj), f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    """The file's JSON, or None when there is no file; a damaged file is one clear error."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}); delete it to "
                         "start the suite's records anew") from None
