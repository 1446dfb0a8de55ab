"""The run directory's files: data_config.json round trip, and the one fallback to an old
run's config.gin (gin's parser, macros followed, scoped bindings and references ignored).

The files as a real training run leaves them are checked in test_train_cli.py (reference
run: data_config.json written; a copy without it loads through its operative config.gin);
a LoRA fine-tune loaded and merged by ``load_model`` in test_finetune.py.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from ode_lm import gin_setup
from ode_lm.data import DataConfig
from ode_lm.training import run_dir as run_dir_lib
from ode_lm.training import saved_run
from ode_lm.training.run_dir import RunDir

OLD_CONFIG_GIN = """\
from __gin__ import dynamic_registration
# Parameters for train:
DATA_DIR = '/data/old_run'
SEQ_LEN = 48
ALIAS = %SEQ_LEN
train.data = @DataConfig()
train.model = @ModelConfig()
DataConfig.data_dir = %DATA_DIR
DataConfig.seq_len = %ALIAS
DataConfig.holdout_fraction = 0.2
DataConfig.eval_max_batches = None
DataConfig.tokenizer = 'bytes'
DataConfig.retired_knob = 3
eval/DataConfig.seq_len = 4096
ModelConfig.d_model = 32
"""


def test_data_config_round_trip_and_unknown_fields(tmp_path):
    run = RunDir(str(tmp_path))
    config = DataConfig(data_dir=str(tmp_path / "data"), tokenizer="bytes", seq_len=16,
                        global_batch_size=4, eval_max_batches=2, packing="first_fit")
    run.write_data_config(config)
    assert run.data_config() == config and run.data_dir() == str(tmp_path / "data")
    assert sorted(os.listdir(tmp_path)) == ["data_config.json"]  # no temporary left behind
    values = json.loads((tmp_path / "data_config.json").read_text())
    (tmp_path / "data_config.json").write_text(json.dumps({**values, "bogus": 1}))
    with pytest.raises(ValueError, match=r"data_config.json: unknown DataConfig field.*bogus"):
        run.data_config()


def test_old_run_without_data_config_reads_config_gin_once(tmp_path, caplog):
    (tmp_path / "config.gin").write_text(OLD_CONFIG_GIN)
    before = sorted(os.listdir(tmp_path))
    run_dir_lib._warned_legacy.discard(str(tmp_path))
    assert RunDir(str(tmp_path)).data_config() is None  # no gin reader handed in
    run = gin_setup.run_dir(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ode_lm.run_dir"):
        first, second = run.data_config(), run.data_config()
    assert first == second == DataConfig(data_dir="/data/old_run", seq_len=48,
                                         holdout_fraction=0.2, tokenizer="bytes")
    warnings = [r for r in caplog.records if "data_config.json" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0].getMessage()
    assert sorted(os.listdir(tmp_path)) == before  # reading writes nothing


def test_a_dir_without_run_facts(tmp_path):
    run = gin_setup.run_dir(str(tmp_path))
    assert run.data_config() is None and run.data_dir() is None and run.finetune() is None
    (tmp_path / "config.gin").write_text("ModelConfig.d_model = 32\n")  # no DataConfig
    assert run.data_config() is None
    with pytest.raises(FileNotFoundError, match="model_config.json not found"):
        run.model_config()
    with pytest.raises(FileNotFoundError, match="no such directory"):
        saved_run.load_model(str(tmp_path / "nope"))
