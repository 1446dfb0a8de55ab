"""Every setting is checked where it is made: each field of the run's config classes, given a
bad value through ``--gin.`` on the train CLI, stops it with exit 2 and one stderr line
naming the field (and the value), before the trainer is built (so before any compile).

``BAD`` names every field of every class in it: a class that gains a field fails
``test_the_table_names_every_field`` until the field is listed with a value it refuses.
A new config class is one more entry; the training objective's terms are config classes
too (the run lists all four, so each is built).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import gin
import pytest
from data_helpers import micro_cli_gin

from ode_lm import distributed, gin_setup
from ode_lm.commands import train as train_cli
from ode_lm.data.config import DataConfig
from ode_lm.models.config import ModelConfig
from ode_lm.training.checkpoint import CheckpointConfig
from ode_lm.training.config import MeshConfig, TrainConfig
from ode_lm.training.objective import (
    Distillation,
    KineticEnergy,
    RandomSteps,
    SolverDistillation,
    SolverShare,
)
from ode_lm.training.optim import OptimizerConfig
from ode_lm.training.step import StepConfig

# class -> {field: a value it refuses, as gin text}; '{FILE}' is an existing file and
# '{WORK}' a scratch directory. A value of (gin text, words the error line holds) is for a
# line that names the value otherwise than as repr(value).
BAD: dict[type, dict[str, str | tuple[str, str]]] = {
    ModelConfig: {
        "flavour": "'gpt3'", "architecture": "'rnn'", "vocab_size": "0", "d_model": "0",
        "num_heads": "0", "mlp_dim": "0", "max_seq_len": "0", "num_steps": "0",
        "solver": "'rk5'", "time_embed_dim": "0", "sinusoidal_dim": "0", "time_scale": "0.0",
        "time_max_period": "1.0", "time_dependent": "'yes'", "weight_generation": "'lazy'",
        "random_grid_offset": "'yes'", "rtol": "0.0", "atol": "-1.0", "num_layers": "0",
        "dtype": "'float16'", "remat": "'some'", "attention_impl": "'flash'",
        "norm_eps": "0.0", "rope_theta": "-1.0", "rotary_fraction": "0.0",
        "dropout_rate": "1.0", "init_std": "0.0",
    },
    TrainConfig: {
        "model_dir": "''", "num_train_steps": "0", "seed": "-1", "log_every": "0",
        "eval_every": "-1",
        # removed: the line names the field that took them over
        "eval_num_steps": ("(3, 12)", "TrainConfig.eval_num_steps=(3, 12): no longer a setting; "
                           "every eval solve is in TrainConfig.eval_solves"),
        "eval_solver": ("'rk4'", "TrainConfig.eval_solver='rk4': no longer a setting; every "
                        "eval solve is in TrainConfig.eval_solves"),
        "eval_solves": ("('rk4:steps=8', 'rk4:step=8')", "TrainConfig.eval_solves='rk4:step=8'"),
        "max_bad_steps": "0", "cpu_peak_flops": "0.0", "lm_eval_tasks": "('',)",
        "lm_eval_include_path": "'{WORK}/no_tasks'", "lm_eval_limit": "0",
        "compilation_cache_dir": "'{FILE}'",
    },
    DataConfig: {
        "data_dir": "'{FILE}'", "source": "''", "tokenizer": "''", "text_field": "''",
        "text_delimiter": "''", "non_utf8": "'ignore'", "holdout_fraction": "1.0",
        "holdout_seed": "-1", "docs_per_shard": "0",
        "mixture": "{}", "mixture_weights": "((0, {'a': 1.0}),)",
        "seq_len": "0", "global_batch_size": "0", "seed": "-1", "packing": "'best_fit'",
        "first_fit_bins": "-1", "num_epochs": "0", "row_shuffle_window": "-1",
        "num_threads": "0", "prefetch": "-1", "num_workers": "-1", "eval_batch_size": "0",
        "eval_max_batches": "0", "streaming": "'yes'", "shuffle_window": "-1",
        "interleave_files": "0",
    },
    CheckpointConfig: {
        "save_every": "0", "max_to_keep": "0", "keep_period": "0", "async_save": "'yes'",
        "off_loop": "1",
    },
    MeshConfig: {
        "ici_parallelism": "(1, -1, -1)", "dcn_parallelism": "(0, 1, 1)",
        "rule_overrides": ("(('bogus', 'data'),)", "unknown logical axis 'bogus'"),
    },
    OptimizerConfig: {
        "learning_rate": "0.0", "warmup_steps": "-1", "min_lr_ratio": "1.5", "b1": "1.0",
        "b2": "-0.1", "eps": "0.0", "weight_decay": "-0.1",
        "weight_decay_mask": ("'(unclosed'", "weight_decay_mask='(unclosed': not paper"),
        "clip_norm": "-1.0",
    },
    StepConfig: {
        "microbatches": "0", "num_steps": "0", "solver": "'rk5'", "dropout": "'yes'",
        "terms": ("('kinetic',)", "StepConfig.terms=('kinetic',)"),
    },
    RandomSteps: {"choices": "(0, 2)", "weights": "(1.0,)"},
    KineticEnergy: {"weight": "-1.0", "final": "-1.0", "ramp_steps": "-1"},
    Distillation: {"weight": "0.0", "num_steps": "(0,)", "share": "0.0", "row_stride": "0",
                   "block_steps": "0"},
    SolverShare: {"share": "1.5", "solver": "'rk5'", "num_steps": "0", "final": "1.5",
                  "ramp_steps": "-1", "block_steps": "0"},
    SolverDistillation: {"weight": "0.0", "share": "0.0", "solver": "'rk5'", "num_steps": "0",
                         "row_stride": "0", "block_steps": "0"},
}
# every term listed, so each term class is built from its bindings
TERMS_GIN = ("\nStepConfig.terms = [@RandomSteps(), @KineticEnergy(), @Distillation(), "
             "@SolverShare(), @SolverDistillation()]\n")
# fields the configs set through a macro (gin refuses a second name for them)
MACROS = {(TrainConfig, "model_dir"): "MODEL_DIR", (TrainConfig, "num_train_steps"): "TRAIN_STEPS"}
CASES = [(cls, field) for cls, fields in BAD.items() for field in fields]


class ReachedTheTrainer(AssertionError):
    """The stand-in Trainer: a bad setting got past its config class."""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("settings")
    (work / "run.gin").write_text(micro_cli_gin(work / "data", work / "run", train_steps=2,
                                                ici="(-1, 1, 1)") + TERMS_GIN)
    (work / "a_file").write_text("not a directory")
    return work


@pytest.mark.parametrize("cls, field", CASES, ids=[f"{c.__name__}.{f}" for c, f in CASES])
def test_a_bad_setting_stops_the_train_cli_with_one_line(cls, field, work, monkeypatch, capsys):
    def trainer(**kwargs):
        raise ReachedTheTrainer(f"{cls.__name__}.{field}: the bad value reached the trainer")

    monkeypatch.setattr(distributed, "initialize", lambda *a, **k: None)
    monkeypatch.setattr(gin_setup, "Trainer", trainer)
    entry = BAD[cls][field]
    value, words = entry if isinstance(entry, tuple) else (entry, None)
    value = value.replace("{FILE}", str(work / "a_file")).replace("{WORK}", str(work))
    name = MACROS.get((cls, field), f"{cls.__name__}.{field}")
    try:
        status = train_cli.main([f"--gin_file={work / 'run.gin'}", f"--gin.{name}={value}"])
    finally:
        gin.clear_config()
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    words = words or f"{cls.__name__}.{field}={ast.literal_eval(value)!r}"
    assert err.startswith("ode-lm-train: error: ") and words in err, err


def test_an_adaptive_eval_solve_without_rtol_is_solved_at_the_models_rtol(tmp_path):
    """An adaptive eval solve without its rtol once stopped Trainer.__init__ with a TypeError
    (its rtol reached the eval's names as None): the trainer's Evaluator has the model's."""
    import jax
    from model_helpers import tiny_config

    from ode_lm.models.solve import Solve
    from ode_lm.training.evaluation import LossEval
    from ode_lm.training.trainer import Trainer

    trainer = Trainer(
        model_config=tiny_config(rtol=1e-2), data_config=DataConfig(seq_len=16),
        train_config=TrainConfig(model_dir=str(tmp_path / "run"), num_train_steps=1),
        mesh_config=MeshConfig(ici_parallelism=(1, 1, 1)), devices=jax.devices()[:1],
        evals=[LossEval([Solve("adaptive")])])
    assert trainer.eval_settings == {"@adaptive:rtol=0.01": Solve("adaptive", rtol=1e-2)}


@pytest.mark.parametrize("cls", list(BAD), ids=[c.__name__ for c in BAD])
def test_the_table_names_every_field(cls):
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(BAD[cls]) == fields, (f"{cls.__name__}: list each new field in BAD with a "
                                     f"value it refuses: {sorted(fields - set(BAD[cls]))}")
