"""The peak behind MFU on a CPU: probed once per machine and cached, or set by
``--gin.TrainConfig.cpu_peak_flops`` (then MFU follows the setting)."""

from __future__ import annotations

import json

import jax
import pytest

from ode_lm import hardware
from ode_lm.training import metrics


class Recorder:
    """A dict-backed writer: the scalars MetricWindow.log writes."""

    def __init__(self):
        self.scalars: dict[int, dict] = {}

    def write_scalars(self, step, scalars):
        self.scalars[step] = dict(scalars)


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A fake probe (counted) and a fresh cache under tmp_path."""
    calls = []

    def fake_probe():
        calls.append(1)
        return 4e10

    monkeypatch.setenv("ODE_LM_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "probe_cpu_peak_flops", fake_probe)
    hardware.cpu_peak_flops.cache_clear()
    yield calls
    hardware.cpu_peak_flops.cache_clear()


def window_mfu(peak: float) -> float:
    """train/mfu of two 1 s steps of 1000 tokens at 6e3 FLOPs per token over ``peak``."""
    now = [100.0]
    window = metrics.MetricWindow(tokens_per_step=1000, flops_per_token=6e3, peak_flops=peak,
                                  total_steps=2, clock=lambda: now[0])
    outputs = dict(loss=1.0, grad_norm=1.0, param_norm=1.0, learning_rate=0.1,
                   skipped_steps=0, num_steps=2, kinetic_energy=0.0)
    for step in (1, 2):
        now[0] += 1.0
        window.add(outputs, dispatched=step + 1)
    writer = Recorder()
    window.log(2, writer)
    return writer.scalars[2]["train/mfu"]


def test_cpu_peak_is_probed_once_per_machine_and_cached(probe, tmp_path, monkeypatch):
    cpus = jax.devices("cpu")
    assert metrics.total_peak_flops(cpus, "float32", None) == 4e10  # one process
    assert metrics.total_peak_flops(cpus, "float32") == 4e10
    assert len(probe) == 1
    cache = json.loads((tmp_path / "cpu_peak_flops.json").read_text())
    assert list(cache) == [hardware.cpu_key()] and cache[hardware.cpu_key()]["flops"] == 4e10
    hardware.cpu_peak_flops.cache_clear()  # a new process on the same machine: the file
    assert metrics.total_peak_flops(cpus, "float32") == 4e10 and len(probe) == 1
    # another machine (CPU model or cores) sharing the cache directory probes its own
    monkeypatch.setattr(hardware, "cpu_key", lambda: "other cpu x64")
    hardware.cpu_peak_flops.cache_clear()
    metrics.total_peak_flops(cpus, "float32")
    assert len(probe) == 2
    assert set(json.loads((tmp_path / "cpu_peak_flops.json").read_text())) == {
        "other cpu x64", *cache}


def test_a_lower_reading_never_replaces_a_higher_cached_one(probe, tmp_path, monkeypatch):
    """A probe under load reads low: an old cache entry is probed again, and the best
    reading stays; a fresh one is not probed at all."""
    path = tmp_path / "cpu_peak_flops.json"
    week = hardware.CPU_PEAK_MAX_AGE_DAYS * 86400
    path.write_text(json.dumps({hardware.cpu_key(): {"flops": 9e10, "probed": 0.0}}))
    assert hardware.cpu_peak_flops() == 9e10 and len(probe) == 1  # old: probed, 4e10 < 9e10
    entry = json.loads(path.read_text())[hardware.cpu_key()]
    assert entry["flops"] == 9e10 and entry["probed"] > week  # kept, and its probe dated
    hardware.cpu_peak_flops.cache_clear()
    assert hardware.cpu_peak_flops() == 9e10 and len(probe) == 1  # fresh: not probed again
    # the older format (a bare number) is probed again and raised by a higher reading
    path.write_text(json.dumps({hardware.cpu_key(): 1e10}))
    hardware.cpu_peak_flops.cache_clear()
    assert hardware.cpu_peak_flops() == 4e10 and len(probe) == 2
    assert json.loads(path.read_text())[hardware.cpu_key()]["flops"] == 4e10


def test_unwritable_cache_still_gives_the_probed_peak(probe, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ODE_LM_CACHE", str(blocker / "sub"))  # a directory under a file
    assert metrics.total_peak_flops(jax.devices("cpu"), "float32") == 4e10


def test_the_flag_sets_the_peak_and_mfu_follows(probe, tmp_path):
    """``--gin.TrainConfig.cpu_peak_flops`` is the peak the trainer hands the metric window
    (the probe is not run); unset, the trainer's default is the probed peak."""
    from ode_lm import gin_setup

    def peak_from(argv: list[str]) -> float:
        gin_setup.parse_gin(gin_setup.parse_flags(argv))
        try:
            cfg = gin_setup.GinTrainConfig(model_dir=str(tmp_path), num_train_steps=1)
        finally:
            gin_setup.clear()
        return metrics.total_peak_flops(jax.devices("cpu"), "float32", cfg.cpu_peak_flops)

    assert peak_from(["--gin.TrainConfig.cpu_peak_flops=2e9"]) == 2e9
    assert peak_from(["--gin.TrainConfig.cpu_peak_flops=4e9"]) == 4e9
    assert not probe
    assert window_mfu(2e9) == pytest.approx(6e3 * 1000 / 2e9)
    assert window_mfu(4e9) == pytest.approx(window_mfu(2e9) / 2)
    assert peak_from([]) == 4e10 and len(probe) == 1  # the default: probed


def test_the_probe_measures_a_matmul_rate():
    rate = hardware.probe_cpu_peak_flops(n=128, repeats=2)
    assert 1e6 < rate < 1e15
    assert " x" in hardware.cpu_key()  # CPU model, then the cores this process may use
