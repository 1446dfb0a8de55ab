"""A host dies mid-run: the survivor stops with one line, a relaunch resumes exactly.

Also the watchdog's message logic against a fake coordination-service client.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from data_helpers import MICRO_MODEL_GIN
from multihost_helpers import free_port, result_line, worker_env
from train_cli_helpers import (
    assert_same_params,
    checkpoint_steps,
    losses,
    sigkill_after_checkpoint,
)

from ode_lm import distributed

try:  # the multi-process tests need JAX's distributed runtime
    from jax._src import distributed as _jax_distributed  # noqa: F401
    from jax._src.lib import _jax

    HAVE_DISTRIBUTED = hasattr(_jax, "get_distributed_runtime_service")
except ImportError:  # pragma: no cover - jax without the distributed runtime
    HAVE_DISTRIBUTED = False


class FakeClient:
    """get_live_nodes like JAX's client: {process id: incarnation} of the live ones."""

    def __init__(self, live=None, error=None):
        self.live, self.error = live, error

    def get_live_nodes(self, ids):
        if self.error is not None:
            raise self.error
        return {i: 7 for i in ids if i in self.live}


def test_watchdog_names_the_lost_process():
    dog = distributed.PeerWatchdog(FakeClient(live={0, 1, 2}), 3, 0, 10, 1.0)
    assert dog.check() is None
    dog.client = FakeClient(live={0, 2})
    assert dog.check() == (
        "distributed: lost process 1 of 3 (no heartbeat for 10 s); stopping process 0. "
        "Restart all processes to resume from the last complete checkpoint")
    dog.client = FakeClient(live={0})
    assert "lost processes 1, 2 of 3" in dog.check()


def test_watchdog_on_a_worker_names_the_coordinator():
    dog = distributed.PeerWatchdog(FakeClient(error=RuntimeError("UNAVAILABLE")), 2, 1, 10, 1.0)
    assert dog.check().startswith(
        "distributed: lost the coordinator, process 0 of 2 (its service is unreachable)")


def test_watchdog_thread_reports_once_and_stops():
    lost = []
    client = FakeClient(live={0, 1})
    dog = distributed.PeerWatchdog(client, 2, 0, 10, 0.01, on_lost=lost.append).start()
    client.live = {0}
    dog._thread.join(timeout=30)
    assert not dog._thread.is_alive() and len(lost) == 1 and "lost process 1 of 2" in lost[0]
    quiet = distributed.PeerWatchdog(FakeClient(live={0}), 2, 0, 10, 60.0, on_lost=lost.append)
    quiet.start().stop()  # stopped before its first poll: never reports
    assert len(lost) == 1 and not quiet._thread.is_alive()


@pytest.mark.parametrize("field, value", [("heartbeat_timeout_seconds", 0),
                                          ("shutdown_timeout_seconds", 1.5),
                                          ("watchdog_poll_seconds", 0)])
def test_bad_distributed_config(field, value):
    with pytest.raises(ValueError, match=f"DistributedConfig.{field}="):
        distributed.DistributedConfig(**{field: value})


def test_distributed_config_is_gin_bindable():
    import gin

    from ode_lm import gin_setup

    with gin.unlock_config():
        gin.parse_config("DistributedConfig.heartbeat_timeout_seconds = 12")
    try:
        assert gin_setup.GinDistributedConfig().heartbeat_timeout_seconds == 12
    finally:
        gin.clear_config()


# ------------------------------------------------------------ a real 2-process job

HEARTBEAT_S = 10  # the survivor must be gone well within 60 s of the kill
STEPS = 8
WORKER = textwrap.dedent("""
    # The train CLI's path (ode_lm.cli.run_gin_cli: gin, distributed.initialize, the error
    # report, exit_process) around a tiny in-memory run: no data preparation.
    import json, sys
    from ode_lm import cli, distributed

    model_dir, num_train_steps, heartbeat = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    B, T, V = 8, 16, 64

    def global_batch(seed, mesh, rules):
        # the batch of a step depends only on the step: exact on resume
        import jax, numpy as np
        from ode_lm.partitioning import batch_sharding

        sharding = batch_sharding(mesh, rules)
        tokens = np.random.default_rng(seed).integers(0, V, (B, T + 1), dtype=np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                 "segment_ids": np.ones((B, T), np.int32),
                 "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)),
                 "loss_mask": np.ones((B, T), np.float32)}
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
                for k, v in batch.items()}

    def train_data(data_config, mesh, rules, start_step):
        def batches():
            step = start_step
            while True:
                yield global_batch(step, mesh, rules)
                step += 1
        return None, batches()

    def entry():
        from ode_lm.data.config import DataConfig
        from ode_lm.models.config import ModelConfig
        from ode_lm.training.checkpoint import CheckpointConfig
        from ode_lm.training.optim import OptimizerConfig
        from ode_lm.training.trainer import Trainer, TrainConfig

        return Trainer(
            model_config=ModelConfig(vocab_size=V, d_model=32, num_heads=2, num_steps=2,
                                     time_embed_dim=4, sinusoidal_dim=4, max_seq_len=T),
            data_config=DataConfig(seq_len=T, global_batch_size=B),
            train_config=TrainConfig(model_dir=model_dir, num_train_steps=num_train_steps,
                                     log_every=1),
            optimizer_config=OptimizerConfig(learning_rate=1e-2, warmup_steps=2),
            checkpoint_config=CheckpointConfig(save_every=1, max_to_keep=2),
            train_data=train_data,
            eval_data=lambda d, mesh, rules: [global_batch(10_000, mesh, rules)]).run()

    def report(result):
        sys.stdout.write("RESULT " + json.dumps({"step": result.step, "eval": result.eval})
                         + "\\n")
        return 0

    bindings = f"DistributedConfig.heartbeat_timeout_seconds = {heartbeat}"
    distributed.exit_process(cli.run_gin_cli([f"--gin_bindings={bindings}"], prog="worker",
                                             entry=entry, report=report))
""")


def start_job(script: Path, model_dir: Path, port: int) -> list[subprocess.Popen]:

    return [subprocess.Popen([sys.executable, str(script), str(model_dir), str(STEPS),
                              str(HEARTBEAT_S)], env=worker_env(pid, 2, 4, port),
                             cwd=str(script.parent), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for pid in range(2)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DISTRIBUTED, reason="jax.distributed runtime not available")
def test_sigkill_of_process_1_stops_process_0_then_relaunch_resumes_exactly(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    # the uninterrupted reference job runs alongside the job that loses a host
    ref_job = start_job(script, reference, free_port())
    job = start_job(script, killed, free_port())
    sigkill_after_checkpoint(job[1], killed, STEPS // 2, jitter=0.3)  # process 1 of the job
    killed_at = time.time()
    (rc0, out0, err0), _ = finish(job, timeout=120)
    waited = time.time() - killed_at
    assert rc0 == distributed.EXIT_PEER_LOST != 0, err0[-3000:]
    assert waited < 60, waited  # heartbeat 10 s + a 1 s poll; generous for a loaded machine
    last = err0.strip().splitlines()[-1]
    assert last.startswith("ode-lm: error: distributed: lost process 1 of 2 (no heartbeat for "
                           f"{HEARTBEAT_S} s); stopping process 0"), err0[-3000:]
    # nothing else reports an error: no C++ abort, no traceback, no second error line
    assert "Check failure stack trace" not in err0 and "Traceback" not in err0, err0[-3000:]
    assert [x for x in err0.splitlines() if "error:" in x] == [last], err0[-3000:]
    saved = checkpoint_steps(killed)
    assert saved and saved[-1] < STEPS, saved

    relaunched = start_job(script, killed, free_port())  # alongside the reference, if running
    ref_results = finish(ref_job, timeout=600)
    for rc, _, err in ref_results:
        assert rc == 0, err[-3000:]
    ref_out = ref_results[0][1]
    relaunch = finish(relaunched, timeout=600)
    for rc, _, err in relaunch:
        assert rc == 0, err[-3000:]
    assert "resumed from step" in relaunch[0][1], relaunch[0][1][-2000:]
    assert result_line(relaunch[0][1]) == result_line(ref_out), ref_out[-2000:]
    assert losses(killed) == losses(reference) and sorted(losses(killed)) == list(
        range(1, STEPS + 1))
    assert_same_params(reference, killed, STEPS)


# ------------------------------------------------- a failed run's stderr is its one line

LATE_FAILURE_GIN = MICRO_MODEL_GIN + """SEQ_LEN = 32
VOCAB_SIZE = 128
DATA_DIR = '{data_dir}'
MODEL_DIR = '{model_dir}'
train.model_dir = %MODEL_DIR
train.num_train_steps = 2
"""


@pytest.mark.slow
def test_late_failure_prints_only_its_line_and_table_needs_verbose(tmp_path):
    """VOCAB_SIZE=128 under the bytes tokenizer fails in check_vocab, after the mesh, the
    abstract state and the sharding table: stderr is the one error line; the table shows on
    the console with --verbose only (and sharding.txt is written only by a run that starts)."""
    from data_helpers import builtin_config

    data = builtin_config("bytes")  # prepared here, so the CLI run logs no preparation
    model_dir = tmp_path / "run"
    gin_file = tmp_path / "late.gin"
    gin_file.write_text(LATE_FAILURE_GIN.format(data_dir=data.data_dir, model_dir=model_dir))
    cmd = [sys.executable, "-m", "ode_lm.commands.train", f"--gin_file={gin_file}"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 1
    assert plain.stderr.splitlines() == [
        "ode-lm-train: error: ModelConfig.vocab_size=128 is smaller than the tokenizer's 257 "
        f"(bytes in {data.data_dir})"], plain.stderr
    assert not (model_dir / "sharding.txt").exists()
    verbose = subprocess.run([*cmd, "--verbose"], capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 1
    lines = verbose.stderr.splitlines()
    assert lines[-1].startswith(plain.stderr.strip())  # + gin's "In call to ..." (verbose)
    assert any(x.endswith("parameter sharding on mesh {'data': 1, 'fsdp': 8, 'tensor': 1}:")
               for x in lines), verbose.stderr
    assert any(x.startswith("block/") for x in lines), verbose.stderr


def test_wait_for_lost_peer_only_after_runtime_errors(monkeypatch):
    """A failed collective waits for the watchdog's verdict; a config error does not wait."""
    import jax

    lost = []
    client = FakeClient(live={0, 1})
    # an hour's heartbeat timeout: waiting on the wrong error would hang this test
    dog = distributed.PeerWatchdog(client, 2, 0, 3600, 0.01, on_lost=lost.append).start()
    monkeypatch.setattr(distributed, "_watchdog", dog)
    distributed.wait_for_lost_peer(ValueError("DataConfig.seq_len=0"))  # returns at once
    assert dog.is_alive() and not lost
    client.live = {0}
    try:
        raise jax.errors.JaxRuntimeError("Gloo AllGather failed: Connection reset by peer")
    except jax.errors.JaxRuntimeError:
        try:
            raise OSError("checkpoint clean-up failed")  # raised in a finally
        except OSError as cleanup:
            distributed.wait_for_lost_peer(cleanup)  # returns once the watchdog reported
    assert not dog.is_alive() and len(lost) == 1 and "lost process 1 of 2" in lost[0]
