"""tools/aot_compile.py: topology names, clear errors, and a real TPU compile (with libtpu)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import aot_compile  # noqa: E402

GiB = 1024**3


def has_libtpu() -> bool:
    try:
        return aot_compile.libtpu_available()
    except ImportError:
        return False


needs_libtpu = pytest.mark.skipif(
    not has_libtpu(),
    reason="libtpu not installed (pip install -e '.[tpu]'); TPU AOT compile skipped",
)


@pytest.mark.parametrize(
    "name, raw, chips, hbm",
    [
        ("v5p-128", "v5p:4x4x4", 64, 95),
        ("v5e-256", "v5e:16x16", 256, 16),
        ("v4-64", "v4:2x4x4", 32, 32),
        ("v6e-256", "v6e:16x16", 256, 32),
        ("v5litepod-16", "v5e:4x4", 16, 16),
        ("v5p:4x4x4", "v5p:4x4x4", 64, 95),
        ("v5e:2x2", "v5e:2x2", 4, 16),
    ],
)
def test_topology_names(name, raw, chips, hbm):
    t = aot_compile.parse_topology(name)
    assert (t.raw, t.num_chips, t.chip.hbm_bytes) == (raw, chips, hbm * GiB)


def test_multi_slice_counts_every_chip():
    t = aot_compile.parse_topology("v5e-256", num_slices=4)
    assert (t.chips_per_slice, t.num_slices, t.num_chips) == (256, 4, 1024)


@pytest.mark.parametrize(
    "name, message",
    [
        ("v7-8", "unknown TPU generation 'v7'"),
        ("tpu-8", "unknown TPU generation 'tpu'"),
        ("v5p-100", "no standard v5p slice of that size"),
        ("v5e:2x2x2", "v5e needs 2 dimensions"),
        ("v5p:4x4", "v5p needs 3 dimensions"),
        ("TPU v4", "expected e.g. v5p-128"),
    ],
)
def test_unknown_topology_is_a_clear_error(name, message):
    with pytest.raises(ValueError, match="^--topology=") as e:
        aot_compile.parse_topology(name)
    assert message in str(e.value)


def test_num_slices_must_be_positive():
    with pytest.raises(ValueError, match="--num_slices=0"):
        aot_compile.parse_topology("v5e-256", num_slices=0)


def run_tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(REPO / "tools" / "aot_compile.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


TINY = ["--gin_file=configs/models/tiny.gin", "--gin_file=configs/data/builtin.gin"]


def test_cli_unknown_topology_exits_2():
    r = run_tool(*TINY, "--topology=v9-64")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "aot_compile.py: error: --topology='v9-64': unknown TPU generation 'v9' "
        "(v4, v5e, v5p, v6e)")


@needs_libtpu
def test_mesh_that_does_not_match_the_topology():
    r = run_tool(*TINY, "--topology=v5e:2x2", "--gin.MeshConfig.ici_parallelism=(1, 8, 1)")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("aot_compile.py: error: MeshConfig does not match "
                           "--topology=v5e:2x2 (4 chips in 1 slice(s))")
    assert "(1, 8, 1)" in last


@needs_libtpu
@pytest.mark.slow
def test_tiny_compiles_for_v5e_2x2():
    """The real train step of configs/models/tiny, compiled for a 4-chip v5e slice."""
    r = run_tool(*TINY, "--topology=v5e:2x2", "--step_time=0.01")
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(None, 1) for line in r.stdout.splitlines() if line.strip())
    assert out["mesh"] == "{'data': 1, 'fsdp': 4, 'tensor': 1}"
    assert out["fits"] == "yes"
    peak = float(out["peak/chip"].split()[0])
    assert 0.0 < peak < 1.0  # GiB: a 4.4M-parameter model, 2 sequences per chip
    compiled = float(out["FLOPs/chip"].split()[1])
    assert compiled > 1e8
    total, hyper = expected_params(TINY)
    assert out["params"] == f"{total:,} total, {hyper:,} in the hypernetwork"
    assert 0 < hyper < total


def expected_params(gin_flags: list[str]) -> tuple[int, int]:
    """Parameter counts of the configured model, from its abstract (eval_shape) build."""
    import math

    import jax
    from flax import nnx

    from ode_lm.models import build_model

    cfg = aot_compile.load_gin([f.split("=", 1)[1] for f in gin_flags], [])
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: build_model(cfg["model"], nnx.Rngs(0))), nnx.Param))
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    return count(params), count(params["block"])


@needs_libtpu
@pytest.mark.slow
def test_a_batch_too_big_for_hbm_exits_1():
    r = run_tool(*TINY, "--topology=v5e:2x2", "--global_batch=65536")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "fits         NO" in r.stdout
    assert "aot_compile.py: does not fit: the train step needs" in r.stderr
    assert "on v5e:2x2 (16 GiB HBM)" in r.stderr


def test_required_memory_is_read_from_the_compile_error():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (209.36G) exceeds available HBM (95.74G).")
    assert aot_compile._required_bytes(msg) / GiB == pytest.approx(209.36)
    assert aot_compile._required_bytes("RESOURCE_EXHAUSTED: something else") == 0
