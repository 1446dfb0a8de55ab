"""Checkpoint faults: damaged files in the latest step, a failed (disk-full) save, two runs on
one MODEL_DIR, and no half-made MODEL_DIR after a failed start. Also: restoring a healthy
checkpoint logs no orbax "Metadata file does not exist" warning."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from data_helpers import micro_cli_gin
from model_helpers import tiny_config
from orbax.checkpoint._src.serialization import serialization as orbax_serialization

from ode_lm.data import DataConfig, ensure_prepared
from ode_lm.training import checkpoint as ckpt_lib
from ode_lm.training import run_lock
from ode_lm.training.optim import OptimizerConfig
from ode_lm.training.run_dir import RunDir
from ode_lm.training.trainer import (
    MeshConfig,
    TrainConfig,
    Trainer,
    default_train_data,
)

MODEL = tiny_config(vocab_size=384)
DISK_FULL = ("RESOURCE_EXHAUSTED: Error writing local file: No space left on device "
             "[OS error: No space left on device]")  # what tensorstore raises on ENOSPC


@pytest.fixture(scope="module")
def data_config(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("faults_data")
    cfg = DataConfig(source="builtin", tokenizer="bytes", data_dir=str(root / "data"),
                     holdout_fraction=0.05, seq_len=32, global_batch_size=8,
                     eval_max_batches=1)
    ensure_prepared(cfg)  # a train_data that wraps default_train_data reads prepared shards
    return cfg


def make_trainer(model_dir, data_config, steps: int = 4, stop_at: int | None = None,
                 **kw) -> Trainer:
    """One device, a save every step; ``stop_at`` ends early on the schedule of ``steps``."""
    trainer = Trainer(
        model_config=MODEL, data_config=data_config,
        train_config=TrainConfig(model_dir=str(model_dir), num_train_steps=steps, log_every=1),
        optimizer_config=OptimizerConfig(learning_rate=3e-3, warmup_steps=1),
        checkpoint_config=ckpt_lib.CheckpointConfig(save_every=1, max_to_keep=5),
        mesh_config=MeshConfig(ici_parallelism=(1, 1, 1)), devices=jax.devices()[:1],
        print_fn=lambda _: None, **kw,
    )
    if stop_at is not None:
        trainer.cfg = dataclasses.replace(trainer.cfg, num_train_steps=stop_at)
    return trainer


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def steps_on_disk(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit())


def metrics(model_dir: Path) -> dict[int, dict]:
    rows = [json.loads(r) for r in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/loss" in r}


def params_at(model_dir: Path, step: int | None = None):
    """(params, step) through ``saved_run.load_model`` (restore_params: eval, sample, export)."""
    from flax import nnx

    from ode_lm.training.saved_run import load_model

    model, run = load_model(str(model_dir), step)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param)), run.step


@pytest.fixture(scope="module")
def run2(tmp_path_factory, data_config):
    """A run stopped after 2 of 4 steps: checkpoints 1 and 2; its state at step 2."""
    model_dir = tmp_path_factory.mktemp("faults") / "run"
    trainer = make_trainer(model_dir, data_config, 4, stop_at=2)
    assert trainer.run().step == 2
    assert steps_on_disk(model_dir) == [1, 2]
    assert not Path(RunDir(str(model_dir)).lock).exists()  # released on a normal exit
    return model_dir


def copy_run(run2: Path, dst: Path, keep: tuple[int, ...] = (1, 2)) -> Path:
    shutil.copytree(run2, dst)
    for step in steps_on_disk(dst):
        if step not in keep:
            shutil.rmtree(dst / "checkpoints" / str(step))
    return dst


def largest_state_file(model_dir: Path, step: int) -> Path:
    files = [p for p in (model_dir / "checkpoints" / str(step) / "state").rglob("*")
             if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


# ------------------------------------------------------------------ 1. metadata warning


def test_healthy_restore_logs_no_metadata_warning(run2, data_config, caplog):
    with caplog.at_level(logging.WARNING):
        params, step = params_at(run2)
        t = make_trainer(run2, data_config, 4)
        restored_step, state = t.checkpointer.restore_latest(t.spec.abstract_state)
        t.checkpointer.close()
    assert step == restored_step == 2
    assert ckpt_lib.tree_equal(host(params), host(state["params"]))
    noise = [r.getMessage() for r in caplog.records if "Metadata file does not exist" in
             r.getMessage() or "damaged" in r.getMessage()]
    assert not noise, noise


# ------------------------------------------------------------------- 2. damaged files


@pytest.mark.parametrize("damage", ["truncate", "zero"])
def test_damaged_latest_step_falls_back_and_resumes_exactly(run2, data_config, tmp_path,
                                                            damage, caplog):
    damaged = copy_run(run2, tmp_path / "damaged")
    reference = copy_run(run2, tmp_path / "reference", keep=(1,))  # as if only step 1 existed
    victim = largest_state_file(damaged, 2)
    original = victim.read_bytes()
    with open(victim, "r+b") as f:
        f.truncate(len(original) // 2 if damage == "truncate" else 0)
    damaged_bytes = victim.read_bytes()

    with caplog.at_level(logging.WARNING, logger="ode_lm"):
        result = make_trainer(damaged, data_config, 4, stop_at=3).run()
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert any("step 2" in w and "falling back to step 1" in w for w in warnings), warnings
    assert result.step == 3
    make_trainer(reference, data_config, 4, stop_at=3).run()

    assert steps_on_disk(damaged) == steps_on_disk(reference) == [1, 2, 3]
    # nothing deleted: the damaged step was moved aside, bytes as they were
    moved = damaged / "checkpoints" / "2.damaged" / victim.relative_to(damaged / "checkpoints/2")
    assert moved.read_bytes() == damaged_bytes
    for step in (2, 3):
        a, b = metrics(damaged)[step], metrics(reference)[step]
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
    pa, sa = params_at(damaged)
    pb, sb = params_at(reference)
    assert sa == sb == 3 and ckpt_lib.tree_equal(host(pa), host(pb))


def test_restore_params_falls_back_past_a_damaged_step(run2, tmp_path, caplog):
    damaged = copy_run(run2, tmp_path / "damaged")
    (damaged / "checkpoints/2/state/manifest.ocdbt").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="ode_lm"):
        params, step = params_at(damaged)
    assert step == 1
    assert any("step 2" in r.getMessage() for r in caplog.records)
    expected, _ = params_at(run2, step=1)
    assert ckpt_lib.tree_equal(host(params), host(expected))
    with pytest.raises(ckpt_lib.CheckpointDamagedError, match=r"checkpoints/2 is damaged"):
        params_at(damaged, step=2)


@pytest.mark.parametrize("victim", ["largest", "state/_METADATA", "data/process_0-of-1.json"])
def test_only_step_damaged_stops_with_one_line_and_changes_nothing(run2, data_config, tmp_path,
                                                                   victim):
    from ode_lm.cli import one_line

    only = copy_run(run2, tmp_path / "only", keep=(1,))
    path = (largest_state_file(only, 1) if victim == "largest"
            else only / "checkpoints" / "1" / victim)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    before = snapshot(only)
    with pytest.raises(ckpt_lib.CheckpointDamagedError) as e:
        make_trainer(only, data_config, 4).run()
    message = one_line(e.value)
    assert f"{only}/checkpoints/1 is damaged" in message and "nothing was deleted" in message
    assert "\n" not in str(e.value)
    if victim == "state/_METADATA":  # what params-only readers (eval, export) read too
        with pytest.raises(ckpt_lib.CheckpointDamagedError, match="checkpoints/1 is damaged"):
            params_at(only)
    assert snapshot(only) == before


# ---------------------------------------------------------------- 3. failed (full-disk) saves


def fail_writes_of_step(monkeypatch, step: int) -> None:
    """Stand-in for a full disk: orbax's tensorstore array write fails with tensorstore's
    ENOSPC error for every array of ``step`` (it runs in orbax's background save thread)."""
    original = orbax_serialization.async_serialize_from_host

    async def write(rslices, tensorstore_spec, *args, **kwargs):
        if f"/checkpoints/{step}.orbax-checkpoint-tmp" in json.dumps(tensorstore_spec,
                                                                     default=str):
            raise ValueError(DISK_FULL)
        return await original(rslices, tensorstore_spec, *args, **kwargs)

    monkeypatch.setattr(orbax_serialization, "async_serialize_from_host", write)


@pytest.mark.parametrize("async_save", [True, False])
def test_checkpointer_save_failure_names_step_and_keeps_previous(tmp_path, monkeypatch,
                                                                 async_save):
    fail_writes_of_step(monkeypatch, 2)
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), ckpt_lib.CheckpointConfig(
        save_every=1, async_save=async_save))
    tree = {"params": {"w": jax.numpy.arange(16.0)}, "step": jax.numpy.int32(1)}
    assert ckpt.save(1, tree)
    with pytest.raises(ckpt_lib.CheckpointSaveError) as e:
        ckpt.save(2, {**tree, "step": jax.numpy.int32(2)})
        # async: the step-2 failure surfaces at a later call (off the loop, the save worker
        # finds it while step 3 waits for step 2's write), at the latest at wait()
        ckpt.save(3, tree)
        ckpt.wait()
    ckpt.close()  # the same background error is not raised a second time
    msg = str(e.value)
    assert f"step 2 to {tmp_path}/checkpoints/2 failed" in msg and "No space left" in msg
    assert "latest complete checkpoint is still step 1" in msg
    again = ckpt_lib.Checkpointer(str(tmp_path))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), tree)
    step, restored = again.restore_latest(abstract)
    again.close()
    assert step == 1 and ckpt_lib.tree_equal(host(restored), host(tree))


def test_trainer_stops_at_failed_save_and_latest_is_first_save(run2, data_config, tmp_path,
                                                                monkeypatch):
    fail_writes_of_step(monkeypatch, 2)
    model_dir = tmp_path / "full"
    with pytest.raises(ckpt_lib.CheckpointSaveError, match=f"step 2 to {model_dir}/checkpoints/2"):
        make_trainer(model_dir, data_config, 8).run()
    # the save worker finds step 2's failure while handling step 3 (which it does not
    # save); the loop raises it at step 4's save at the latest
    assert max(metrics(model_dir)) <= 4, "the run went on after the failed save"
    assert steps_on_disk(model_dir) == [1]
    assert not Path(RunDir(str(model_dir)).lock).exists()  # released on the error too
    params, step = params_at(model_dir)
    expected, _ = params_at(run2, step=1)  # same config: the first save of the healthy run
    assert step == 1 and ckpt_lib.tree_equal(host(params), host(expected))



FULL_DISK_CLI = textwrap.dedent("""
    import json, logging, sys
    # progress off (the INFO sharding table goes to stderr too); warnings and errors stay
    logging.getLogger("ode_lm.train").setLevel(logging.WARNING)
    from orbax.checkpoint._src.serialization import serialization as s
    original = s.async_serialize_from_host
    async def write(rslices, spec, *args, **kwargs):
        if "/checkpoints/2.orbax-checkpoint-tmp" in json.dumps(spec, default=str):
            raise ValueError({disk_full!r})
        return await original(rslices, spec, *args, **kwargs)
    s.async_serialize_from_host = write
    from ode_lm.commands.train import main, main_exit
    sys.argv = ["ode-lm-train", "--gin_file={gin_file}"]
    main_exit(main)
""")


@pytest.mark.slow
def test_train_cli_full_disk_one_line_no_traceback(data_config, tmp_path):
    model_dir = tmp_path / "run"
    gin_file = tmp_path / "run.gin"
    gin_file.write_text(micro_cli_gin(data_config.data_dir, model_dir, train_steps=6,
                                      ici="(1, -1, 1)"))
    code = FULL_DISK_CLI.format(disk_full=DISK_FULL, gin_file=gin_file)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ODE_LM_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[0].startswith("ode-lm-train: error: saving checkpoint step 2 to "
                             f"{model_dir}/checkpoints/2 failed"), err
    assert "No space left on device" in err[0] and "still step 1" in err[0]
    # stopped at once: the save worker finds step 2's failure while handling step 3, and the
    # loop raises it at step 4's save at the latest
    assert "step 5/6" not in proc.stdout, proc.stdout
    assert steps_on_disk(model_dir) == [1]
    _, step = params_at(model_dir)
    assert step == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    """A really full disk: a tmpfs with room for one checkpoint (needs CAP_SYS_ADMIN)."""
    mount = tmp_path / "small"
    mount.mkdir()
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.slow
def test_train_cli_on_a_really_full_tmpfs(run2, data_config, small_tmpfs):
    step_dir = run2 / "checkpoints" / "1"
    one = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    size_k = (one * 3 // 2 + 256 * 1024) // 1024  # one checkpoint + run files, not two
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs",
                              str(small_tmpfs)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    model_dir = small_tmpfs / "run"
    gin_file = small_tmpfs.parent / "tmpfs.gin"
    gin_file.write_text(micro_cli_gin(data_config.data_dir, model_dir, train_steps=6,
                                      ici="(1, -1, 1)"))
    env = {k: v for k, v in os.environ.items() if k != "ODE_LM_DEBUG"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # run2's layout and size
    proc = subprocess.run(
        [sys.executable, "-c", "import logging, sys;"
         " from ode_lm.commands.train import main, main_exit;"
         " logging.getLogger('ode_lm.train').setLevel(logging.WARNING); main_exit(main)",
         f"--gin_file={gin_file}"],
        capture_output=True, text=True, timeout=600, env=env)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"saving checkpoint step 2 to {model_dir}/checkpoints/2 failed" in err[0], err
    assert "No space left on device" in err[0] and "still step 1" in err[0], err
    assert steps_on_disk(model_dir) == [1]
    params, step = params_at(model_dir)
    assert step == 1 and all(np.isfinite(x).all() for x in jax.tree.leaves(host(params)))


# ---------------------------------------------------------------------------- 4. run lock


HOLD = ("import sys, time; from ode_lm.training import run_lock; "
        "run_lock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(120)")


def test_second_run_on_a_held_model_dir_stops_and_changes_nothing(run2, data_config, tmp_path):
    from ode_lm.cli import one_line

    model_dir = copy_run(run2, tmp_path / "held")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(model_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(model_dir)
        with pytest.raises(run_lock.RunLockedError) as e:
            make_trainer(model_dir, data_config, 4).run()
        msg = one_line(e.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in msg
        assert str(model_dir) in msg
        assert snapshot(model_dir) == before
    finally:
        holder.kill()
        holder.wait()
    lock = run_lock.acquire(str(model_dir))  # the kernel dropped the dead holder's flock
    lock.release()
    assert not Path(RunDir(str(model_dir)).lock).exists()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_is_taken_over_and_released_on_sigterm(data_config, tmp_path, caplog):
    """A lock file from a dead process on this host: taken over with a warning; the
    SIGTERM (preemption) exit releases it."""
    model_dir = tmp_path / "stale"
    model_dir.mkdir()
    pid = dead_pid()
    Path(RunDir(str(model_dir)).lock).write_text(json.dumps(
        {"pid": pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z"}))

    def sigterm_after_first_batch(*args):
        iterator, batches = default_train_data(*args)

        def gen():
            for i, batch in enumerate(batches):
                if i == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield batch
        return iterator, gen()

    with caplog.at_level(logging.WARNING, logger="ode_lm"):
        result = make_trainer(model_dir, data_config, 4,
                              train_data=sigterm_after_first_batch).run()
    assert result.preempted and steps_on_disk(model_dir)[-1] == result.step < 4
    assert any("taking over" in r.getMessage() and f"pid {pid}" in r.getMessage()
               for r in caplog.records)
    assert not Path(RunDir(str(model_dir)).lock).exists()


def test_lock_of_another_host_is_refused(tmp_path):
    model_dir = tmp_path / "other"
    model_dir.mkdir()
    Path(RunDir(str(model_dir)).lock).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    before = snapshot(model_dir)
    with pytest.raises(run_lock.RunLockedError, match="pid 1 on host elsewhere"):
        run_lock.acquire(str(model_dir))
    assert snapshot(model_dir) == before


# ------------------------------------------------------------- 5. no half-made MODEL_DIR


def bad_stream(*args):
    raise ValueError("bad record in the training data")


def test_failed_start_removes_only_what_it_created(run2, data_config, tmp_path):
    new = tmp_path / "parent" / "new_run"
    with pytest.raises(ValueError, match="bad record"):
        make_trainer(new, data_config, 4, train_data=bad_stream).run()
    assert not (tmp_path / "parent").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="bad record"):
        make_trainer(empty, data_config, 4, train_data=bad_stream).run()
    assert empty.is_dir() and not any(empty.iterdir())

    existing = copy_run(run2, tmp_path / "existing")
    before = snapshot(existing)
    with pytest.raises(ValueError, match="bad record"):
        make_trainer(existing, data_config, 4, train_data=bad_stream).run()
    assert snapshot(existing) == before


def test_bad_config_creates_no_model_dir(data_config, tmp_path):
    """The vocabulary check is run's data step (after the lock is taken): the new MODEL_DIR
    the failed start made is removed again."""
    model_dir = tmp_path / "never"
    trainer = Trainer(model_config=MODEL.replace(vocab_size=128), data_config=data_config,
                      train_config=TrainConfig(model_dir=str(model_dir), num_train_steps=2),
                      devices=jax.devices()[:1], mesh_config=MeshConfig(ici_parallelism=(1, 1, 1)))
    assert not model_dir.exists()  # building the trainer writes nothing
    with pytest.raises(ValueError, match="vocab_size=128 is smaller"):
        trainer.run()
    assert not model_dir.exists()
