"""ode-lm bench: a smoke run on ``tiny`` (so the script never rots), its FLOP counter,
summary arithmetic and flag errors. Speed figures live in the script's output, not here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ode_lm.bench import train_bench as bu


def load_tool(repo_root, name: str):
    """A script of tools/ as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, repo_root / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench_cli():
    from ode_lm.commands import bench

    return bench


def test_dot_flops_counts_scan_bodies_and_gradients():
    def f(w, x):
        def body(h, _):
            return jnp.tanh(h @ w), None  # [4, 8] @ [8, 8]: 2*4*8*8 = 512 FLOPs

        return jax.lax.scan(body, x, None, length=3)[0].sum()

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    assert bu.dot_flops(jax.make_jaxpr(f)(w, x).jaxpr) == 3 * 512
    # backward: one matmul for dx and one for dw per step -> 3x the forward
    assert bu.dot_flops(jax.make_jaxpr(jax.grad(f))(w, x).jaxpr) == 3 * 3 * 512


def test_matmul_peak_is_the_best_rate_of_2n3_flops(monkeypatch):
    """2·n³ FLOP over the fastest of the timed calls, wall and CPU clocks separately
    (fake clocks: each timed call takes 1, 0.5, 2 s wall and 4, 1, 3 s CPU)."""
    import time

    ticks = {"perf_counter": iter([0, 1, 10, 10.5, 20, 22]),
             "process_time": iter([0, 4, 10, 11, 20, 23])}
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks["perf_counter"])))
    monkeypatch.setattr(time, "process_time", lambda: float(next(ticks["process_time"])))
    wall, cpu = bu.matmul_peak("float32", n=64, repeats=3)
    assert wall == 2.0 * 64**3 / 0.5 and cpu == 2.0 * 64**3 / 1.0


def test_preset_sizes():
    tiny, small = bu.get_config("tiny"), bu.get_config("cpu_small")
    assert (tiny.d_model, tiny.num_heads, tiny.num_steps, tiny.seq_len, tiny.batch_size,
            tiny.vocab_size, tiny.time_embed_dim, tiny.sinusoidal_dim) == (
                128, 4, 4, 128, 8, 2048, 20, 16)
    assert (small.d_model, small.num_heads, small.num_steps, small.seq_len, small.batch_size,
            small.vocab_size, small.time_embed_dim, small.sinusoidal_dim) == (
                256, 4, 6, 256, 8, 8192, 20, 64)
    large = bu.get_config("gpu_large")
    assert (large.d_model, large.num_heads, large.num_steps, large.seq_len, large.batch_size,
            large.vocab_size, large.sinusoidal_dim, large.dtype) == (
                1024, 16, 12, 1024, 32, 32768, 64, "bfloat16")
    vanilla = small.model_config("parallel")
    assert vanilla.num_layers == small.num_steps and vanilla.architecture == "parallel"
    with pytest.raises(ValueError, match="--config='huge'"):
        bu.get_config("huge")


def test_presets_are_read_from_the_model_gin_files(tmp_path):
    """One source per size: a preset is its configs/models gin file (macros resolved, every
    ModelConfig binding kept), not a copy of it."""
    from ode_lm.bench import presets

    (tmp_path / "mini.gin").write_text(
        "WIDTH = 48\nBATCH_SIZE = 2\ntrain.model = @ModelConfig()\n"
        "ModelConfig.architecture = 'ode'\nModelConfig.d_model = %WIDTH\n"
        "ModelConfig.num_heads = 3\nModelConfig.num_steps = 5\nModelConfig.mlp_dim = 96\n"
        "ModelConfig.max_seq_len = 16\nModelConfig.vocab_size = 256\n")
    mini = presets.load_preset("mini", tmp_path)
    assert (mini.d_model, mini.num_heads, mini.num_steps, mini.seq_len, mini.batch_size,
            mini.vocab_size) == (48, 3, 5, 16, 2, 256)
    assert mini.model_config("parallel").mlp_dim == 96  # a binding without a preset field
    macros, bindings = presets.read_model_gin(presets.MODELS_DIR / "cpu_small.gin")
    small = bu.get_config("cpu_small")
    assert (bindings["d_model"], bindings["sinusoidal_dim"], macros["BATCH_SIZE"]) == (
        small.d_model, small.sinusoidal_dim, small.batch_size)
    (tmp_path / "nobatch.gin").write_text("ModelConfig.d_model = 8\n")
    with pytest.raises(ValueError, match="no BATCH_SIZE macro"):
        presets.load_preset("nobatch", tmp_path)


def test_summary_arithmetic(bench_cli):
    vanilla = {"step_s": 1.0, "cpu_s": 2.0, "mfu_vs_matmul_peak": 0.6, "mfu_cpu_time": 0.6,
               "params": 1000, "compiled_peak_bytes": 10_000,
               "relative_step_time": 1.0, "relative_cpu_time": 1.0}
    ode = {"step_s": 1.3, "cpu_s": 2.1, "mfu_vs_matmul_peak": 0.55, "mfu_cpu_time": 0.45,
           "params": 1500, "compiled_peak_bytes": 18_000,
           "relative_step_time": 1.2, "relative_cpu_time": 1.05}
    ckpt = [{"variant": "no saves", "relative_step_time": 1.0, "relative_cpu_time": 1.0},
            {"variant": "async save every 10", "relative_step_time": 1.01,
             "relative_cpu_time": 1.0},
            {"variant": "async save every step", "relative_step_time": 1 / 0.85,
             "relative_cpu_time": 2.1 / 2.0, "save_blocked_ms": 60.0,
             "save_blocked_fraction_of_step": 0.06}]
    t = bench_cli._summary({"compare": [vanilla, ode], "checkpoint": ckpt})
    # the paired (per-round) ratio; the ratio of medians is kept beside it
    assert t["ode_vanilla_step_ratio"]["value"] == pytest.approx(1.2)
    assert t["ode_vanilla_step_ratio"]["ratio_of_medians"] == pytest.approx(1.3)
    assert t["ode_vanilla_step_ratio"]["value_cpu_time"] == pytest.approx(1.05)
    assert t["ode_mfu_vs_matmul_peak"]["value"] == 0.55
    assert t["ode_mfu_vs_matmul_peak"]["value_cpu_time"] == 0.45
    # expected = 10_000 + 16 * 500 = 18_000
    assert t["ode_memory_vs_expected"]["expected_bytes"] == 18_000
    assert t["ode_memory_vs_expected"]["value"] == pytest.approx(1.0)
    assert t["ckpt_every_step_throughput_kept"]["value"] == pytest.approx(0.85)
    assert t["ckpt_every_step_throughput_kept"]["value_cpu_time"] == pytest.approx(2.0 / 2.1)
    assert t["ckpt_every_10_throughput_kept"]["value"] == pytest.approx(1 / 1.01)
    assert t["ckpt_blocked_fraction_of_step"]["value"] == pytest.approx(0.06)
    assert t["ckpt_blocked_fraction_of_step"]["blocked_ms"] == 60.0
    # figures only: no limits or verdicts of one machine
    assert not any({"limit", "met"} & set(v) for v in t.values())


def test_accelerator_peak_on_cpu_is_the_probed_peak(monkeypatch, tmp_path):
    from ode_lm import hardware

    monkeypatch.setenv("ODE_LM_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "probe_cpu_peak_flops", lambda: 5e10)
    hardware.cpu_peak_flops.cache_clear()
    try:
        peak, source = bu.accelerator_peak(jax.devices("cpu"), "float32")
    finally:
        hardware.cpu_peak_flops.cache_clear()
    assert peak == 5e10 and "probed CPU peak" in source  # one process: one host's peak


def test_checkpoint_blocks_pay_their_own_saves_and_pair_by_round():
    """time_in_blocks charges the wait for a block's last save to that block, and
    paired_block_ratio compares blocks of the same round (drift divided out)."""

    class Fake:
        def __init__(self, wall):
            self.wall, self.checkpointer = wall, self

        def step(self):
            return (self.wall, self.wall)

        def wait(self):  # a pending save: 50 ms of real waiting
            import time

            time.sleep(0.05)

    plain, saving = Fake(1.0), Fake(1.0)
    plain.checkpointer = None
    times = bu.time_in_blocks([plain, saving], steps=2, warmup=1, rounds=2)
    assert [w for w, _ in times[0]] == [1.0] * 4
    assert [w for w, _ in times[1]][::2] == [1.0, 1.0]  # first step of each block
    assert all(w >= 1.05 for w, _ in times[1][1::2])  # the wait lands on the last step
    # the host is 2x slower in round 2; the saving bench costs 1.1x in both rounds
    ref = [(1.0,), (1.0,), (2.0,), (2.0,)]
    other = [(1.1,), (1.1,), (2.2,), (2.2,)]
    assert bu.paired_block_ratio(other, ref, 2) == pytest.approx(1.1)


def test_paired_ratio_divides_out_drift():
    # the host slows down 2x halfway; each round the second bench is 1.05x the first
    first = [(1.0, 2.0)] * 5 + [(2.0, 4.0)] * 5
    second = [(1.05 * w, 1.1 * c) for w, c in first]
    assert bu.paired_ratio(second, first, 0) == pytest.approx(1.05)
    assert bu.paired_ratio(second, first, 1) == pytest.approx(1.1)
    # with the slow phase longer on one side, medians taken separately compare different
    # phases of the drift (2.1 / 1.0); the paired ratio does not
    ref = [(1.0, 2.0)] * 6 + [(2.0, 4.0)] * 4
    other = [(1.05 * w, 1.1 * c) for w, c in [(2.0, 4.0)] * 6 + [(1.0, 2.0)] * 4]
    other_sorted_like_ref = [(1.05 * w, 1.1 * c) for w, c in ref]
    assert bu.paired_ratio(other_sorted_like_ref, ref, 0) == pytest.approx(1.05)
    median = lambda xs: sorted(xs)[len(xs) // 2]
    assert median([w for w, _ in other]) / median([w for w, _ in ref]) == pytest.approx(2.1)


@pytest.mark.parametrize("argv, message", [
    (["--config", "huge"], "--config='huge'"),
    (["--steps", "0"], "--steps=0"),
    (["--sections", "compare,nope"], "--sections='compare,nope'"),
    (["--platform", "quantum"], "--platform='quantum'"),
    (["--json", "/no/such/dir/out.json"], "--json='/no/such/dir/out.json'"),
    (["--checkpoint-rounds", "0"], "--checkpoint-rounds=0"),
    (["--recipes", "depth_robust,nope"], "--recipes='depth_robust,nope': 'nope' is neither"),
    (["--recipes", "/no/such/recipe.gin"], "/no/such/recipe.gin not found"),
    (["--recipes", ","], "--recipes=','"),
])
def test_bad_flags_name_the_flag(bench_cli, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench_cli.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_smoke_tiny(repo_root, tmp_path):
    """The real command on ``tiny``: 2 timed steps, the comparison and checkpoint sections."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the real single device
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "ode_lm", "bench", "--config", "tiny",
         "--steps", "2", "--warmup", "1", "--sections", "compare,checkpoint",
         "--checkpoint-rounds", "1",
         "--matmul-size", "512", "--checkpoint-dir", str(tmp_path), "--json", str(out)],
        cwd=repo_root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ODE / vanilla step time" in proc.stdout
    result = json.loads(out.read_text())
    assert result["platform"] == "cpu" and len(result["devices"]) == 1
    vanilla, ode = result["groups"]["compare"]
    assert (vanilla["architecture"], ode["architecture"]) == ("parallel", "ode")
    assert ode["params"] > vanilla["params"]  # the hypernetwork coefficients
    for row in (vanilla, ode):
        assert row["steps_timed"] == 2 and row["step_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(8 * 128 / row["step_s"])
        assert math.isfinite(row["last_loss"]) and row["cpu_s"] > 0
        assert row["compiled_peak_bytes"] > 0
        # accounting's model FLOPs vs the matmuls traced in the real step's jaxpr (which
        # also counts the masked half of causal attention and the remat recomputation)
        assert 1.0 <= row["traced_matmul_flops_per_step"] / row["flops_per_step"] < 1.5
    # the ODE does at least the vanilla model's matmuls (plus weight generation)
    assert ode["flops_per_step"] >= vanilla["flops_per_step"]
    ratio = result["summary"]["ode_vanilla_step_ratio"]["value"]
    assert ratio == pytest.approx(ode["relative_step_time"])
    assert result["summary"]["ode_vanilla_step_ratio"]["ratio_of_medians"] == pytest.approx(
        ode["step_s"] / vanilla["step_s"])
    rows = {r["variant"]: r for r in result["groups"]["checkpoint"]}
    assert rows["async save every step"]["saves"] == 3  # 1 warm-up + 2 timed steps
    assert rows["async save every 10"]["saves"] == 0
    every = rows["async save every step"]
    assert 0 < every["save_blocked_ms"] <= every["save_blocked_ms_max"]
    assert every["save_blocked_fraction_of_step"] == pytest.approx(
        every["save_blocked_ms"] / 1e3 / rows["no saves"]["step_s_median"])
    assert not list(tmp_path.glob("bench_ckpt*"))  # timed checkpoints are cleaned up


def test_profile_groups_find_weight_generation_and_optimizer_ops(repo_root):
    """tools/profile_step.py attributes ops by the compiled HLO's op_name metadata: the
    named scopes of weight generation and the optimizer must survive compilation."""
    prof = load_tool(repo_root, "profile_step")
    cfg = bu.get_config("tiny")
    bench = bu.TrainBench("ode", cfg, cfg.model_config("ode"), bu.make_mesh(jax.devices()[:1]),
                          count_flops=False)
    ops = prof.hlo_ops(bench.compiled.as_text())
    groups = {prof.category(op_name) for _, op_name in ops.values()}
    assert {"weight generation", "optimizer", "ODE/layer body fwd", "ODE/layer body bwd",
            "head+loss fwd", "head+loss bwd"} <= groups
    assert prof.category("jit(train_step)/transpose(jvp())/while/body/dot_general") == \
        "ODE/layer body bwd"
    assert prof.category("") == "other"


@pytest.mark.timeout(600)
def test_bench_checkpoint_smoke_tiny(repo_root, tmp_path):
    """tools/bench_checkpoint.py on ``tiny``: every variant saves, costs CPU, cleans up."""
    out = tmp_path / "ckpt.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(repo_root / "tools" / "bench_checkpoint.py"), "--config", "tiny",
         "--saves", "1", "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)],
        cwd=repo_root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["per_save"]) == {"trainer", "on_loop", "sync_dirs", "synchronous",
                                       "keep_all", "no_ocdbt", "zstd", "snapshot", "flat",
                                       "tmpfs", "raw"}
    # the train state: params and two Adam moments, float32 (tiny: ~4.6 M params)
    assert 3 * 4 * 4e6 < result["state_bytes"] < 3 * 4 * 6e6
    for row in result["per_save"].values():
        assert row["wall_s"] > 0 and row["cpu_s"] == pytest.approx(row["user_s"] + row["sys_s"])
        assert 0 < row["blocked_s"] <= row["wall_s"]
    assert list(tmp_path.iterdir()) == [out]  # every save directory is removed


@pytest.mark.parametrize("argv, message", [
    (["--variants", "trainer,nope"], "unknown 'nope'"),
    (["--saves", "0"], "--saves=0"),
    (["--dir", "/no/such/dir"], "--dir='/no/such/dir'"),
])
def test_bench_checkpoint_bad_flags(repo_root, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        load_tool(repo_root, "bench_checkpoint").parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_recipe_section_reads_each_recipe_from_its_gin_file():
    """`--sections=recipe` times the recipes as configs/recipes/<name>.gin set them (the bench
    holds no recipe value of its own) and leaves no gin state behind."""
    from ode_lm import gin_setup
    from ode_lm.commands import bench
    from ode_lm.models import ModelConfig

    base = ModelConfig(vocab_size=64, d_model=32, num_heads=2, max_seq_len=16)
    configs = {name: bench.recipe_configs(name, base) for name in bench.RECIPES}
    robust_model, robust = configs["depth_robust"]
    assert (robust_model.time_scale, robust_model.random_grid_offset) == (4.0, True)
    terms = {name: {t.name: t for t in step.terms} for name, (_, step) in configs.items()}
    assert terms["depth_robust"]["random_steps"].choices == (4, 5, 6, 7, 8)
    assert terms["depth_robust"]["kinetic_energy"].weight == 2.0
    assert set(terms["depth_robust"]) == {"random_steps", "kinetic_energy"}
    assert terms["anytime"]["distillation"].num_steps == (2, 3)
    aware = terms["solver_aware"]["solver_share"]
    assert (aware.share, aware.solver, aware.num_steps) == (0.25, "rk4", 3)
    assert {"distillation", "solver_share"} <= set(terms["default"])
    assert all(model == robust_model for model, _ in configs.values())
    assert "recipe" not in bench.DEFAULT_SECTIONS
    with pytest.raises(ValueError):
        gin_setup.query("SolverShare.share")  # cleared after each read


def test_recipe_section_times_a_recipe_file_of_ones_own(tmp_path):
    """--recipes takes a path to a recipe file beside the named ones (its includes resolve
    against configs/, as in a run's own gin file)."""
    from ode_lm.commands import bench
    from ode_lm.models import ModelConfig

    mine = tmp_path / "mine.gin"
    mine.write_text("include 'recipes/depth_robust.gin'\nSolverDistillation.weight = 0.5\n"
                    "StepConfig.terms = [@RandomSteps(), @KineticEnergy(), "
                    "@SolverDistillation()]\n")
    args = bench.parse_args(["--sections=recipe", f"--recipes=depth_robust,{mine}"])
    assert args.recipes == ["depth_robust", str(mine)]
    base = ModelConfig(vocab_size=64, d_model=32, num_heads=2, max_seq_len=16)
    model, step = bench.recipe_configs(str(mine), base)
    assert model.time_scale == 4.0
    last = step.terms[-1]
    assert (last.name, last.weight) == ("solver_distillation", 0.5)
