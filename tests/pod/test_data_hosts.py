"""The same global batches on any number of hosts, through the trainer: a run saved on 2
processes x 4 devices resumes on 1 process x 8 (and the reverse) with the per-step losses and
final parameters of an uninterrupted run (the prepared pipeline's data streams)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from multihost_helpers import free_port, result_line, spawn
from numerics import F32_EPS, f32_atol

from ode_lm import distributed
from ode_lm.data import DataConfig, ensure_prepared

WORKER = textwrap.dedent("""
    import json, sys
    from ode_lm import distributed
    info = distributed.initialize()
    import jax, numpy as np
    from ode_lm.data.config import DataConfig
    from ode_lm.models.config import ModelConfig
    from ode_lm.training.checkpoint import CheckpointConfig
    from ode_lm.training.optim import OptimizerConfig, path_name
    from ode_lm.training.trainer import MeshConfig, Trainer, TrainConfig

    model_dir, steps, data_dir, params_out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    trainer = Trainer(
        model_config=ModelConfig(vocab_size=384, d_model=32, num_heads=2, num_steps=2,
                                 time_embed_dim=4, sinusoidal_dim=4, max_seq_len=16),
        data_config=DataConfig(data_dir=data_dir, tokenizer="bytes", holdout_fraction=0.05,
                               seq_len=16, global_batch_size=8, packing="first_fit",
                               row_shuffle_window=64, eval_max_batches=1),
        train_config=TrainConfig(model_dir=model_dir, num_train_steps=steps, log_every=1),
        # eps above rounding noise and a constant rate: runs of 3 and 6 steps share one curve
        optimizer_config=OptimizerConfig(learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0,
                                         eps=1e-3),
        checkpoint_config=CheckpointConfig(save_every=3, async_save=False),
        mesh_config=MeshConfig(ici_parallelism=(-1, 1, 1)))  # data parallel: params replicated
    result = trainer.run()
    if info.process_index == 0:
        leaves = jax.tree_util.tree_flatten_with_path(trainer.state["params"])[0]
        np.savez(params_out, **{path_name(p): np.asarray(x.addressable_shards[0].data)
                                for p, x in leaves})
    sys.stdout.write("RESULT " + json.dumps({"step": result.step, "count": info.process_count,
                                             "eval": result.eval}) + "\\n")
    distributed.exit_process(0)
""")


def _losses(model_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _single_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for var in (distributed.ENV_ADDRESS, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(var, None)
    return env


def _run(argv, processes: int) -> list[subprocess.CompletedProcess]:
    if processes == 1:
        return [subprocess.run(argv, env=_single_env(), text=True, capture_output=True,
                               timeout=600)]
    return spawn(argv, processes, 8 // processes, free_port(), timeout=600)


def _ok(results, steps: int, processes: int) -> str:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        res = result_line(r.stdout)
        assert (res["step"], res["count"]) == (steps, processes)
        assert "no data iterator state" not in r.stdout + r.stderr
    return results[0].stdout


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_resume_on_another_host_count_continues_the_same_run(tmp_path, first, then):
    """``first`` processes train 3 steps and save; ``then`` processes resume to step 6: the
    losses of steps 1-6 and the final parameters are those of one uninterrupted 1 x 8 run."""
    data_dir = tmp_path / "data"
    ensure_prepared(DataConfig(data_dir=str(data_dir), tokenizer="bytes", holdout_fraction=0.05))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "moved"

    def argv(model_dir, steps, name):
        return [sys.executable, str(script), str(model_dir), str(steps), str(data_dir),
                str(tmp_path / f"{name}.npz")]

    ref = subprocess.Popen(argv(ref_dir, 6, "ref"), env=_single_env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _ok(_run(argv(run_dir, 3, "first"), first), 3, first)
        ref_out, ref_err = ref.communicate(timeout=600)
    finally:
        if ref.poll() is None:
            ref.kill()
    assert ref.returncode == 0, ref_err[-3000:]
    out = _ok(_run(argv(run_dir, 6, "then"), then), 6, then)
    assert "resumed from step 3" in out

    ref_losses, losses = _losses(ref_dir), _losses(run_dir)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 7))
    # the same batches, reductions split differently over processes: losses ~6 agree to
    # float32 rounding of reassociated sums (rtol 1e-5 is ~80 ulps)
    np.testing.assert_allclose([losses[s] for s in range(1, 7)],
                               [ref_losses[s] for s in range(1, 7)], rtol=1e-5, atol=0)
    want, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "then.npz")
    assert sorted(want) == sorted(got)
    for name in want:  # 6 Adam steps of lr 1e-2 from the same batches: ~1e3 ulps of drift max
        np.testing.assert_allclose(got[name], want[name], rtol=0,
                                   atol=f32_atol(want[name], 2048) + 64 * F32_EPS, err_msg=name)
    # a different batch order would move the params by ~lr per step, far above this bound
    assert result_line(out)["eval"]["eval/loss"] == pytest.approx(
        result_line(ref_out)["eval"]["eval/loss"], rel=1e-5)
