"""Bad input to every ode-lm command: exit 2 (the command line does not parse, or a config
class refuses a setting) or 1 (the run failed), one line `ode-lm <command>: error: ...` on
stderr naming the flag, file or value, no traceback, and an existing MODEL_DIR and DATA_DIR
byte-for-byte unchanged.

Each case is a real subprocess of the installed ``ode-lm`` console script (what a user runs,
C++ and absl output included) against one small trained run and its prepared data dir, both
hashed before and after every case.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import cli_env, micro_cli_gin, tree_hash

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _env(workdir: Path) -> dict[str, str]:
    return cli_env(workdir / "xla_cache")


def _run(workdir: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=_env(workdir),
                          capture_output=True, text=True, timeout=300)


def _script() -> str:
    script = shutil.which("ode-lm")
    if script is None:
        pytest.skip("the ode-lm console script is not on PATH (pip install -e .): the cases "
                    "check what a user who runs it sees")
    return script


def _ode_lm(workdir: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """The installed ``ode-lm`` script, importing this checkout's package through
    PYTHONPATH."""
    env = _env(workdir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([_script(), *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    """A 2-step trained run (MODEL), its prepared data (DATA) and a file of text (TEXT)."""
    work = tmp_path_factory.mktemp("bad_inputs")
    model, data = work / "run", work / "data"
    gin_file = work / "micro.gin"
    gin_file.write_text(micro_cli_gin(data, model, train_steps=2, ici="(-1, 1, 1)"))
    proc = _run(work, ["-m", "ode_lm.commands.train", f"--gin_file={gin_file}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (work / "prompt.txt").write_text("The ODE")
    return {"WORK": work, "MODEL": model, "DATA": data, "GIN": gin_file}


TRAIN = ["train", "--gin_file={GIN}"]
EVAL = ["eval", "--model_dir={MODEL}"]
SAMPLE = ["sample", "--model_dir={MODEL}", "--prompt=The", "--no_timing", "--max_new_tokens=4"]
FINETUNE = ["finetune", "--gin_file=configs/finetune/demo.gin",
            "--gin.PRETRAINED_DIR={MODEL}", "--gin.MODEL_DIR={WORK}/ft_new"]
PREPARE = ["prepare", "--no_progress"]
EXPORT = ["export", "--model_dir={MODEL}", "--out={WORK}/export_new"]
ANALYZE = ["analyze", "--model_dir={MODEL}", "--out={WORK}/analysis_new", "--text=The ODE",
           "--data_dir={DATA}"]
AOT = ["aot", "--gin_file=configs/runs/demo.gin"]
# exit status: the command line does not parse or a config class refuses a setting / the run
# failed (every config field's refusal: tests/cli/test_settings.py)
USAGE, FAILED = 2, 1

# case id -> (ode-lm argv, text the one error line must contain, exit status)
CASES: dict[str, tuple[list[str], str, int]] = {
    # the dispatcher
    "ode-lm: unknown command": (["bogus"], "unknown command 'bogus' (see ode-lm --help)", USAGE),
    # train
    "train: no gin file": (["train"], "--gin_file", USAGE),
    "train: missing gin file": (["train", "--gin_file={WORK}/missing.gin"], "missing.gin",
                                FAILED),
    "train: misspelled macro": ([*TRAIN, "--gin.ODE_STEP=8"], "ODE_STEP", FAILED),
    "train: float step count": ([*TRAIN, "--gin.TRAIN_STEPS=1.5"], "num_train_steps=1.5",
                                USAGE),
    "train: zero step count": ([*TRAIN, "--gin.TRAIN_STEPS=0"], "num_train_steps=0", USAGE),
    "train: unknown solver": ([*TRAIN, "--gin.ModelConfig.solver='rk5'"], "rk5", USAGE),
    "train: a removed eval setting": ([*TRAIN, "--gin.TrainConfig.eval_num_steps=(4,)"],
                                      "TrainConfig.eval_num_steps=(4,): no longer a setting; "
                                      "every eval solve is in TrainConfig.eval_solves", USAGE),
    "train: unknown flag": ([*TRAIN, "--bogus_flag"], "--bogus_flag", USAGE),
    "train: abbreviated flag": ([*TRAIN, "--gin_bind=x = 1"], "--gin_bind", USAGE),
    "train: bad step choices": ([*TRAIN, "--gin.StepConfig.terms=[@RandomSteps()]",
                                 "--gin.RandomSteps.choices=(0, 2)"],
                                "RandomSteps.choices", USAGE),
    "train: changed width on a run": ([*TRAIN, "--gin.D_MODEL=64"], "block/", FAILED),
    "train: batch not divisible": ([*TRAIN, "--gin.BATCH_SIZE=6"], "global_batch_size=6",
                                   USAGE),
    "train: sequence too long": ([*TRAIN, "--gin.DataConfig.seq_len=4096"], "seq_len", USAGE),
    "train: data dir prepared with another holdout": (
        [*TRAIN, "--gin.DataConfig.holdout_fraction=0.5"], "holdout_fraction", FAILED),
    "train: mixture components disagree": (
        [*TRAIN, "--gin.DataConfig.mixture={{'a': 'builtin', 'b': {{'source': 'builtin', "
         "'seq_len': 64}}}}"], "components 'a' and 'b' disagree on seq_len", USAGE),
    "train: vocabulary smaller than the tokenizer": ([*TRAIN, "--gin.VOCAB_SIZE=128"], "128",
                                                     FAILED),
    "train: a bpe larger than the vocabulary, refused before it is trained": (
        [*TRAIN, "--gin.MODEL_DIR='{WORK}/ft_new'", "--gin.DATA_DIR='{WORK}/data_new'",
         "--gin.TOKENIZER='bpe:512'"],
        "ModelConfig.vocab_size=384 is smaller than the tokenizer's 512 (bpe:512 in", FAILED),
    "train: binding syntax": ([*TRAIN, "--gin_bindings=ModelConfig.d_model = = 3"],
                              "ModelConfig.d_model", USAGE),
    "train: unclosed bracket": ([*TRAIN, "--gin.MeshConfig.ici_parallelism=(1, -1"],
                                "--gin.MeshConfig.ici_parallelism", USAGE),
    # eval
    "eval: no such run": (["eval", "--model_dir={WORK}/nope"], "nope", FAILED),
    "eval: missing --model_dir": (["eval"], "--model_dir", USAGE),
    "eval: zero steps": ([*EVAL, "--num_steps=0"], "--num_steps=0", USAGE),
    "eval: steps not a number": ([*EVAL, "--num_steps=four"],
                                 "argument --num_steps: invalid int value: 'four'", USAGE),
    "eval: a step list entry not a number": (
        [*EVAL, "--num_steps=2,x,8"], "argument --num_steps: invalid int value: 'x'", USAGE),
    "eval: abbreviated flag": ([*EVAL, "--num_step=8"], "--num_step=8", USAGE),
    "eval: rtol not a number": ([*EVAL, "--rtol=tiny"], "argument --rtol: invalid float value",
                                USAGE),
    "eval: unknown solver": ([*EVAL, "--solver=rk5"], "--solver='rk5'", USAGE),
    "eval: negative rtol": ([*EVAL, "--solver=adaptive", "--rtol=-1"], "rtol", USAGE),
    "eval: no such step": ([*EVAL, "--step=999"], "999", FAILED),
    "eval: unknown split": ([*EVAL, "--split=bogus"], "bogus", FAILED),
    "eval: empty lm-eval task": ([*EVAL, "--lm_eval_tasks=a,,b"], "--lm_eval_tasks='a,,b'",
                                 USAGE),
    "eval: no such lm-eval include path": (
        [*EVAL, "--lm_eval_tasks=x", "--lm_eval_include_path={WORK}/nope"],
        "--lm_eval_include_path=", FAILED),
    "eval: unknown solver in --solves": ([*EVAL, "--solves=euler:2 rk5:4"],
                                         "'rk5:4': solver 'rk5' is not one",
                                         USAGE),
    "eval: a --solves step count not a number": (
        [*EVAL, "--solves=euler:2,x"], "'x' is not a whole number of steps", USAGE),
    "eval: a zero --solves tolerance": ([*EVAL, "--solves=adaptive:0"], "rtol must be > 0",
                                        USAGE),
    "eval: an empty --solves": ([*EVAL, "--solves= "], "--solves=' ': expected e.g.", USAGE),
    "eval: --solves with --num_steps": ([*EVAL, "--solves=euler:2", "--num_steps=4"],
                                        "--solves and --num_steps: give one of them", USAGE),
    "eval: --rtol with a fixed-grid solver": ([*EVAL, "--solver=rk4", "--rtol=1e-3"],
                                              "--rtol=0.001: --solver=rk4 (rk4) is fixed-grid "
                                              "and takes no tolerance", USAGE),
    "eval: --atol with the run's own fixed-grid solver": (
        [*EVAL, "--atol=1e-6"], "--atol=1e-06: the run's own solver (euler) is fixed-grid",
        USAGE),
    "sample: --rtol with a fixed-grid solver": ([*SAMPLE, "--solver=euler", "--rtol=1e-3"],
                                                "--rtol=0.001: --solver=euler", USAGE),
    "eval: negative atol": ([*EVAL, "--solver=adaptive", "--atol=-1"], "--atol=-1.0", USAGE),
    "eval: --log of another split": ([*EVAL, "--split=train", "--log"],
                                     "--log with --split=train: a metrics row holds the "
                                     "validation split's figures", USAGE),
    # sample
    "sample: zero steps": ([*SAMPLE, "--num_steps=0"], "--num_steps=0", USAGE),
    "sample: negative temperature": ([*SAMPLE, "--temperature=-1"], "temperature", USAGE),
    "sample: no new tokens": ([*SAMPLE, "--max_new_tokens=0"], "max_new_tokens", USAGE),
    "sample: unknown solver": ([*SAMPLE, "--solver=bogus"], "--solver='bogus'", USAGE),
    "sample: top_p above 1": ([*SAMPLE, "--top_p=2"], "top_p", USAGE),
    "sample: abbreviated flag": ([*SAMPLE, "--temp=0"], "--temp=0", USAGE),
    "sample: zero rtol": ([*SAMPLE, "--solver=adaptive", "--rtol=0"], "--rtol=0.0: must be > 0",
                          USAGE),
    "sample: data dir is a file": ([*SAMPLE, "--data_dir={WORK}/prompt.txt"],
                                   "--data_dir={WORK}/prompt.txt: is a file", FAILED),
    "sample: a prompt longer than the learned positions": (
        [*SAMPLE, "--prompt=" + "ODE " * 300], "--prompt: 1200 tokens, but the model learned",
        USAGE),
    "sample: more tokens than the learned positions": (
        [*SAMPLE, "--max_new_tokens=500"], "--max_new_tokens=500: the prompt", USAGE),
    # finetune
    "finetune: no pretrained run": ([*FINETUNE, "--gin.PRETRAINED_DIR={WORK}/nope"], "nope",
                                    FAILED),
    "finetune: zero steps": ([*FINETUNE, "--gin.FINETUNE_STEPS=0"], "FINETUNE_STEPS=0", USAGE),
    "finetune: unknown method": ([*FINETUNE, "--gin.METHOD='qlora'"], "qlora", USAGE),
    "finetune: no gin file": (["finetune", "--gin.METHOD=lora"], "--gin_file", USAGE),
    "finetune: another tokenizer than the pretrained run's prepares no data dir": (
        [*FINETUNE, "--gin.DataConfig.source='{WORK}/prompt.txt'",
         "--gin.DataConfig.data_dir='{WORK}/data_new/ft'", "--gin.DataConfig.tokenizer='bpe:300'"],
        "tokenizer mismatch: the pretrained run", FAILED),
    # prepare
    "prepare: no such source": ([*PREPARE, "--source={WORK}/nope.jsonl",
                                 "--data_dir={WORK}/data_new"], "nope.jsonl", FAILED),
    "prepare: hf:// source that is not a dataset repo": (
        [*PREPARE, "--source=hf://openwebtext", "--data_dir={WORK}/data_new"], "hf://openwebtext",
        FAILED),
    "prepare: unknown tokenizer": ([*PREPARE, "--tokenizer=nope:1",
                                    "--data_dir={WORK}/data_new"], "nope:1", FAILED),
    "prepare: holdout above 1": ([*PREPARE, "--holdout_fraction=1.5",
                                  "--data_dir={WORK}/data_new"], "holdout_fraction", USAGE),
    "prepare: holdout not a number": ([*PREPARE, "--holdout_fraction=half",
                                       "--data_dir={WORK}/data_new"],
                                      "argument --holdout_fraction: invalid float value", USAGE),
    "prepare: other tokenizer into a prepared dir": (
        [*PREPARE, "--data_dir={DATA}", "--tokenizer=bpe:512"], "tokenizer", FAILED),
    # prepare (more)
    "prepare: a field the records lack": (
        [*PREPARE, "--source={MODEL}/metrics.jsonl", "--text_field=content", "--tokenizer=bytes",
         "--data_dir={WORK}/data_new"], "missing field 'content'", FAILED),
    "prepare: other holdout into a prepared dir": (
        [*PREPARE, "--data_dir={DATA}", "--tokenizer=bytes", "--holdout_fraction=0.3"],
        "holdout_fraction=0.05, not 0.3", FAILED),
    "prepare: other text field into a prepared dir": (
        [*PREPARE, "--data_dir={DATA}", "--tokenizer=bytes", "--holdout_fraction=0.05",
         "--text_field=content"], "text_field='text', not 'content'", FAILED),
    "prepare: negative holdout": ([*PREPARE, "--holdout_fraction=-0.1",
                                   "--data_dir={WORK}/data_new"], "holdout_fraction=-0.1", USAGE),
    "prepare: negative holdout seed": ([*PREPARE, "--holdout_seed=-1",
                                        "--data_dir={WORK}/data_new"], "holdout_seed=-1", USAGE),
    "prepare: zero documents per shard": ([*PREPARE, "--docs_per_shard=0",
                                           "--data_dir={WORK}/data_new"], "docs_per_shard=0",
                                          USAGE),
    "prepare: zero processes": ([*PREPARE, "--num_proc=0", "--data_dir={WORK}/data_new"],
                                "--num_proc=0", USAGE),
    "prepare: unknown non-utf8 policy": ([*PREPARE, "--non_utf8=drop",
                                          "--data_dir={WORK}/data_new"], "drop", USAGE),
    "prepare: bpe vocabulary too small": ([*PREPARE, "--tokenizer=bpe:0",
                                           "--data_dir={WORK}/data_new"],
                                          "--tokenizer=bpe:0: tokenizer spec 'bpe:0'", USAGE),
    "prepare: unsupported source file": ([*PREPARE, "--source={GIN}",
                                          "--data_dir={WORK}/data_new"], "unsupported file type",
                                         FAILED),
    "prepare: data dir is a file": ([*PREPARE, "--data_dir={GIN}"], "--data_dir=", FAILED),
    "prepare: abbreviated flag": ([*PREPARE, "--holdout=0.1", "--data_dir={WORK}/data_new"],
                                  "--holdout=0.1", USAGE),
    # export
    "export: unknown format": ([*EXPORT, "--format=onnx"], "--format='onnx'", USAGE),
    "export: unknown format of a missing run is still a usage error": (
        ["export", "--model_dir={WORK}/nope", "--format=onnx", "--out={WORK}/export_new"],
        "--format='onnx'", USAGE),
    "export: raw with --num_steps": ([*EXPORT, "--format=raw", "--num_steps=4"],
                                     "--num_steps=4 with --format=raw", USAGE),
    "export: zero shard size": ([*EXPORT, "--format=raw", "--max_shard_mb=0"],
                                "--max_shard_mb=0: must be > 0", USAGE),
    "export: missing --format": (EXPORT, "--format", USAGE),
    "export: out is not empty": (["export", "--model_dir={MODEL}", "--format=raw",
                                  "--out={DATA}"], "not empty", FAILED),
    "export: zero steps": ([*EXPORT, "--format=hf", "--num_steps=0"], "--num_steps=0", USAGE),
    "export: unknown dtype": ([*EXPORT, "--format=raw", "--dtype=fp16"], "fp16", USAGE),
    "export: data dir is not a run": (["export", "--model_dir={DATA}", "--format=raw",
                                       "--out={WORK}/export_new"], "data", FAILED),
    "export: out is a file": ([*EXPORT, "--format=raw", "--out={WORK}/prompt.txt"],
                              "--out={WORK}/prompt.txt: is a file, not a directory", FAILED),
    "export: --overwrite onto a file": (
        [*EXPORT, "--format=raw", "--out={WORK}/prompt.txt", "--overwrite"],
        "--out={WORK}/prompt.txt: is a file", FAILED),
    "export: --overwrite keeps the old dir when the run is missing": (
        ["export", "--model_dir={WORK}/nope", "--format=raw", "--out={DATA}", "--overwrite"],
        "nope", FAILED),
    "export: not empty says --overwrite": (
        ["export", "--model_dir={MODEL}", "--format=raw", "--out={DATA}"],
        "(--overwrite replaces it)", FAILED),
    # analyze
    "analyze: no such run": (["analyze", "trajectory", "--model_dir={WORK}/nope",
                              "--out={WORK}/analysis_new", "--text=x"], "nope", FAILED),
    "analyze: t outside [0, 1]": ([*ANALYZE, "spectral", "--times=2.0"], "2.0", USAGE),
    "analyze: a time not a number": ([*ANALYZE, "spectral", "--times=0,half"],
                                     "argument --times: invalid float value: 'half'", USAGE),
    "analyze: zero steps": ([*ANALYZE, "lyapunov", "--num_steps=0"], "--num_steps=0", USAGE),
    "analyze: unknown analysis": ([*ANALYZE, "bogus"], "bogus", USAGE),
    "analyze: out is a file": ([*ANALYZE, "trajectory", "--out={WORK}/prompt.txt"],
                               "--out={WORK}/prompt.txt: is a file, not a directory", FAILED),
    "analyze: data dir is a file": ([*ANALYZE, "trajectory", "--data_dir={WORK}/prompt.txt"],
                                    "--data_dir={WORK}/prompt.txt: is a file", FAILED),
    "analyze: zero time points": ([*ANALYZE, "spectral", "--num_times=0"], "--num_times=0",
                                  USAGE),
    "analyze: unknown solver": ([*ANALYZE, "trajectory", "--solver=rk5"],
                                "argument --solver: invalid choice: 'rk5'", USAGE),
    # depth-report
    "depth-report: no such run": (["depth-report", "--model_dir={WORK}/nope",
                                   "--out={WORK}/analysis_new"], "nope", FAILED),
    "depth-report: a step list entry not a number": (
        ["depth-report", "--model_dir={MODEL}", "--out={WORK}/analysis_new", "--num_steps=2,x"],
        "argument --num_steps: invalid int value: 'x'", USAGE),
    "depth-report: out is a file": (
        ["depth-report", "--model_dir={MODEL}", "--out={WORK}/prompt.txt"],
        "--out={WORK}/prompt.txt: is a file, not a directory", FAILED),
    "depth-report: --json is a directory": (
        ["depth-report", "--model_dir={MODEL}", "--out={WORK}/analysis_new", "--json={DATA}"],
        "--json={DATA}: is a directory, not a file", FAILED),
    "depth-report: zero steps": (["depth-report", "--model_dir={MODEL}",
                                  "--out={WORK}/analysis_new", "--num_steps=0,2"],
                                 "--num_steps=0,2: every entry must be >= 1", USAGE),
    # depth-gap, finetune-table
    "depth-gap: no such run": (["depth-gap", "table", "r={WORK}/nope"], "nope", FAILED),
    "depth-gap: a data dir is not a run": (["depth-gap", "table", "r={DATA}"],
                                           "metrics.jsonl: no such file", FAILED),
    "depth-gap: a run without gap metrics": (["depth-gap", "table", "r={MODEL}"],
                                             "no depth-gap metrics", FAILED),
    "depth-gap: no chart of a run without gap metrics": (
        ["depth-gap", "plot", "--out={WORK}/analysis_new/gap.png", "r={MODEL}"],
        "no depth-gap metrics", FAILED),
    "depth-gap: no eval at the step": (["depth-gap", "table", "r={MODEL}@999"], "{MODEL}",
                                       FAILED),
    "depth-gap: step not a number": (["depth-gap", "table", "r={MODEL}@last"],
                                     "the step after @ must be an integer", USAGE),
    "depth-gap: run without a name": (["depth-gap", "table", "{MODEL}"], "NAME=DIR", USAGE),
    "depth-gap: plot without --out": (["depth-gap", "plot", "r={MODEL}"], "plot needs --out",
                                      USAGE),
    "depth-gap: unknown what": (["depth-gap", "chart", "r={MODEL}"], "chart", USAGE),
    "finetune-table: a zero depth": (["finetune-table", "--depths=3,0",
                                      "--work_dir={WORK}/ft_new"], "--depths=3,0", USAGE),
    "finetune-table: a depth not a number": (["finetune-table", "--depths=3,x",
                                              "--work_dir={WORK}/ft_new"],
                                             "argument --depths: invalid int value: 'x'", USAGE),
    "finetune-table: unknown method": (["finetune-table", "--methods=full,qlora",
                                        "--work_dir={WORK}/ft_new"], "--methods=full,qlora",
                                       USAGE),
    "finetune-table: zero pretraining steps": (["finetune-table", "--pretrain_steps=0",
                                                "--work_dir={WORK}/ft_new"],
                                               "--pretrain_steps=0", USAGE),
    "finetune-table: negative fine-tuning steps": (["finetune-table", "--finetune_steps=-1",
                                                    "--work_dir={WORK}/ft_new"],
                                                   "--finetune_steps=-1", USAGE),
    "finetune-table: work dir is a file": (["finetune-table", "--work_dir={GIN}"],
                                           "--work_dir=", FAILED),
    "finetune-table: abbreviated flag": (["finetune-table", "--depth=3",
                                          "--work_dir={WORK}/ft_new"], "--depth=3", USAGE),
    # aot
    "aot: unknown topology": ([*AOT, "--topology=v9x-8"], "v9x", USAGE),
    "aot: missing gin file": (["aot", "--gin_file={WORK}/nope.gin", "--topology=v5e:2x2"],
                              "nope.gin", FAILED),
    "aot: unknown remat": ([*AOT, "--topology=v5e:2x2", "--remat=bogus"], "bogus", USAGE),
    "aot: abbreviated flag": ([*AOT, "--topology=v5e:2x2", "--step=1"], "--step=1", USAGE),
    "aot: zero step time": ([*AOT, "--topology=v5e:2x2", "--step_time=0"], "--step_time=0",
                            USAGE),
    "aot: raw topology of the wrong rank": ([*AOT, "--topology=v5p:2x2"],
                                            "v5p needs 3 dimensions", USAGE),
    "aot: zero slices": ([*AOT, "--topology=v5e:2x2", "--num_slices=0"], "--num_slices=0",
                         USAGE),
    "aot: no standard slice of that size": ([*AOT, "--topology=v5p-6"], "no standard v5p",
                                            USAGE),
    # bench, sweep, scaling-report
    "bench: abbreviated flag": (["bench", "--conf=tiny"], "--conf=tiny", USAGE),
    "bench: --json is a directory": (["bench", "--json={DATA}"],
                                     "--json='{DATA}': is a directory, not a file", USAGE),
    "bench: steps not a number": (["bench", "--steps=few"], "argument --steps: invalid int",
                                  USAGE),
    "sweep: no such sweep file": (["sweep", "{WORK}/nope.gin", "--root={WORK}/export_new"],
                                  "nope.gin", FAILED),
    "scaling-report: no runs": (["scaling-report", "{WORK}/nope", "--out={WORK}/analysis_new"],
                                "nope", FAILED),
}
NEW_DIRS = ("ft_new", "data_new", "export_new", "analysis_new")


def _check(case: str, run_dirs: dict[str, Path]) -> None:
    argv, expected, status = CASES[case]
    argv = [a.format(**run_dirs) for a in argv]
    expected = expected.format(**run_dirs)
    prefix = f"ode-lm {argv[0]}: error: " if not argv[0].startswith("bogus") else "ode-lm: error: "
    before = {k: tree_hash(run_dirs[k]) for k in ("MODEL", "DATA")}
    proc = _ode_lm(run_dirs["WORK"], argv)
    left = [name for name in NEW_DIRS if (run_dirs["WORK"] / name).exists()]
    left += [p.name for p in run_dirs["WORK"].iterdir() if ".writing-" in p.name]  # staging
    for name in left:  # so that one failing case does not fail the next ones
        shutil.rmtree(run_dirs["WORK"] / name)
    err = proc.stderr.strip()
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith(prefix) and expected in err, err
    for k in ("MODEL", "DATA"):
        assert tree_hash(run_dirs[k]) == before[k], f"{k} changed by {case}"
    assert not left, f"{case} left {left} behind"  # a refused command makes nothing


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_one_line_no_traceback_dirs_unchanged(case, run_dirs):
    _check(case, run_dirs)
