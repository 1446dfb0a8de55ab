"""``ode-lm depth-gap``: the depth gap of runs over training, read from their metrics files,
each run labelled by its own solver and N (``model_config.json``), never by its NFE."""

from __future__ import annotations

import json

import pytest

from ode_lm.commands import depth_gap as tool
from ode_lm.models.config import ModelConfig
from ode_lm.training.run_dir import RunDir


def _write_run(path, rows, **model) -> str:
    path.mkdir(parents=True, exist_ok=True)
    RunDir(str(path)).write_model_config(ModelConfig(**model))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_depth_gap_command_tables_and_plots_a_runs_evals(tmp_path, capsys):
    """The gap of each setting to the run's own N, the last eval by default or the one
    named, and a PNG of gap versus step."""
    rows = [{"step": 50, "train/loss": 5.0, "train/tokens_per_second": 1000.0}]
    for step, own in ((100, 200.0), (200, 100.0)):
        rows.append({"step": step, "eval/perplexity": own, "eval/nfe": 6.0,
                     "eval/perplexity@steps=3": own * 1.1, "eval/perplexity@steps=2": 2500.0,
                     "eval/perplexity@rk4:steps=8": own * 1.03,
                     "eval/perplexity@adaptive:rtol=0.001": own * 1.05,
                     "eval/nfe@adaptive:rtol=0.001": 44.0})
    run = _write_run(tmp_path, rows, num_steps=6, solver="euler")
    text = tool.table([("r", run, None), ("r100", run, 100)])
    head, _, last, first = text.splitlines()
    assert head.startswith("| recipe | step | Euler N=1 | Euler N=2 |")
    assert last.startswith("| r | 200 | – | 2,500 | 110.0 (+10.0 %) | – | **100.0** |")
    assert last.endswith("| 103.0 (+3.0 %) | 105.0 (+5.0 %, 44) | 1.00k |")
    assert first.startswith("| r100 | 100 | – | 2,500 | 220.0 (+10.0 %) |")
    assert tool.main(["table", f"r={run}", f"--json={tmp_path / 't.json'}"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    command = f"ode-lm depth-gap table r={run} --json={tmp_path}/t.json"
    assert data["provenance"]["command"] == command
    assert tool.format_table(data["runs"]) == tool.table([("r", run, None)])  # one text
    assert data["runs"][0]["run_provenance"] is None  # a run without summary.json
    assert data["runs"][0]["cells"]["3"] == pytest.approx({"perplexity": 110.0, "gap": 0.1})
    tool.plot([("r", run, None)], str(tmp_path / "gap.png"))
    assert (tmp_path / "gap.png").read_bytes()[:4] == b"\x89PNG"
    assert tool.main(["table", f"r={tmp_path}@7"]) == 1  # no such eval: one line, exit 1
    err = capsys.readouterr().err.strip()
    assert err == f"ode-lm depth-gap: error: {tmp_path}: no eval at step 7", err
    assert tool.main(["table", f"r={tmp_path / 'nope'}"]) == 1
    assert "metrics.jsonl: no such file" in capsys.readouterr().err


def test_depth_gap_labels_a_non_euler_run_by_its_own_solver_and_n(tmp_path):
    """An RK4 run at N=2 logs eval/nfe = 8: its own N is 2 (bold), its '@steps=M' figures
    are RK4 at M, and RK4 N=8 is its own solver at 8; beside an Euler run the N columns
    name no solver and each recipe names its own."""
    rk4 = _write_run(tmp_path / "rk4", [
        {"step": 10, "eval/perplexity": 50.0, "eval/nfe": 8.0,
         "eval/perplexity@steps=8": 49.0, "eval/perplexity@steps=1": 60.0,
         "eval/perplexity@euler:steps=2": 70.0}], num_steps=2, solver="rk4")
    head, _, row = tool.table([("r", rk4, None)]).splitlines()
    assert head.startswith("| recipe | step | RK4 N=1 | RK4 N=2 | RK4 N=3 |")
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:5] == ["r", "10", "60.0 (+20.0 %)", "**50.0**", "–"]
    assert cells[7] == "49.0 (-2.0 %)"  # N=8: RK4 at 8, never read as the own N
    assert cells[-3] == "49.0 (-2.0 %)"  # the RK4 N=8 column: the same figure
    euler = _write_run(tmp_path / "euler", [{"step": 10, "eval/perplexity": 40.0,
                                             "eval/perplexity@steps=2": 45.0}],
                       num_steps=3, solver="euler")
    head, _, first, second = tool.table([("r", rk4, None), ("e", euler, None)]).splitlines()
    assert head.startswith("| recipe | step | N=1 | N=2 |")
    assert first.startswith("| r (RK4) | 10 |") and second.startswith("| e (Euler) | 10 |")
    assert "**40.0**" in second.split("|")[5]  # Euler N=3, its own


def test_depth_gap_refuses_a_run_without_eval_or_gap_metrics_and_writes_no_file(tmp_path,
                                                                                 capsys):
    """A run stopped before its first eval, or whose evals measured only its own N: one line
    naming the run, exit 1, and no chart."""
    early = _write_run(tmp_path / "early", [
        {"step": 5, "train/loss": 6.0, "train/tokens_per_second": 900.0}], num_steps=6)
    own_only = _write_run(tmp_path / "own", [
        {"step": 5, "train/loss": 6.0},
        {"step": 10, "eval/perplexity": 40.0, "eval/nfe": 6.0}], num_steps=6)
    for run, why in ((early, "no eval in its metrics yet"), (own_only, "no depth-gap metrics")):
        for argv in (["table", f"r={run}"], ["plot", f"--out={tmp_path / 'gap.png'}", f"r={run}"]):
            assert tool.main(argv) == 1, argv
            captured = capsys.readouterr()
            err = captured.err.strip()
            assert err.startswith(f"ode-lm depth-gap: error: {run}: {why}"), err
            assert len(err.splitlines()) == 1 and not captured.out
            assert not (tmp_path / "gap.png").exists()


def test_depth_gap_table_without_speed_shows_a_dash(tmp_path):
    """No train row with tokens/s before the eval: a dash, never 'nank'."""
    run = _write_run(tmp_path, [{"step": 10, "eval/perplexity": 40.0,
                                 "eval/perplexity@steps=2": 60.0}], num_steps=6)
    row = tool.table([("r", run, None)]).splitlines()[-1]
    assert row.endswith("| – |") and "nan" not in row


def _seed_run(tmp_path, name, own, rk4, step=600) -> str:
    return _write_run(tmp_path / name, [{"step": step, "eval/perplexity": own,
                                         "eval/perplexity@steps=2": own * 1.1,
                                         "eval/perplexity@rk4:steps=8": rk4}], num_steps=6)


def test_depth_gap_table_compares_seed_groups_by_paired_difference(tmp_path, capsys):
    """--baseline: each group's mean (its own N ± the standard error over seeds) and each
    other group's mean per-seed difference to the baseline ± its standard error, over the
    seeds both have; the JSON keeps the rows, and the docs render the same text from it."""
    a = {"0": (100.0, 103.0), "1": (102.0, 104.0), "2": (101.0, 106.0)}
    b = {"0": (99.0, 104.0), "1": (100.0, 105.0), "3": (98.0, 100.0)}
    runs = [(f"new, seed {s}", _seed_run(tmp_path, f"a{s}", *v), None) for s, v in a.items()]
    runs += [(f"old, seed {s}", _seed_run(tmp_path, f"b{s}", *v), None) for s, v in b.items()]
    lines = tool.table(runs, baseline="old").splitlines()
    assert len(lines) == 2 + 6 + 3
    mean_new, mean_old, paired = (line.split(" | ") for line in lines[-3:])
    assert mean_new[0] == "| *new, mean of 3*" and mean_new[6] == "**101.0 ± 0.58**"
    assert mean_old[6] == "**99.0 ± 0.58**"  # se of (99, 100, 98): 1/√3
    assert paired[0] == "| *new − old, paired over 2*"  # seeds 0 and 1 only
    assert paired[6] == "+1.50 ± 0.50 (+1.5 %)"  # differences 1 and 2
    assert paired[10] == "-1.00 ± 0.00 (-1.0 %)"  # RK4 N=8: -1 and -1
    assert paired[3] == "+1.65 ± 0.55 (+1.5 %)"  # N=2: 1.1 × the N=6 differences
    assert paired[2] == "–"  # N=1: measured by neither
    out = tmp_path / "t.json"
    args = [f"{name}={d}" for name, d, _ in runs]
    assert tool.main(["table", *args, "--baseline=old", f"--json={out}"]) == 0
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["summary"]] == ["mean", "mean", "paired"]
    assert data["summary"][2]["seeds"] == ["0", "1"]
    from tools.doc_tables import render_depth_gap

    assert render_depth_gap(data).splitlines()[-1] == " | ".join(paired[:-1]) + " |"
    assert capsys.readouterr().out.splitlines()[:-1] == lines


def test_depth_gap_baseline_refuses_unnamed_runs_an_unknown_group_and_twice_a_seed(
        tmp_path, capsys):
    """One line naming the run or the flag's value, exit 1 (2 for plot --baseline)."""
    run = _seed_run(tmp_path, "r", 100.0, 103.0)
    rk4 = _write_run(tmp_path / "rk4", [{"step": 600, "eval/perplexity": 99.0,
                                         "eval/perplexity@steps=4": 98.0}], num_steps=2,
                     solver="rk4")
    cases = [
        ([f"new s0={run}", f"old, seed 0={run}"], "'new s0': a run compared by seed is named "
         "'GROUP, seed S'"),
        ([f"new, seed 0={run}"], "--baseline='old': no run named 'old, seed S' (groups: new)"),
        ([f"old, seed 0={run}", f"old, seed 0={run}"], "'old, seed 0': seed 0 of 'old' is "
         "given twice"),
        ([f"new, seed 1={run}", f"old, seed 0={run}"], "'new' and the baseline 'old' share no "
         "seed"),
        ([f"new, seed 0={rk4}", f"old, seed 0={run}"], "runs of different solvers (euler, rk4) "
         "are not compared by seed"),
    ]
    for runs, why in cases:
        assert tool.main(["table", *runs, "--baseline=old"]) == 1, runs
        captured = capsys.readouterr()
        assert captured.err.startswith(f"ode-lm depth-gap: error: {why}"), captured.err
        assert len(captured.err.strip().splitlines()) == 1 and not captured.out
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["plot", f"--out={tmp_path / 'g.png'}", f"old, seed 0={run}",
                   "--baseline=old"])
    assert exit_info.value.code == 2
    assert "--baseline is a table option" in capsys.readouterr().err


def test_depth_gap_names_a_cut_line_and_the_file_it_wrote(tmp_path):
    """Through the installed ``ode-lm``: a metrics line cut short is one line naming the
    file and line; ``plot --out=gap`` says the name it wrote (``gap.png``); an --out that is
    a directory, or a --json in a directory that does not exist, is refused before any run
    is read."""
    import os
    import shutil
    import subprocess

    script = shutil.which("ode-lm")
    if script is None:
        pytest.skip("the ode-lm console script is not on PATH (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k != "ODE_LM_DEBUG"}
    rows = [{"step": s, "eval/perplexity": 100.0, "eval/perplexity@steps=4": 103.0,
             "eval/perplexity@rk4:steps=8": 101.0} for s in (10, 20)]
    run = _write_run(tmp_path / "run", rows, num_steps=6, solver="euler")

    def ode_lm(*argv):
        r = subprocess.run([script, "depth-gap", *argv], capture_output=True, text=True,
                           env=env, timeout=300)
        return r.returncode, r.stdout, r.stderr.strip()

    rc, out, err = ode_lm("plot", f"--out={tmp_path / 'gap'}", f"r={run}")
    assert rc == 0 and out.strip() == f"wrote {tmp_path / 'gap.png'}", (out, err)
    assert (tmp_path / "gap.png").read_bytes()[:4] == b"\x89PNG"
    rc, out, err = ode_lm("plot", f"--out={tmp_path}", f"r={run}")
    assert rc == 1 and err == (f"ode-lm depth-gap: error: --out={tmp_path}: is a directory, "
                               "not a file"), err
    rc, out, err = ode_lm("table", f"--json={tmp_path / 'nope' / 't.json'}", f"r={run}")
    assert rc == 1 and err == (f"ode-lm depth-gap: error: --json={tmp_path / 'nope' / 't.json'}: "
                               f"directory {tmp_path / 'nope'} does not exist"), err
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-20])  # a write cut short
    rc, out, err = ode_lm("table", f"r={run}")
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"ode-lm depth-gap: error: {metrics}:2: not a JSON row ("), err


def test_depth_gap_table_shows_a_discrete_baseline_at_its_own_depth(tmp_path):
    """docs/depth.md's fortunes table: sequential and parallel baselines (no N to vary, so
    no gap metrics) sit beside the ODE run, their own figure at their depth; an ODE run
    without gap metrics is still refused."""
    ode_rows = [{"step": 300, "eval/perplexity": 142.2, "eval/perplexity@steps=3": 144.7}]
    ode = _write_run(tmp_path / "ode", ode_rows, num_steps=6, solver="euler")
    base = _write_run(tmp_path / "seq", [{"step": 300, "eval/perplexity": 188.8}],
                      architecture="sequential", num_layers=4, num_steps=6)
    lines = tool.table([("ODE", ode, None), ("sequential, 4 layers", base, None)]).splitlines()
    cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
    head = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert cells[:2] == ["sequential, 4 layers", "300"]
    assert cells[head.index("Euler N=4")] == "**188.8**"
    assert {c for i, c in enumerate(cells) if i > 1 and head[i] != "Euler N=4"} <= {"–"}
    with pytest.raises(ValueError, match="no depth-gap metrics"):
        tool.table([("ODE", _write_run(tmp_path / "flat", [{"step": 1, "eval/perplexity": 9.0}],
                                       num_steps=6, solver="euler"), None)])
