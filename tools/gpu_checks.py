"""The checks of tools/gpu_session.sh, one subcommand each; every one writes one JSON.

    python tools/gpu_checks.py smoke --out smoke.json
    python tools/gpu_checks.py attention --out attention.json [--small]
    python tools/gpu_checks.py parity --out parity.json [--small]
    python tools/gpu_checks.py determinism --out det.json --workdir W [--small]
    python tools/gpu_checks.py resume --out resume.json --workdir W --reference W/a [--small]
    python tools/gpu_checks.py profile --out profile.json --trace_dir D [--small]
    python tools/gpu_checks.py run-figures --out run.json --model_dir D
    python tools/gpu_checks.py summary --steps_dir S --out summary.json

Why a module and not heredocs: each check is tested on CPU (``--small``: micro sizes) by
tests/pod/test_gpu_session.py, so the script an accelerator host runs cannot rot. Tolerances
follow from the dtype the arithmetic runs in (float32 checks run at 'highest' matmul
precision, so a GPU does not round to TF32).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8}
# Relative-norm error of one attention against float64: float32 ≈ 170 u (sums over T keys,
# exp), bfloat16 ≈ 2.6 u (inputs, probabilities and output each rounded once; METHOD.md:
# bf16 operands land between 1e-3 and 1e-2).
ATTENTION_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# A train loss after a few AdamW steps of the same model on two backends: the first update
# is ~lr·sign(g), so a rounding-level gradient difference moves a few weights by lr; still
# far below what a wrong kernel does (losses differ by O(1)).
LOSS_TOL = {"float32": 1e-4, "bfloat16": 1e-2}


def write(path: str, result: dict) -> dict:
    Path(path).write_text(json.dumps(result, indent=2, default=float))
    print(json.dumps(result, default=float)[:2000], flush=True)
    return result


def rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def accelerator():
    """The device a GPU session measures on: the first GPU, else (dry run) the first CPU."""
    import jax

    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return jax.devices("cpu")[0]


def bench_config(small: bool):
    """``tiny`` (the bench preset), or for the dry run a micro model of the same recipe."""
    from ode_lm.bench import train_bench as tb

    cfg = tb.get_config("tiny")
    if small:
        cfg = tb.dataclasses.replace(cfg, d_model=32, num_heads=2, num_steps=2, seq_len=32,
                                     batch_size=4, vocab_size=256)
    return cfg


# ------------------------------------------------------------------ smoke: import + compile


def smoke(args) -> dict:
    """Import everything ode-lm imports at run time and compile one train step: what must
    hold before the pins in pyproject.toml can be widened to the machine's versions."""
    import importlib.metadata as md

    t0 = time.perf_counter()
    import jax

    from ode_lm.bench import train_bench as tb
    from ode_lm.data import pipeline  # noqa: F401 - grain, array_record
    from ode_lm.training import metrics, trainer  # noqa: F401 - clu, tensorboard, orbax

    versions = {}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint",
                 "tensorstore", "grain", "array-record", "gin-config", "clu", "etils",
                 "numpy", "ml-dtypes", "protobuf", "tensorboard"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    cfg = bench_config(args.small)
    dev = accelerator()
    bench = tb.TrainBench("smoke", cfg, cfg.model_config("ode"), tb.make_mesh([dev]),
                          count_flops=False)
    bench.step()
    return write(args.out, {
        "ok": math.isfinite(bench.last_loss), "loss": bench.last_loss,
        "compile_s": bench.compile_s, "import_and_compile_s": time.perf_counter() - t0,
        "python": sys.version.split()[0], "versions": versions,
        "devices": [str(d) for d in jax.devices()], "device_kind": dev.device_kind,
    })


# ------------------------------------------------------------------ attention


def _packed_segments(b: int, t: int, rng):
    """[B, T] int32: 1..k documents per row at random cut points, a padded tail (0)."""
    import numpy as np

    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - 1), size=3, replace=False))
        end = t - int(rng.integers(0, t // 8))
        for s, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, end], strict=True)):
            seg[i, lo:hi] = s + 1
    return seg


def _reference_attention(q, k, v, mask):
    """float64 numpy softmax(q kᵀ/√h) v; fully masked rows (padding) give 0."""
    import numpy as np

    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    m = np.max(logits, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bnts,bsnh->btnh", p, v)


def _impls():
    """name -> attention(q, k, v, mask): the repo's two forms and jax's explicit cuDNN."""
    import jax

    from ode_lm.models import common

    return {
        "xla": lambda q, k, v, m: common.attention(q, k, v, m, impl="xla"),
        # ModelConfig.attention_impl='cudnn' (and 'auto' on GPU): jax.nn.dot_product_attention
        # with implementation=None, which jax documents as falling back to its XLA form
        "cudnn_repo": lambda q, k, v, m: common.attention(q, k, v, m, impl="cudnn"),
        # cuDNN's fused kernel asked for by name (bf16/fp16 only; the mask becomes a bias)
        "cudnn_explicit": lambda q, k, v, m: jax.nn.dot_product_attention(
            q, k, v, mask=m, implementation="cudnn"),
    }


def attention(args) -> dict:
    """Each form against a float64 reference (forward), gradients against the xla form, on
    packed segments with padding; then forward+backward time of each at the bench's size."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ode_lm.models import common

    dev = accelerator()
    rng = np.random.default_rng(0)
    b, t, n, h = (2, 32, 2, 16) if args.small else (2, 512, 8, 64)
    seg = _packed_segments(b, t, rng)
    mask_np = np.asarray(common.attention_mask(jnp.asarray(seg)))
    # padded queries attend to nothing in the reference; compare only the real tokens
    rows = (seg > 0)[:, :, None, None]
    out: dict = {"shape_btnh": [b, t, n, h], "device": str(dev), "checks": {}}
    for dtype in ("float32", "bfloat16"):
        q, k, v = (rng.standard_normal((b, t, n, h)).astype(np.float32) for _ in range(3))
        dt = jnp.dtype(dtype)
        # the reference sees the same (rounded) inputs the device sees
        qd, kd, vd = (np.asarray(jnp.asarray(x, dt), np.float32) for x in (q, k, v))
        ref = _reference_attention(qd, kd, vd, mask_np) * rows
        tol = ATTENTION_TOL[dtype]
        put = lambda x, dt=dt: jax.device_put(jnp.asarray(x, dt), dev)  # noqa: E731
        args_dev = (put(q), put(k), put(v), jax.device_put(jnp.asarray(mask_np), dev))
        grads = {}
        for name, fn in _impls().items():
            key = f"{name}/{dtype}"
            try:
                with jax.default_matmul_precision("highest"):
                    y = jax.jit(fn)(*args_dev)
                    loss = lambda q, k, v, m, fn=fn: jnp.sum(  # noqa: E731
                        (fn(q, k, v, m).astype(jnp.float32) * jnp.asarray(rows)) ** 2)
                    grads[name] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args_dev)
                err = rel_err(np.asarray(y, np.float32) * rows, ref)
                out["checks"][key] = {"rel_err_vs_float64": err, "tol": tol,
                                      "finite": bool(np.isfinite(np.asarray(y, np.float32)).all()),
                                      "ok": err <= tol}
            except Exception as e:  # noqa: BLE001 - an unsupported form is a finding
                out["checks"][key] = {"ok": None, "error": f"{type(e).__name__}: {e}"[:400]}
        for name, g in grads.items():
            if name != "xla" and "xla" in grads:
                err = max(rel_err(np.asarray(a, np.float32), np.asarray(r, np.float32))
                          for a, r in zip(g, grads["xla"], strict=True))
                out["checks"][f"{name}/{dtype}"]["grad_rel_err_vs_xla"] = err
                out["checks"][f"{name}/{dtype}"]["grad_ok"] = err <= 4 * tol
    out["timing"] = _attention_timing(args, dev)
    results = [c["ok"] for c in out["checks"].values()]
    out["ok"] = all(r is not False for r in results) and any(results)
    return write(args.out, out)


def _attention_timing(args, dev) -> dict:
    """Median ms of a jitted forward+backward per form, bf16, at gpu_large's attention shape
    (B 32, T 1024, 16 heads of 64) with 4 documents a row; ``--small``: a toy shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ode_lm.models import common

    b, t, n, h = (2, 64, 2, 16) if args.small else (32, 1024, 16, 64)
    reps = 3 if args.small else 20
    rng = np.random.default_rng(1)
    seg = jnp.asarray(_packed_segments(b, t, rng))
    mask = jax.device_put(common.attention_mask(seg), dev)
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16), dev)
               for _ in range(3))
    timing = {"shape_btnh": [b, t, n, h], "dtype": "bfloat16", "reps": reps}
    for name, fn in _impls().items():
        try:
            step = jax.jit(jax.grad(lambda q, k, v, m, fn=fn: jnp.sum(
                fn(q, k, v, m).astype(jnp.float32)), argnums=(0, 1, 2)))
            jax.block_until_ready(step(q, k, v, mask))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(step(q, k, v, mask))
                times.append(time.perf_counter() - t0)
            timing[name] = {"fwd_bwd_ms_median": 1e3 * float(np.median(times))}
        except Exception as e:  # noqa: BLE001
            timing[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return timing


# ------------------------------------------------------------------ accelerator vs CPU


def parity(args) -> dict:
    """A few train steps of ``tiny`` (same init, same batch) on the accelerator and on the
    host CPU: float32 at 'highest' matmul precision, and bfloat16."""
    import jax

    from ode_lm.bench import train_bench as tb

    cfg = bench_config(args.small)
    steps = args.steps
    dev, cpu = accelerator(), jax.devices("cpu")[-1]
    out: dict = {"config": cfg.name, "steps": steps, "device": str(dev), "reference": str(cpu),
                 "checks": {}}
    for dtype in ("float32", "bfloat16"):
        losses = {}
        for label, d in (("device", dev), ("cpu", cpu)):
            with jax.default_matmul_precision("highest"):
                bench = tb.TrainBench(f"{label}-{dtype}", cfg, cfg.model_config("ode", dtype=dtype),
                                      tb.make_mesh([d]), count_flops=False)
                losses[label] = []
                for _ in range(steps):
                    bench.step()
                    losses[label].append(bench.last_loss)
        tol = LOSS_TOL[dtype]
        errs = [abs(a - b) / abs(b) for a, b in zip(losses["device"], losses["cpu"], strict=True)]
        out["checks"][dtype] = {"losses_device": losses["device"], "losses_cpu": losses["cpu"],
                                "max_rel_diff": max(errs), "tol": tol, "ok": max(errs) <= tol}
    out["ok"] = all(c["ok"] for c in out["checks"].values())
    return write(args.out, out)


# ------------------------------------------------------------------ short trainer runs


def synthetic_train_data(seq_len: int, batch: int, vocab: int, delay_s: float = 0.0):
    """The trainer's ``train_data`` hook: a step's batch depends only on the step (exact on
    resume), two packed documents a row; ``delay_s`` slows the loop (the kill needs time)."""

    def train_data(data_config, mesh, rules, start_step):
        import jax
        import numpy as np

        from ode_lm.partitioning import batch_sharding

        sharding = batch_sharding(mesh, rules)

        def batches():
            step = start_step
            while True:
                tok = np.random.default_rng(step).integers(0, vocab, (batch, seq_len + 1),
                                                           dtype=np.int32)
                half = seq_len // 2
                seg = np.where(np.arange(seq_len) < half, 1, 2).astype(np.int32)
                pos = np.where(np.arange(seq_len) < half, np.arange(seq_len),
                               np.arange(seq_len) - half).astype(np.int32)
                host = {"inputs": tok[:, :-1], "targets": tok[:, 1:],
                        "segment_ids": np.broadcast_to(seg, (batch, seq_len)),
                        "positions": np.broadcast_to(pos, (batch, seq_len)),
                        "loss_mask": np.ones((batch, seq_len), np.float32)}
                if delay_s:
                    time.sleep(delay_s)
                yield {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
                       for k, v in host.items()}
                step += 1

        return None, batches()

    return train_data


def train(args) -> dict:
    """One short trainer run (checkpoint every step, log every step) on synthetic data."""
    from ode_lm.data.config import DataConfig
    from ode_lm.models.config import ModelConfig
    from ode_lm.training.checkpoint import CheckpointConfig
    from ode_lm.training.optim import OptimizerConfig
    from ode_lm.training.trainer import TrainConfig, Trainer

    t, b, v = (16, 4, 64) if args.small else (128, 8, 2048)
    model = (ModelConfig(vocab_size=v, d_model=32, num_heads=2, num_steps=2, time_embed_dim=4,
                         sinusoidal_dim=4, max_seq_len=t) if args.small else
             ModelConfig(vocab_size=v, d_model=128, num_heads=4, num_steps=4, max_seq_len=t))
    result = Trainer(
        model_config=model, data_config=DataConfig(seq_len=t, global_batch_size=b),
        train_config=TrainConfig(model_dir=args.model_dir, num_train_steps=args.steps,
                                 log_every=1),
        optimizer_config=OptimizerConfig(learning_rate=1e-2, warmup_steps=2),
        checkpoint_config=CheckpointConfig(save_every=1, max_to_keep=3),
        train_data=synthetic_train_data(t, b, v, args.delay),
        eval_data=lambda d, mesh, rules: [  # one held-out batch (its own seed)
            next(synthetic_train_data(t, b, v)(d, mesh, rules, 10_000)[1])]).run()
    return {"step": result.step, "last_loss": result.last_loss}


def losses(model_dir: Path) -> dict[int, float]:
    """Per-step train loss of the run's metrics; a step re-run after a kill overwrites its row."""
    from ode_lm.training.run_dir import RunDir

    rows = [json.loads(x) for x in Path(RunDir(str(model_dir)).metrics).read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _train_cmd(args, model_dir: Path, delay: float = 0.0) -> list[str]:
    return [sys.executable, __file__, "train", "--model_dir", str(model_dir),
            "--steps", str(args.steps), "--delay", str(delay), *(["--small"] if args.small else [])]


def _run(cmd: list[str], log: Path) -> int:
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def determinism(args) -> dict:
    """Two identical runs, side by side (XLA_FLAGS from the caller: deterministic GPU ops),
    must give bitwise-equal losses at every step."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for name in ("a", "b"):
        log = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((name, log, subprocess.Popen(_train_cmd(args, work / name), stdout=log,
                                                  stderr=subprocess.STDOUT)))
    rcs = {}
    for name, log, p in procs:
        rcs[name] = p.wait()
        log.close()
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "steps": args.steps, "rc": rcs}
    if any(rcs.values()):
        out["ok"] = False
        return write(args.out, out)
    la, lb = losses(work / "a"), losses(work / "b")
    out.update(losses_a=la, losses_b=lb, equal=la == lb,
               max_abs_diff=max(abs(la[k] - lb[k]) for k in la))
    out["ok"] = la == lb and sorted(la) == list(range(1, args.steps + 1))
    return write(args.out, out)


def resume(args) -> dict:
    """SIGKILL a run once a few checkpoints exist, relaunch it: every step's loss and the
    final parameters must equal the uninterrupted reference run's bitwise."""
    work = Path(args.workdir)
    killed = work / "killed"
    kill_after = max(2, args.steps // 3)
    log = open(work / "killed.log", "w")  # noqa: SIM115
    p = subprocess.Popen(_train_cmd(args, killed, delay=args.delay or 0.2), stdout=log,
                         stderr=subprocess.STDOUT)
    from ode_lm.training.run_dir import RunDir

    ckpts = Path(RunDir(str(killed)).checkpoints)
    while p.poll() is None:
        done = [int(x.name) for x in ckpts.iterdir() if x.name.isdigit()] if ckpts.exists() else []
        if max(done, default=0) >= kill_after:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    rc_killed = p.wait()
    log.close()
    saved = sorted(int(x.name) for x in ckpts.iterdir() if x.name.isdigit())
    rc = _run(_train_cmd(args, killed), work / "relaunch.log")
    out = {"kill_after_checkpoint": kill_after, "rc_killed": rc_killed, "saved_at_kill": saved,
           "rc_relaunch": rc, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if rc or rc_killed != -signal.SIGKILL:
        out["ok"] = False
        return write(args.out, out)
    ref, got = losses(Path(args.reference)), losses(killed)
    relaunch_log = (work / "relaunch.log").read_text()
    out.update(resumed="resumed from step" in relaunch_log, losses_equal=ref == got,
               params_equal=_params_equal(Path(args.reference), killed))
    out["ok"] = out["resumed"] and out["losses_equal"] and out["params_equal"]
    return write(args.out, out)


def _params_equal(a: Path, b: Path) -> bool:
    from flax import nnx

    from ode_lm.training.checkpoint import tree_equal
    from ode_lm.training.saved_run import load_model

    (ma, ra), (mb, rb) = load_model(str(a)), load_model(str(b))
    return ra.step == rb.step and bool(tree_equal(nnx.state(ma, nnx.Param),
                                                  nnx.state(mb, nnx.Param)))


# ------------------------------------------------------------------ profile


def profile(args) -> dict:
    """A jax.profiler trace of a few ODE train steps of gpu_large (``--small``: tiny), and
    the step's time split: the share of the weight generation (named scope)."""
    import jax

    from ode_lm.bench import train_bench as tb

    cfg = tb.get_config("tiny" if args.small else "gpu_large")
    bench = tb.TrainBench("profile", cfg, cfg.model_config("ode"), tb.make_mesh([accelerator()]),
                          count_flops=False)
    for _ in range(2):
        bench.step()
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(args.trace_dir):
        times = [bench.step()[0] for _ in range(args.steps)]
    return write(args.out, {"config": cfg.name, "steps": args.steps, "trace_dir": args.trace_dir,
                            "step_s": times, "ok": True})


COMMANDS = {"smoke": smoke, "attention": attention, "parity": parity, "train": train,
            "determinism": determinism, "resume": resume, "profile": profile}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_checks", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--out", default=None, help="the JSON this check writes")
    p.add_argument("--small", action="store_true", help="micro sizes (the CPU dry run)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--reference", default=None, help="resume: the uninterrupted run's dir")
    p.add_argument("--delay", type=float, default=0.0, help="train: seconds per batch")
    p.add_argument("--trace_dir", default=None)
    args = p.parse_args(argv)
    result = COMMANDS[args.command](args)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
