"""ode-lm aot: topology names, clear errors, and a real TPU compile (with libtpu)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ode_lm.commands import aot as aot_compile

REPO = pathlib.Path(__file__).resolve().parents[2]

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
    return subprocess.run([sys.executable, "-m", "ode_lm", "aot", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


TINY = ["--gin_file=configs/models/tiny.gin", "--gin_file=configs/data/builtin.gin"]


def test_cli_unknown_topology_exits_2():
    r = run_tool(*TINY, "--topology=v9-64")
    assert r.returncode == 2  # a flag's value: a usage error
    assert r.stderr.strip().splitlines() == [
        "ode-lm aot: error: --topology='v9-64': unknown TPU generation 'v9' "
        "(v4, v5e, v5p, v6e) (see --help)"]


def test_cli_json_into_a_missing_directory_exits_1(tmp_path):
    r = run_tool(*TINY, "--topology=v5e:2x2", f"--json={tmp_path}/no/such/report.json")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        f"ode-lm aot: error: --json={tmp_path}/no/such/report.json: no such directory")


def test_vanilla_of_a_discrete_model_is_a_clear_error():
    cfg = aot_compile.load_gin(["configs/models/tiny.gin", "configs/data/builtin.gin"],
                               ["--gin.ModelConfig.architecture='sequential'"])
    with pytest.raises(ValueError, match="^--vanilla: ModelConfig.architecture='sequential'"):
        aot_compile.vanilla_config(cfg)


@needs_libtpu
def test_mesh_that_does_not_match_the_topology():
    r = run_tool(*TINY, "--topology=v5e:2x2", "--gin.MeshConfig.ici_parallelism=(1, 8, 1)")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ode-lm aot: error: MeshConfig does not match "
                           "--topology=v5e:2x2 (4 chips in 1 slice(s))")
    assert "(1, 8, 1)" in last


@needs_libtpu
@pytest.mark.slow
def test_tiny_compiles_for_v5e_2x2():
    """The real train step of configs/models/tiny, compiled for a 4-chip v5e slice."""
    r = run_tool(*TINY, "--topology=v5e:2x2", "--step_time=0.01")
    assert r.returncode == 0, r.stderr[-3000:]
    # off a TPU VM libtpu is told the accelerator and hosts: none of its lookup noise
    assert "TPU_WORKER_HOSTNAMES" not in r.stderr and "accelerator type" not in r.stderr, \
        r.stderr[-3000:]
    out = dict(line.split(None, 1) for line in r.stdout.splitlines() if line.strip())
    assert out["mesh"] == "{'data': 1, 'fsdp': 4, 'tensor': 1}"
    assert out["fits"] == "yes"
    peak = float(out["peak/chip"].split()[0])
    assert 0.0 < peak < 1.0  # GiB: a 4.4M-parameter model, 2 sequences per chip
    compiled = float(out["FLOPs/chip"].split()[1])
    assert compiled > 1e8
    assert out["estimate"].endswith("(roofline estimate, not a measurement)")
    assert out["comm/chip"].split()[0] != "0.0"
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
    # the hypernetwork: the block's generated maps, without its norms (accounting.param_count)
    return count(params), count({k: v for k, v in params["block"].items()
                                 if k not in ("norm1", "norm2")})


@needs_libtpu
@pytest.mark.slow
def test_a_batch_too_big_for_hbm_exits_1():
    r = run_tool(*TINY, "--topology=v5e:2x2", "--global_batch=65536")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "fits         NO" in r.stdout
    assert "ode-lm aot: does not fit: the train step needs" in r.stderr
    assert "on v5e:2x2 (16 GiB HBM)" in r.stderr


def test_required_memory_is_read_from_the_compile_error():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (209.36G) exceeds available HBM (95.74G).")
    assert aot_compile._required_bytes(msg) / GiB == pytest.approx(209.36)
    assert aot_compile._required_bytes("RESOURCE_EXHAUSTED: something else") == 0


# ------------------------------------------------------------ communication + roofline


def test_conv_flops_count_only_real_taps():
    """TPU HLO writes the weight-generation contraction [K, D] x [D, P] as a convolution
    with a padded window; its FLOPs are 2·K·D·P, not 2·out·window."""
    from ode_lm.bench import hlo_parse, hlo_report

    text = (
        "HloModule m\n"
        "ENTRY %main (g: f32[4,20,1,1,1], a: f32[20,32,3,4,32]) -> f32[4,32,3,4,32] {\n"
        "  %g = f32[4,20,1,1,1]{4,3,2,1,0} parameter(0)\n"
        "  %a = f32[20,32,3,4,32]{4,3,2,1,0} parameter(1)\n"
        "  ROOT %c = f32[4,32,3,4,32]{4,0,3,2,1} convolution(%g, %a), "
        "window={size=32x3x4 pad=31_31x2_2x3_3 rhs_reversal=1x1x1}, "
        "dim_labels=bf012_i012o->b012f\n"
        "}\n")
    comps = hlo_parse.parse_module(text)
    conv = comps["main"].instructions["c"]
    assert hlo_report.dot_flops(conv, comps["main"]) == 2 * 4 * 20 * (32 * 3 * 4 * 32)


def test_trip_count_from_annotation_and_reversed_compare():
    from ode_lm.bench import hlo_parse

    text = """HloModule m
%cond (p: (s32[], f32[2])) -> pred[] {
  %p = (s32[], f32[2]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%n, %i), direction=GT
}
%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %p = (s32[], f32[2]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[2] get-tuple-element(%p), index=1
  %three = s32[] constant(3)
  %next = s32[] add(%i, %three)
  ROOT %t = (s32[], f32[2]) tuple(%next, %x)
}
ENTRY %main (x: f32[2]) -> (s32[], f32[2]) {
  %x = f32[2] parameter(0)
  %one = s32[] constant(1)
  %init = (s32[], f32[2]) tuple(%one, %x)
  %w = (s32[], f32[2]) while(%init), condition=%cond, body=%body
  ROOT %w2 = (s32[], f32[2]) while(%init), condition=%cond, body=%body, KNOWN
}
""".replace("KNOWN", 'backend_config={"known_trip_count":{"n":"7"}}')
    comps = hlo_parse.parse_module(text)
    entry = comps["main"]
    # i = 1, 4, 7 run (10 > i), 10 stops: 3 trips
    assert hlo_parse.trip_count(comps, entry, entry.instructions["w"]) == (3, "loop condition")
    assert hlo_parse.trip_count(comps, entry, entry.instructions["w2"])[0] == 7


def _v5e_2x2_mesh():
    import numpy as np
    from jax.sharding import Mesh

    topo = aot_compile.parse_topology("v5e:2x2")
    return Mesh(np.array(aot_compile.topology_devices(topo)), ("x",))


@needs_libtpu
def test_collectives_and_flops_are_multiplied_by_nested_trip_counts():
    """Hand count: one all-gather outside the loops; per outer step (5) an all-reduce, per
    inner step (3 per outer) an all-reduce and a [8,128]x[128,128] dot: 5 + 15 all-reduces,
    15 dots. XLA's own cost analysis would count each loop body once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ode_lm.bench import hlo_report

    mesh = _v5e_2x2_mesh()

    def per_chip(x, w):  # x: this chip's [2, 128] rows; w: replicated [128, 128]
        full = jax.lax.all_gather(x, "x", tiled=True)  # f32[8, 128] = 4096 bytes, once

        def inner(_, a):
            return jax.lax.psum(jnp.sin(a @ w), "x")

        def outer(_, a):
            return jax.lax.psum(jnp.cos(jax.lax.fori_loop(0, 3, inner, a)), "x")

        return jax.lax.fori_loop(0, 5, outer, full)

    fn = jax.jit(jax.shard_map(per_chip, mesh=mesh, in_specs=(P("x"), P()), out_specs=P(),
                               check_vma=False))
    args = (jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
            jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P())))
    cost = hlo_report.analyze(fn.lower(*args).compile().as_text())
    kinds = cost.by_kind()
    assert kinds["all-gather"] == {"count": 1, "bytes_per_chip": 8 * 128 * 4}
    assert kinds["all-reduce"] == {"count": 20, "bytes_per_chip": 20 * 8 * 128 * 4}
    assert sorted(lp.multiplicity for lp in cost.loops) == [5, 15]
    assert cost.flops == 15 * 2 * 8 * 128 * 128
    assert cost.collective_bytes == 21 * 8 * 128 * 4


def _tiny_report(num_steps: int, label: str = "") -> aot_compile.Report:
    cfg = aot_compile.load_gin(["configs/models/tiny.gin", "configs/data/builtin.gin"],
                               [f"--gin.ODE_STEPS={num_steps}"])
    if label:
        cfg = aot_compile.vanilla_config(cfg)
    topo = aot_compile.parse_topology("v5e:2x2")
    devices = aot_compile.topology_devices(topo)
    return aot_compile.compile_train_step(cfg, topo, devices, cfg["data"].global_batch_size,
                                          label=label)


@needs_libtpu
@pytest.mark.slow
def test_tiny_ode_in_loop_collectives_scale_with_num_steps(tmp_path, monkeypatch):
    """Compiled at N and 2N, the scanned ODE's in-loop collectives double (the loops run
    N times forward and backward); outside the loops only the few per-step tensors
    precomputed with a leading N axis grow. The JSON has the documented layout."""
    from ode_lm.bench import hlo_report

    monkeypatch.chdir(REPO)
    n = 2
    one, two = _tiny_report(n), _tiny_report(2 * n)
    for r, steps in ((one, n), (two, 2 * n)):
        assert [lp["trip_count"] for lp in r.comm["loops"]] == [steps, steps]
    c1, c2 = one.comm["in_loop_collectives"], two.comm["in_loop_collectives"]
    assert c1["count"] > 0 and c2["count"] == 2 * c1["count"]
    assert c2["bytes_per_chip"] == 2 * c1["bytes_per_chip"]
    outside = [r.comm["collective_bytes_per_chip"] - r.comm["in_loop_collectives"][
        "bytes_per_chip"] for r in (one, two)]
    assert abs(outside[1] - outside[0]) < 0.01 * (c2["bytes_per_chip"] - c1["bytes_per_chip"])
    # The HLO's dot FLOPs with trip counts agree with the analytic model count (the
    # compiled attention is not causal-masked, so a little above it); without trip
    # counts it would be about half.
    for r in (one, two):
        flops = r.comm["flops_per_chip"]
        assert 0.9 < flops["hlo_dots_with_trip_counts"] / flops["analytic_model"] < 1.3
        assert r.comm["estimate"]["bound"] in ("compute", "memory", "communication")
        assert 0 < r.comm["estimate"]["mfu"] < 1
    # N·stages = 2 <= D+1 = 21: W(t) is the cheaper thing to gather, and the program does
    vanilla = _tiny_report(n, label="vanilla")
    path = tmp_path / "report.json"
    aot_compile.write_json(str(path), [one, vanilla])
    data = json.loads(path.read_text())
    assert set(data["collectives"]) >= set(hlo_report.KINDS)
    for kind in hlo_report.KINDS:
        assert isinstance(data["collectives"][kind]["count"], int)
        assert isinstance(data["collectives"][kind]["bytes_per_chip"], float)
    assert data["collective_bytes_per_chip"] == pytest.approx(
        sum(v["bytes_per_chip"] for v in data["collectives"].values()))
    assert data["analytic_min_bytes_per_chip"] > 0
    assert set(data["estimate"]) >= {"step_s", "mfu", "bound"}
    assert data["analytic_choice"]["cheaper"] == "W(t)"
    assert data["gathers_bytes_per_chip"]["W(t)"] > data["gathers_bytes_per_chip"]["A"]
    assert data["vanilla"]["label"] == "vanilla" and "gathers_bytes_per_chip" in data["vanilla"]
    assert data["collective_bytes_ratio_vs_vanilla"] == pytest.approx(
        data["collective_bytes_per_chip"] / data["vanilla"]["collective_bytes_per_chip"])


def test_async_collective_continued_inside_a_loop_counts_once():
    """TPU overlaps an in-flight all-gather with a loop: its continuation fusion inside the
    body repeats the all-gather (same channel id). It is one all-gather, not one per trip."""
    from ode_lm.bench import hlo_report

    ag = ("all-gather(%x), channel_id=5, replica_groups={{0,1,2,3}}, dimensions={0}, "
          'frontend_attributes={chain_id="1"}')
    text = f"""HloModule m
%start_fusion (x: f32[2,8]) -> (f32[2,8], f32[8,8]) {{
  %x = f32[2,8]{{1,0}} parameter(0)
  %ag = f32[8,8]{{1,0}} {ag}
  ROOT %s = (f32[2,8], f32[8,8]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}}
%continuation (x: f32[2,8], y: f32[4]) -> f32[4] {{
  %x = f32[2,8]{{1,0}} parameter(0)
  %y = f32[4]{{0}} parameter(1)
  %ag = f32[8,8]{{1,0}} {ag}
  ROOT %z = f32[4]{{0}} sine(%y)
}}
%cond (p: (s32[], f32[2,8], f32[4])) -> pred[] {{
  %p = (s32[], f32[2,8], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}
%body (p: (s32[], f32[2,8], f32[4])) -> (s32[], f32[2,8], f32[4]) {{
  %p = (s32[], f32[2,8], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[2,8]{{1,0}} get-tuple-element(%p), index=1
  %y = f32[4]{{0}} get-tuple-element(%p), index=2
  %f = f32[4]{{0}} fusion(%x, %y), kind=kCustom, calls=%continuation
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[2,8], f32[4]) tuple(%next, %x, %f)
}}
ENTRY %main (x: f32[2,8], y: f32[4]) -> (s32[], f32[2,8], f32[4]) {{
  %x = f32[2,8]{{1,0}} parameter(0)
  %y = f32[4]{{0}} parameter(1)
  %s = (f32[2,8], f32[8,8]) fusion(%x), kind=kCustom, calls=%start_fusion
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,8], f32[4]) tuple(%zero, %x, %y)
  ROOT %w = (s32[], f32[2,8], f32[4]) while(%init), condition=%cond, body=%body
}}
"""
    cost = hlo_report.analyze(text)
    assert [lp.trip_count for lp in cost.loops] == [3]
    assert cost.by_kind()["all-gather"] == {"count": 1, "bytes_per_chip": 8 * 8 * 4}
