"""Bad input to every CLI: exit non-zero, one line on stderr naming the flag, file or value,
no traceback, and an existing MODEL_DIR and DATA_DIR byte-for-byte unchanged.

Each case is a real subprocess (what a user sees, C++ and absl output included) against one
small trained run and its prepared data dir, both hashed before and after every case.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import micro_cli_gin

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_COMPILATION_CACHE_DIR=str(workdir / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("ODE_LM_DEBUG", None)
    return env


def _run(workdir: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=_env(workdir),
                          capture_output=True, text=True, timeout=300)


def tree_hash(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file, and '<dir>' for every directory."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    """A 2-step trained run (MODEL), its prepared data (DATA) and a file of text (TEXT)."""
    work = tmp_path_factory.mktemp("bad_inputs")
    model, data = work / "run", work / "data"
    gin_file = work / "micro.gin"
    gin_file.write_text(micro_cli_gin(data, model, train_steps=2, ici="(-1, 1, 1)"))
    proc = _run(work, ["-m", "ode_lm.train", f"--gin_file={gin_file}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (work / "prompt.txt").write_text("The ODE")
    return {"WORK": work, "MODEL": model, "DATA": data, "GIN": gin_file}


TRAIN = ["-m", "ode_lm.train", "--gin_file={GIN}"]
EVAL = ["-m", "ode_lm.eval", "--model_dir={MODEL}"]
SAMPLE = ["-m", "ode_lm.sample", "--model_dir={MODEL}", "--prompt=The", "--no_timing",
          "--max_new_tokens=4"]
FINETUNE = ["-m", "ode_lm.finetune", "--gin_file=configs/finetune/demo.gin",
            "--gin.PRETRAINED_DIR={MODEL}", "--gin.MODEL_DIR={WORK}/ft_new"]
PREPARE = ["tools/prepare_data.py", "--no_progress"]
CONVERT = ["tools/convert_ckpt.py", "--model_dir={MODEL}", "--out={WORK}/export_new"]
ANALYZE = ["tools/analyze.py", "--model_dir={MODEL}", "--out={WORK}/analysis_new",
           "--text=The ODE", "--data_dir={DATA}"]
AOT = ["tools/aot_compile.py", "--gin_file=configs/runs/demo.gin"]

# case id -> (argv, text the one error line must contain)
CASES: dict[str, tuple[list[str], str]] = {
    # train
    "train: missing gin file": (["-m", "ode_lm.train", "--gin_file={WORK}/missing.gin"],
                                "missing.gin"),
    "train: misspelled macro": ([*TRAIN, "--gin.ODE_STEP=8"], "ODE_STEP"),
    "train: float step count": ([*TRAIN, "--gin.TRAIN_STEPS=1.5"], "num_train_steps=1.5"),
    "train: zero step count": ([*TRAIN, "--gin.TRAIN_STEPS=0"], "num_train_steps=0"),
    "train: unknown solver": ([*TRAIN, "--gin.ModelConfig.solver='rk5'"], "rk5"),
    "train: unknown flag": ([*TRAIN, "--bogus_flag"], "--bogus_flag"),
    "train: bad step choices": ([*TRAIN, "--gin.StepConfig.num_steps_choices=(0, 2)"],
                                "num_steps_choices"),
    "train: changed width on a run": ([*TRAIN, "--gin.D_MODEL=64"], "block/"),
    "train: batch not divisible": ([*TRAIN, "--gin.BATCH_SIZE=6"], "global_batch_size=6"),
    "train: sequence too long": ([*TRAIN, "--gin.DataConfig.seq_len=4096"], "seq_len"),
    "train: data dir prepared with another holdout": (
        [*TRAIN, "--gin.DataConfig.holdout_fraction=0.5"], "holdout_fraction"),
    "train: vocabulary smaller than the tokenizer": ([*TRAIN, "--gin.VOCAB_SIZE=128"], "128"),
    "train: binding syntax": ([*TRAIN, "--gin_bindings=ModelConfig.d_model = = 3"],
                              "ModelConfig.d_model"),
    "train: unclosed bracket": ([*TRAIN, "--gin.MeshConfig.ici_parallelism=(1, -1"],
                                "--gin.MeshConfig.ici_parallelism"),
    # eval
    "eval: no such run": (["-m", "ode_lm.eval", "--model_dir={WORK}/nope"], "nope"),
    "eval: zero steps": ([*EVAL, "--num_steps=0"], "--num_steps=0"),
    "eval: steps not a number": ([*EVAL, "--num_steps=abc"], "abc"),
    "eval: unknown solver": ([*EVAL, "--solver=rk5"], "rk5"),
    "eval: negative rtol": ([*EVAL, "--solver=adaptive", "--rtol=-1"], "rtol"),
    "eval: no such step": ([*EVAL, "--step=999"], "999"),
    "eval: unknown split": ([*EVAL, "--split=bogus"], "bogus"),
    "eval: empty lm-eval task": ([*EVAL, "--lm_eval_tasks=a,,b"], "--lm_eval_tasks='a,,b'"),
    "eval: no such lm-eval include path": (
        [*EVAL, "--lm_eval_tasks=x", "--lm_eval_include_path={WORK}/nope"],
        "--lm_eval_include_path="),
    # sample
    "sample: zero steps": ([*SAMPLE, "--num_steps=0"], "--num_steps=0"),
    "sample: negative temperature": ([*SAMPLE, "--temperature=-1"], "temperature"),
    "sample: no new tokens": ([*SAMPLE, "--max_new_tokens=0"], "max_new_tokens"),
    "sample: unknown solver": ([*SAMPLE, "--solver=bogus"], "bogus"),
    "sample: top_p above 1": ([*SAMPLE, "--top_p=2"], "top_p"),
    # finetune
    "finetune: no pretrained run": ([*FINETUNE, "--gin.PRETRAINED_DIR={WORK}/nope"], "nope"),
    "finetune: zero steps": ([*FINETUNE, "--gin.FINETUNE_STEPS=0"], "FINETUNE_STEPS=0"),
    "finetune: unknown method": ([*FINETUNE, "--gin.METHOD='qlora'"], "qlora"),
    # prepare_data
    "prepare: no such source": ([*PREPARE, "--source={WORK}/nope.jsonl",
                                 "--data_dir={WORK}/data_new"], "nope.jsonl"),
    "prepare: hf:// source that is not a dataset repo": (
        [*PREPARE, "--source=hf://openwebtext", "--data_dir={WORK}/data_new"], "hf://openwebtext"),
    "prepare: unknown tokenizer": ([*PREPARE, "--tokenizer=nope:1",
                                    "--data_dir={WORK}/data_new"], "nope:1"),
    "prepare: holdout above 1": ([*PREPARE, "--holdout_fraction=1.5",
                                  "--data_dir={WORK}/data_new"], "holdout_fraction"),
    "prepare: other tokenizer into a prepared dir": (
        [*PREPARE, "--data_dir={DATA}", "--tokenizer=bpe:512"], "tokenizer"),
    # convert_ckpt
    "convert: unknown format": ([*CONVERT, "--format=onnx"], "onnx"),
    "convert: out is not empty": (["tools/convert_ckpt.py", "--model_dir={MODEL}",
                                   "--format=raw", "--out={DATA}"], "not empty"),
    "convert: zero steps": ([*CONVERT, "--format=hf", "--num_steps=0"], "--num_steps=0"),
    "convert: unknown dtype": ([*CONVERT, "--format=raw", "--dtype=fp16"], "fp16"),
    "convert: data dir is not a run": (["tools/convert_ckpt.py", "--model_dir={DATA}",
                                        "--format=raw", "--out={WORK}/export_new"], "data"),
    # analyze
    "analyze: no such run": (["tools/analyze.py", "trajectory", "--model_dir={WORK}/nope",
                              "--out={WORK}/analysis_new", "--text=x"], "nope"),
    "analyze: t outside [0, 1]": ([*ANALYZE, "spectral", "--times=2.0"], "2.0"),
    "analyze: zero steps": ([*ANALYZE, "lyapunov", "--num_steps=0"], "--num_steps=0"),
    "analyze: unknown analysis": ([*ANALYZE, "bogus"], "bogus"),
    # aot_compile
    "aot: unknown topology": ([*AOT, "--topology=v9x-8"], "v9x"),
    "aot: missing gin file": (["tools/aot_compile.py", "--gin_file={WORK}/nope.gin",
                               "--topology=v5e:2x2"], "nope.gin"),
    "aot: unknown remat": ([*AOT, "--topology=v5e:2x2", "--remat=bogus"], "bogus"),
}
NEW_DIRS = ("ft_new", "data_new", "export_new", "analysis_new")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_one_line_no_traceback_dirs_unchanged(case, run_dirs):
    argv, expected = CASES[case]
    argv = [a.format(**run_dirs) for a in argv]
    expected = expected.format(**run_dirs)
    before = {k: tree_hash(run_dirs[k]) for k in ("MODEL", "DATA")}
    proc = _run(run_dirs["WORK"], argv)
    left = [name for name in NEW_DIRS if (run_dirs["WORK"] / name).exists()]
    for name in left:  # so that one failing case does not fail the next ones
        shutil.rmtree(run_dirs["WORK"] / name)
    err = proc.stderr.strip()
    assert proc.returncode != 0, (proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert len(err.splitlines()) == 1, err[-3000:]
    assert ": error: " in err and expected in err, err
    for k in ("MODEL", "DATA"):
        assert tree_hash(run_dirs[k]) == before[k], f"{k} changed by {case}"
    assert not left, f"{case} left {left} behind"  # a refused command makes nothing
