"""MFU peak table, clu aggregation, the TF-free TensorBoard writer read back, progress line."""

import json
import math

import jax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ode_lm.training import metrics


def test_peak_table_covers_accelerators_and_cpu():
    assert metrics.peak_flops_per_device("TPU v4") == 275e12
    assert metrics.peak_flops_per_device("TPU v5 lite") == 197e12
    assert metrics.peak_flops_per_device("TPU v5p") == 459e12
    assert metrics.peak_flops_per_device("TPU v6 lite") == 918e12
    assert metrics.peak_flops_per_device("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops_per_device("NVIDIA H200", "float32") == 494e12
    assert metrics.peak_flops_per_device("mystery chip") is None
    cpus = jax.devices("cpu")
    assert metrics.total_peak_flops(cpus, "float32", 123e9) == 123e9  # shared host, per process
    assert metrics.mfu(1e6, 1e5, 1e12) == pytest.approx(0.1)


def test_clu_window_average_and_last_value():
    w = None
    for loss, lr, n in [(2.0, 0.1, 4), (4.0, 0.2, 8)]:
        w = metrics.accumulate(w, dict(loss=loss, grad_norm=1.0, param_norm=3.0,
                                       learning_rate=lr, skipped_steps=0, num_steps=n,
                                       kinetic_energy=loss / 10))
    values = w.compute()
    assert float(values["loss"]) == pytest.approx(3.0)
    assert float(values["learning_rate"]) == pytest.approx(0.2)
    assert float(values["num_steps"]) == pytest.approx(6.0)  # mean N of the window
    assert float(values["kinetic_energy"]) == pytest.approx(0.3)


def test_tf_free_writer_event_files_read_back(tmp_path):
    writer = metrics.create_writer(str(tmp_path), process_index=0)
    writer.write_scalars(1, {"train/loss": 3.5, "eval/perplexity@steps=4": 20.0})
    writer.write_scalars(2, {"train/loss": 3.0})
    writer.write_texts(0, {"config": "TrainConfig.seed = 0"})
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [3.5, 3.0]
    assert acc.Scalars("eval/perplexity@steps=4")[0].step == 1  # tag kept verbatim
    assert acc.Tensors("config")[0].tensor_proto.string_val == [b"TrainConfig.seed = 0"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "train/loss": 3.5, "eval/perplexity@steps=4": 20.0}
    assert metrics.create_writer(str(tmp_path / "other"), process_index=1) is not None
    assert not (tmp_path / "other").exists()


def test_progress_line():
    line = metrics.progress_line(120, 600, 4.2131, 12345.0, 0.231, 92.0)
    assert line == "step 120/600 | loss 4.2131 | 12.3k tok/s | MFU 23.1% | ETA 1m32s"
    assert "MFU n/a" in metrics.progress_line(1, 2, 1.0, 1.0, math.nan, 1.0)
