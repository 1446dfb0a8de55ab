"""Multi-host: ode_lm.distributed settings, and real multi-process JAX jobs on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from data_helpers import FINETUNE_DATA_GIN
from multihost_helpers import free_port, result_line, spawn

from ode_lm import distributed


@pytest.fixture()
def clean_env(monkeypatch):
    for var in (distributed.ENV_ADDRESS, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_no_settings_means_single_process(clean_env):
    assert distributed.resolve_settings() is None
    info = distributed.initialize()
    assert info.mode == "single" and info.process_count == 1 and info.is_primary
    assert info.device_count == jax.device_count() == 8
    assert not distributed.is_initialized()


def test_settings_from_arguments_and_environment(clean_env, monkeypatch):
    s = distributed.resolve_settings("10.0.0.2:8476", 4, 3)
    assert s == distributed.CoordinatorSettings("10.0.0.2:8476", 4, 3)
    monkeypatch.setenv(distributed.ENV_ADDRESS, "127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    assert distributed.resolve_settings() == distributed.CoordinatorSettings("127.0.0.1:1234", 2, 1)
    # an explicit argument beats the environment
    assert distributed.resolve_settings(process_id=0).process_id == 0


def test_one_explicit_process_does_not_initialize(clean_env):
    info = distributed.initialize("127.0.0.1:1234", 1, 0)
    assert info.mode == "single" and not distributed.is_initialized()


@pytest.mark.parametrize(
    "args, message",
    [
        (("127.0.0.1:1234", None, None), "num_processes and process_id missing"),
        ((None, 2, None), "coordinator_address and process_id missing"),
        (("127.0.0.1", 2, 0), "must be HOST:PORT"),
        (("127.0.0.1:99999", 2, 0), "must be HOST:PORT"),
        (("127.0.0.1:1234", 0, 0), "num_processes=0 must be >= 1"),
        (("127.0.0.1:1234", 2, 2), "process_id=2 must be in [0, num_processes=2)"),
        (("127.0.0.1:1234", "two", 0), "num_processes='two' is not an integer"),
    ],
)
def test_bad_settings_are_clear_errors(clean_env, args, message):
    with pytest.raises(ValueError, match="^distributed: ") as e:
        distributed.resolve_settings(*args)
    assert message in str(e.value)


def test_bad_environment_names_the_variable(clean_env, monkeypatch):
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "x")
    with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID='x' is not an integer"):
        distributed.resolve_settings()


def test_bad_cpu_collectives(clean_env):
    with pytest.raises(ValueError, match="cpu_collectives='nccl'"):
        distributed.initialize(cpu_collectives="nccl")


def test_managed_cluster_detection(clean_env, monkeypatch):
    assert not distributed.on_managed_cluster()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.on_managed_cluster()


COLLECTIVE_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ode_lm import distributed
    info = distributed.initialize()
    mesh = jax.make_mesh((jax.device_count(),), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    # each process contributes only its own rows: a global array from host-local data
    local = np.arange(info.local_device_count, dtype=np.float32) + 100 * info.process_index
    x = jax.make_array_from_process_local_data(sharding, local, (jax.device_count(),))
    total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
    distributed.sync("done")
    # One write() call: gloo's own stdout lines must not split the RESULT line.
    sys.stdout.write("RESULT " + json.dumps({"mode": info.mode, "index": info.process_index,
                      "count": info.process_count, "local": info.local_device_count,
                      "global": info.device_count, "primary": distributed.is_primary(),
                      "total": float(total)}) + "\\n")
    distributed.exit_process(0)  # no CPU-client teardown: it can hang with gloo
""")


def test_two_processes_form_one_job():
    """2 processes x 4 CPU devices: one 8-device mesh, a reduction across both hosts."""
    results = spawn([sys.executable, "-c", COLLECTIVE_SCRIPT], 2, 4, free_port(), timeout=120)
    outs = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(result_line(r.stdout))
    expected = float(sum(v * v for v in [0, 1, 2, 3, 100, 101, 102, 103]))
    for i, o in enumerate(outs):
        assert o == {"mode": "explicit", "index": i, "count": 2, "local": 4, "global": 8,
                     "primary": i == 0, "total": expected}


# ------------------------------------------------------------------ trainer, multi-host

TRAIN_SCRIPT = textwrap.dedent("""
    import json, sys
    from ode_lm import distributed
    info = distributed.initialize()
    import jax, numpy as np
    from ode_lm.data.config import DataConfig
    from ode_lm.models.config import ModelConfig
    from ode_lm.partitioning import batch_sharding
    from ode_lm.training.checkpoint import CheckpointConfig
    from ode_lm.training.optim import OptimizerConfig
    from ode_lm.training.trainer import Trainer, TrainConfig

    model_dir, num_train_steps = sys.argv[1], int(sys.argv[2])
    B, T, V = 8, 16, 64

    def global_batch(step):
        # the same global batch whatever the process layout: every process builds it whole
        # and hands each of its devices that device's rows
        tokens = np.random.default_rng(step).integers(0, V, (B, T + 1), dtype=np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "segment_ids": np.ones((B, T), np.int32),
                "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                "loss_mask": np.ones((B, T), np.float32)}

    def to_global(batch, sharding):
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
                for k, v in batch.items()}

    def train_data(data_config, mesh, rules, start_step):
        sharding = batch_sharding(mesh, rules)
        def batches():
            step = start_step
            while True:
                yield to_global(global_batch(step), sharding)
                step += 1
        return None, batches()

    def eval_data(data_config, mesh, rules):
        return [to_global(global_batch(10_000), batch_sharding(mesh, rules))]

    trainer = Trainer(
        model_config=ModelConfig(vocab_size=V, d_model=32, num_heads=2, num_steps=2,
                                 time_embed_dim=4, sinusoidal_dim=4, max_seq_len=T),
        data_config=DataConfig(seq_len=T, global_batch_size=B),
        train_config=TrainConfig(model_dir=model_dir, num_train_steps=num_train_steps,
                                 log_every=1),
        # eps well above rounding noise, so Adam cannot blow reduction-order differences of
        # near-zero gradients up into full-size updates
        # constant learning rate (min_lr_ratio=1): the 5-step and 8-step runs share one curve
        optimizer_config=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0,
                                         eps=1e-3),
        checkpoint_config=CheckpointConfig(save_every=5, async_save=False),
        train_data=train_data, eval_data=eval_data)
    result = trainer.run()
    out = {"index": info.process_index, "count": info.process_count,
           "devices": info.device_count, "step": result.step, "eval": result.eval}
    sys.stdout.write("RESULT " + json.dumps(out) + "\\n")
    distributed.exit_process(0)  # no CPU-client teardown: it can hang with gloo
""")


def train_losses(model_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {}
    for r in rows:
        if "train/loss" in r:
            assert r["step"] not in losses, f"step {r['step']} logged twice (two writers?)"
            losses[r["step"]] = r["train/loss"]
    return losses


@pytest.mark.slow
def test_two_hosts_match_one_host_then_one_host_resumes(tmp_path):
    """2 processes x 4 CPU devices train 5 steps with the losses of 1 process x 8 devices;
    their checkpoint is restored by 1 process, which continues on the same loss curve."""
    script = tmp_path / "train_worker.py"
    script.write_text(TRAIN_SCRIPT)
    ref_dir, multi_dir = tmp_path / "one_host", tmp_path / "two_hosts"
    argv = [sys.executable, str(script)]
    # the reference (1 x 8, 8 steps) runs alongside the 2-host job (2 x 4, 5 steps)
    ref_env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for var in (distributed.ENV_ADDRESS, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        ref_env.pop(var, None)
    ref = subprocess.Popen([*argv, str(ref_dir), "8"], env=ref_env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        multi = spawn([*argv, str(multi_dir), "5"], 2, 4, free_port(), cwd=str(tmp_path),
                      timeout=900)
        ref_out, ref_err = ref.communicate(timeout=900)
    finally:
        if ref.poll() is None:
            ref.kill()
    assert ref.returncode == 0, ref_err[-3000:]
    for i, r in enumerate(multi):
        assert r.returncode == 0, r.stderr[-3000:]
        res = result_line(r.stdout)
        assert (res["index"], res["count"], res["devices"], res["step"]) == (i, 2, 8, 5)
    # only process 0 logs
    assert "step 5/5" in multi[0].stdout and "step 5/5" not in multi[1].stdout

    ref_losses, multi_losses = train_losses(ref_dir), train_losses(multi_dir)
    assert sorted(multi_losses) == [1, 2, 3, 4, 5]
    # 2 x 4 vs 1 x 8 devices: the same program, reductions split differently across processes;
    # losses ~5 (float32 ulp 4.8e-7), so 1e-5 is ~20 ulps after 5 steps
    for s in range(1, 6):
        assert abs(multi_losses[s] - ref_losses[s]) < 1e-5, (s, multi_losses[s], ref_losses[s])
    assert (multi_dir / "checkpoints").is_dir()

    # 1 process x 8 devices restores the 2-host checkpoint and continues to step 8
    resumed = subprocess.run([*argv, str(multi_dir), "8"], env=ref_env, text=True,
                             capture_output=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 5" in resumed.stdout
    assert result_line(resumed.stdout)["step"] == 8
    losses = train_losses(multi_dir)
    assert sorted(losses) == list(range(1, 9))
    for s in range(6, 9):
        assert abs(losses[s] - ref_losses[s]) < 1e-5, (s, losses[s], ref_losses[s])
    assert abs(result_line(resumed.stdout)["eval"]["eval/loss"]
               - result_line(ref_out)["eval"]["eval/loss"]) < 1e-5


# -------------------------------------------------------------- fine-tuning, multi-host

FINETUNE_GIN = """
finetune.model_dir = '{model_dir}'
finetune.num_train_steps = 3
finetune.data = @DataConfig()
FinetuneConfig.pretrained_dir = '{pretrained}'
FinetuneConfig.num_steps = 3
FinetuneConfig.method = 'full'
DataConfig.source = '{corpus}'
DataConfig.tokenizer = 'bytes'
DataConfig.data_dir = '{data_dir}'
""" + FINETUNE_DATA_GIN + """CheckpointConfig.async_save = False
MeshConfig.ici_parallelism = (-1, 1, 1)
"""


@pytest.mark.slow
def test_two_process_finetune_joins_one_job_and_its_checkpoint_evaluates_alike(tmp_path):
    """``python -m ode_lm.commands.finetune`` as a 2-process job (2 x 4 CPU devices) on data neither
    has prepared: process 0 prepares it behind the barrier, the two join one 8-device mesh
    and fine-tune a pretrained N=2 run at M=3; one process evaluating the saved checkpoint
    on its own 8 devices reproduces the job's final eval."""
    from data_helpers import small_texts, write_jsonl
    from export_helpers import make_run, tiny_config

    from ode_lm.commands.eval import evaluate_run

    pretrained, model_dir = tmp_path / "pretrained", tmp_path / "finetuned"
    make_run(str(pretrained), tiny_config("gpt2", vocab_size=384, num_steps=2))
    corpus = write_jsonl(tmp_path / "docs.jsonl", small_texts(60))
    gin_file = tmp_path / "ft.gin"
    gin_file.write_text(FINETUNE_GIN.format(model_dir=model_dir, pretrained=pretrained,
                                            corpus=corpus, data_dir=tmp_path / "data"))
    results = spawn([sys.executable, "-m", "ode_lm.commands.finetune", f"--gin_file={gin_file}"],
                    2, 4, free_port(), cwd=str(tmp_path), timeout=600)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    # the mesh spans both processes; only process 0 logs the run
    assert "mesh {'data': 8, 'fsdp': 1, 'tensor': 1}" in results[0].stdout, results[0].stdout
    assert "step 3/3" in results[0].stdout and "step 3/3" not in results[1].stdout
    assert (tmp_path / "data" / "manifest.json").exists()
    losses = train_losses(model_dir)  # one writer: each step logged once
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(v) for v in losses.values())
    saved = json.loads((model_dir / "finetune_result.json").read_text())
    assert saved["step"] == 3 and saved["fraction"] == 1.0
    assert json.loads((model_dir / "model_config.json").read_text())["num_steps"] == 3

    # 1 process x 8 devices restores the 2-process checkpoint: same eval, the model's own
    # M=3 named eval/loss in both; float32 losses ~5 (ulp 4.8e-7), 1e-5 is ~20 ulps of
    # reductions split differently over the processes
    local = evaluate_run(str(model_dir))
    assert local["step"] == 3
    assert set(local) - {"step"} == set(saved["eval"]), (local, saved["eval"])
    assert abs(local["eval/loss"] - saved["eval"]["eval/loss"]) < 1e-5
    assert local["eval/tokens"] == saved["eval"]["eval/tokens"]
