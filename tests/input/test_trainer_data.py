"""Data preparation in a multi-host job: process 0 prepares, the others wait at a barrier."""

from __future__ import annotations

import jax
import pytest

from ode_lm import data as data_lib
from ode_lm.training import trainer


@pytest.mark.parametrize("process_index", [0, 1])
def test_prepare_data_once_orders_process_zero_before_the_barrier(monkeypatch, process_index):
    events = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process_index)
    monkeypatch.setattr(data_lib, "ensure_prepared",
                        lambda cfg: events.append(("prepare", cfg)) or {"vocab_size": 7})
    manifest = trainer.prepare_data_once("cfg", sync=lambda name: events.append(("sync", name)))
    assert manifest == {"vocab_size": 7}
    kinds = [e[0] for e in events]
    # Process 0 writes before the barrier; every process (re)reads the manifest after it,
    # which prepares only where DATA_DIR is per-host and still empty.
    assert kinds == (["prepare", "sync", "prepare"] if process_index == 0 else ["sync", "prepare"])


def test_prepare_data_once_single_process_has_no_barrier(monkeypatch):
    events = []
    monkeypatch.setattr(data_lib, "ensure_prepared",
                        lambda cfg: events.append("prepare") or {"vocab_size": 7})
    trainer.prepare_data_once("cfg", sync=lambda name: events.append("sync"))
    assert events == ["prepare"]


@pytest.mark.slow
def test_data_is_prepared_once_in_the_data_step_after_the_state(monkeypatch, tmp_path):
    """Building the trainer reads no data; run() prepares it once (one ensure_prepared, so
    one barrier on a pod), after the state is restored or initialised."""
    from data_helpers import builtin_config

    from ode_lm.models.config import ModelConfig

    data = builtin_config("bytes", seq_len=16, eval_max_batches=1)
    events = []
    real_prepare, real_init = data_lib.ensure_prepared, trainer.state_lib.init_state
    monkeypatch.setattr(data_lib, "ensure_prepared",
                        lambda cfg: events.append("prepare") or real_prepare(cfg))
    monkeypatch.setattr(trainer.state_lib, "init_state",
                        lambda *a: events.append("init") or real_init(*a))
    t = trainer.Trainer(
        model_config=ModelConfig(vocab_size=384, d_model=32, num_heads=2, num_steps=2,
                                 max_seq_len=16, time_embed_dim=4, sinusoidal_dim=4),
        data_config=data,
        train_config=trainer.TrainConfig(model_dir=str(tmp_path / "run"), num_train_steps=1),
        mesh_config=trainer.MeshConfig(ici_parallelism=(1, 1, 1)), devices=jax.devices()[:1])
    assert events == []
    result = t.run()
    assert events == ["init", "prepare"]
    assert result.step == 1 and set(result.eval) == {"eval/loss", "eval/perplexity",
                                                     "eval/nfe", "eval/tokens"}
