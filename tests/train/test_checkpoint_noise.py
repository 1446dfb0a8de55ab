"""The filter that keeps a failed save to one line: what it drops and what it keeps."""

from __future__ import annotations

import logging

import pytest

from ode_lm.training import checkpoint_noise


def _record(exc: BaseException | None, pathname: str = "/usr/lib/asyncio/base_events.py"):
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("asyncio", logging.ERROR, pathname, 1,
                             "Future exception was never retrieved", None, exc_info)


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.delenv("ODE_LM_DEBUG", raising=False)


def test_an_unretrieved_write_into_a_save_in_progress_is_dropped(no_debug):
    """tensorstore fails the write futures of a save on a full disk with no orbax frame in
    their tracebacks; asyncio logs each when it is collected."""
    noise = checkpoint_noise._OrbaxSaveNoise()
    exc = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database at '
                     'local file "/run/checkpoints/2.orbax-checkpoint-tmp/state/": '
                     "No space left on device")
    assert not noise.filter(_record(exc))


def test_an_unretrieved_read_of_a_truncated_saved_step_is_dropped(no_debug):
    """The restore reports a truncated step as damaged in one line and falls back; the read
    futures tensorstore failed are logged by asyncio when collected."""
    noise = checkpoint_noise._OrbaxSaveNoise()
    exc = ValueError('OUT_OF_RANGE: Error reading "params.embeddings.token/6.0" in OCDBT '
                     'database at local file "/run/checkpoints/3/state/": Requested byte '
                     "range [38400, 44544) is not valid for value of size 8")
    assert not noise.filter(_record(exc))


def test_other_errors_and_plain_records_are_kept(no_debug, monkeypatch):
    noise = checkpoint_noise._OrbaxSaveNoise()
    assert noise.filter(_record(ValueError("No space left on device: /data/train.bin")))
    assert noise.filter(_record(None))
    monkeypatch.setenv("ODE_LM_DEBUG", "1")  # the debug switch keeps everything
    exc = ValueError("Error writing /run/checkpoints/2.orbax-checkpoint-tmp/x")
    assert noise.filter(_record(exc))
