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
