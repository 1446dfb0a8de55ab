"""ode-lm sweep (grid -> runs) and ode-lm scaling-report (event files -> fits, CSV, PNG)."""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib

import pytest

from ode_lm.commands import scaling_report, sweep
from ode_lm.models.config import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture()
def sweep_file(tmp_path):
    base = tmp_path / "base.gin"
    base.write_text("# base run\n")
    path = tmp_path / "grid.gin"
    path.write_text(f"""
Sweep.name = 'grid'
Sweep.gin_files = ['{base}']
Sweep.widths = [64, 128]
Sweep.num_steps = [2, 4, 8]
Sweep.time_embed_dims = [8, 20]
Sweep.head_dim = 32
Sweep.bindings = {{'TrainConfig.num_train_steps': 50, 'DataConfig.seq_len': 64}}
""")
    return path, base


def test_grid_expands_to_one_run_per_point(sweep_file, tmp_path):
    path, base = sweep_file
    spec = sweep.parse_sweep(path)
    runs = sweep.expand(spec, str(tmp_path / "root"))
    assert len(runs) == 2 * 3 * 2
    assert [r.name for r in runs[:3]] == ["grid-w64-n2-d8", "grid-w64-n2-d20", "grid-w64-n4-d8"]
    r = runs[-1]
    assert (r.width, r.num_steps, r.time_embed_dim) == (128, 8, 20)
    assert r.model_dir == str(tmp_path / "root" / "grid-w128-n8-d20")
    b = dict(r.bindings)
    assert b == {"TrainConfig.num_train_steps": 50, "DataConfig.seq_len": 64,
                 "ModelConfig.d_model": 128, "ModelConfig.num_steps": 8,
                 "ModelConfig.time_embed_dim": 20, "ModelConfig.num_heads": 4,
                 "train.model_dir": r.model_dir}
    assert r.gin_flags()[0] == f"--gin_file={base}"
    assert f"--gin.train.model_dir={r.model_dir}" in r.gin_flags()
    assert sweep.gin_literal("full") == "full" and sweep.gin_literal("None") == "'None'"
    assert sweep.gin_literal("a b") == "'a b'" and sweep.gin_literal([1, 2]) == "(1, 2)"
    assert len({r.model_dir for r in runs}) == len(runs)


def test_overrides_and_renamed_params(sweep_file, tmp_path):
    path, _ = sweep_file
    spec = sweep.parse_sweep(path, ["--gin.Sweep.widths=[96]", "Sweep.time_embed_dims=[None]",
                                    "Sweep.width_param='Model.width'"])
    runs = sweep.expand(spec, "gs://bucket/s")
    assert [r.name for r in runs] == ["grid-w96-n2", "grid-w96-n4", "grid-w96-n8"]
    assert dict(runs[0].bindings)["Model.width"] == 96
    assert "ModelConfig.time_embed_dim" not in dict(runs[0].bindings)
    assert runs[0].model_dir == "gs://bucket/s/grid-w96-n2"


@pytest.mark.parametrize(
    "line, message",
    [
        ("Sweep.depth = 3", "unknown field Sweep.depth"),
        ("Sweep.widths = [64, 'x']", "Sweep.widths=[64, 'x'] must be a non-empty list of ints"),
        ("Sweep.num_steps = []", "Sweep.num_steps=[] must be a non-empty list"),
        ("Sweep.gin_files = ['nope.gin']", "Sweep.gin_files entry 'nope.gin' not found"),
        ("Sweep.head_dim = 48", "Sweep.widths [64, 128] are not multiples of head_dim=48"),
        ("Sweep.bindings = @foo", "@foo not allowed in a sweep file"),
        ("Other.x = 1", "only 'Sweep.<field> = <value>' lines are allowed"),
    ],
)
def test_bad_sweep_files_are_clear_errors(sweep_file, line, message):
    path, _ = sweep_file
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError) as e:
        sweep.parse_sweep(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_missing_required_field(tmp_path):
    path = tmp_path / "s.gin"
    path.write_text("Sweep.name = 'x'\n")
    with pytest.raises(ValueError, match="Sweep.gin_files is required"):
        sweep.parse_sweep(path)


def test_cli_lists_runs_and_prints_launch_commands(sweep_file, tmp_path, capsys):
    path, base = sweep_file
    assert sweep.main([str(path), "--root", "gs://b/sw", "--only", "grid-w64-n2-d8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("grid-w64-n2-d8\t--gin_file=")
    assert sweep.main([str(path), "--root", "gs://b/sw", "--launch_tpu", "pod", "--zone",
                       "us-east5-a", "--project", "p"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 12
    assert lines[0].startswith(
        f"launch/tpu_vm.sh --tpu pod --zone us-east5-a --project p --gin_file={base} ")
    assert lines[0].endswith(" --gin.train.model_dir=gs://b/sw/grid-w64-n2-d8")
    assert sweep.main([str(path), "--root", "r", "--only", "nope"]) == 1
    assert "--only names ['nope']" in capsys.readouterr().err


def test_cli_bad_file_is_one_line_error(tmp_path, capsys):
    assert sweep.main([str(tmp_path / "missing.gin"), "--root", "r"]) == 1
    assert "sweep file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- report


def _fake_flops(config: ModelConfig) -> float:
    return 1e3 * config.d_model**2 * config.num_steps


LAW = {2: (9.0, -0.08), 4: (8.0, -0.07), 8: (7.5, -0.065)}  # N -> (a, b)


def write_run(root: pathlib.Path, width: int, steps: int, tokens_per_step: int = 1024,
              train_steps: int = 40, with_eval: bool = True) -> pathlib.Path:
    """A finished run as the trainer leaves it: model_config.json plus event files."""
    from tensorboardX import SummaryWriter

    run = root / f"t-w{width}-n{steps}"
    run.mkdir(parents=True)
    config = ModelConfig(d_model=width, num_heads=2, num_steps=steps)
    (run / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))
    a, b = LAW[steps]
    flops = _fake_flops(config) * tokens_per_step * train_steps
    with SummaryWriter(str(run / "tb")) as w:
        for s in range(10, train_steps + 1, 10):
            w.add_scalar("train/tokens_seen", s * tokens_per_step, s)
            w.add_scalar("train/loss", 6.0 - s / 100, s)
        if with_eval:
            w.add_scalar("eval/loss", 99.0, train_steps // 2)  # an earlier eval, not final
            w.add_scalar("eval/loss", a * flops**b, train_steps)
    return run


def test_report_recovers_power_laws(tmp_path):
    for width in (32, 64, 128):
        for steps in (2, 4, 8):
            write_run(tmp_path / "sweep", width, steps)
    runs = scaling_report.find_runs([str(tmp_path / "sweep")])
    assert len(runs) == 9
    points = scaling_report.collect(runs, flops_fn=_fake_flops)
    p = next(q for q in points if q.width == 64 and q.num_steps == 4)
    assert p.tokens_seen == 40 * 1024 and p.final_step == 40
    assert p.train_flops == pytest.approx(_fake_flops(ModelConfig(d_model=64, num_heads=2,
                                                                  num_steps=4)) * 40 * 1024)
    fits = scaling_report.fit_series(points)
    assert [f.num_steps for f in fits] == [2, 4, 8]
    for f in fits:
        a, b = LAW[f.num_steps]
        assert f.b == pytest.approx(b, rel=1e-6) and f.a == pytest.approx(a, rel=1e-5)
        assert f.r2 == pytest.approx(1.0) and f.points == 3

    out = tmp_path / "report"
    scaling_report.write_csv(points, fits, str(out))
    scaling_report.plot(points, fits, str(out / "scaling.png"))
    rows = list(csv.DictReader(open(out / "scaling.csv")))
    assert len(rows) == 9 and rows[0]["num_steps"] == "2"
    loss_by_name = {q.name: q.final_eval_loss for q in points}
    assert all(float(r["final_eval_loss"]) == pytest.approx(loss_by_name[r["name"]])
               for r in rows)
    fit_rows = list(csv.DictReader(open(out / "fits.csv")))
    assert [float(r["b"]) for r in fit_rows] == pytest.approx([-0.08, -0.07, -0.065])
    png = (out / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_power_law_needs_two_flop_values():
    with pytest.raises(ValueError, match="N=3: a power law needs >= 2 distinct FLOP values"):
        scaling_report.fit_power_law([1e9, 1e9], [3.0, 2.9], 3)


def test_report_names_a_run_without_eval(tmp_path, capsys):
    write_run(tmp_path / "s", 32, 2, with_eval=False)
    with pytest.raises(ValueError, match=r"no 'eval/loss' scalars .* \(has \['train/loss'"):
        scaling_report.collect(scaling_report.find_runs([str(tmp_path / "s")]),
                               flops_fn=_fake_flops)
    assert scaling_report.main([str(tmp_path / "empty_missing"), "--out", str(tmp_path)]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_report_uses_the_models_training_flops(tmp_path):
    """FLOPs per token come from ode_lm.models.accounting (at the run's N) and grow with the
    ODE steps."""
    from ode_lm.models.accounting import flops_per_token

    for steps in (2, 4, 8):
        write_run(tmp_path / "s", 64, steps)
    points = scaling_report.collect(scaling_report.find_runs([str(tmp_path / "s")]))
    values = [p.flops_per_token for p in sorted(points, key=lambda p: p.num_steps)]
    assert values[0] == flops_per_token(ModelConfig(d_model=64, num_heads=2, num_steps=2),
                                        2).training
    assert 0 < values[0] < values[1] < values[2]
