"""What one checkpoint save costs, apart from training: wall time and the process's user and
system CPU time (all threads, including orbax's and tensorstore's) per save of a bench
config's full train state, for the trainer's ``Checkpointer`` and a few orbax variants,
against a bare host copy + raw file write of the same bytes (the floor any writer pays).

    python tools/bench_checkpoint.py --config cpu_small --json ckpt.json

On a host whose cores the train step already keeps busy, this CPU time is what an async
save takes away from training (``ode-lm bench --sections checkpoint`` measures that).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ode_lm import cli

VARIANTS = ("trainer", "on_loop", "sync_dirs", "synchronous", "keep_all", "no_ocdbt", "zstd",
            "snapshot", "flat", "tmpfs", "raw")
DESCRIPTIONS = {
    "trainer": "trainer Checkpointer: orbax's save call on a worker thread from an on-device "
               "copy; async (directories too), OCDBT, no compression, keep 2",
    "on_loop": "same, orbax's save call on the loop (off_loop=False)",
    "sync_dirs": "on_loop, step directories made on the loop (the older path)",
    "synchronous": "same, enable_async_checkpointing=False",
    "keep_all": "same, max_to_keep=None (no deletions)",
    "no_ocdbt": "same handler with use_ocdbt=False",
    "zstd": "same handler with use_compression=True (orbax default)",
    "snapshot": "on_loop, saving a jitted on-device copy (the step may donate at once)",
    "flat": "fewer, larger arrays: the float32 leaves as one vector (+ 6 int leaves)",
    "tmpfs": "trainer into /dev/shm (RAM: the local tier of multi-tier checkpointing)",
    "raw": "bare host copy + raw file write (lower bound)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu_small", help="an ode-lm bench config")
    p.add_argument("--saves", type=int, default=6, help="timed saves per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all variants (median)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--dir", default=None, help="where the saves go (a fresh temp dir inside)")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown[0]!r} (choose from {', '.join(VARIANTS)})")
    if args.saves < 1 or args.rounds < 1:
        p.error(f"--saves={args.saves} / --rounds={args.rounds}: must be >= 1")
    if "tmpfs" in args.variants and not os.path.isdir("/dev/shm"):
        p.error("--variants: tmpfs needs /dev/shm, which this host lacks")
    if args.dir and not os.path.isdir(args.dir):
        p.error(f"--dir={args.dir!r} is not a directory")
    return args


Saver = tuple[Callable[[int, Any], None], Callable[[], None], Callable[[], None]]


def _orbax_saver(directory: str, variant: str) -> Saver:
    """(save(step, state): returns when the caller may go on, wait, close) of a variant."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from ode_lm.training import checkpoint as ckpt_lib

    if variant in ("trainer", "on_loop", "sync_dirs", "synchronous", "keep_all", "snapshot",
                   "tmpfs"):
        config = ckpt_lib.CheckpointConfig(
            save_every=1, max_to_keep=None if variant == "keep_all" else 2,
            async_save=variant != "synchronous",
            off_loop=variant not in ("on_loop", "sync_dirs", "snapshot"))
        ckpt = ckpt_lib.Checkpointer(directory, config, async_directories=variant != "sync_dirs")
        copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))

        def save(step, state):
            ckpt.save(step, copy(state) if variant == "snapshot" else state, force=True)

        return save, ckpt.wait, ckpt.close
    handler = ocp.PyTreeCheckpointHandler(
        use_compression=variant == "zstd", use_ocdbt=variant != "no_ocdbt")
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        item_handlers={"state": handler})

    @jax.jit
    def flatten(tree):
        leaves = jax.tree.leaves(tree)
        return {"float32": jnp.concatenate([x.reshape(-1) for x in leaves
                                            if x.dtype == jnp.float32]),
                "other": [x for x in leaves if x.dtype != jnp.float32]}

    def save(step, state):
        tree = flatten(state) if variant == "flat" else state
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)),
                     force=True)

    return save, manager.wait_until_finished, manager.close


def _raw_saver(directory: str) -> Saver:
    """Copy every leaf to host memory and write its bytes to one file per leaf."""
    import jax
    import numpy as np

    def save(step, state):
        path = os.path.join(directory, str(step))
        os.makedirs(path)
        for i, leaf in enumerate(jax.tree.leaves(state)):
            host = np.array(leaf, copy=True)
            with open(os.path.join(path, f"{i}.bin"), "wb") as f:
                f.write(memoryview(host).cast("B"))
        old = os.path.join(directory, str(step - 2))  # keep 2, like the trainer
        if os.path.isdir(old):
            shutil.rmtree(old)

    return save, lambda: None, lambda: None


def measure(state: Any, variant: str, saves: int, root: str | None) -> dict[str, float]:
    """Per save (median over ``saves`` after one untimed save): blocked (the save call
    alone: what holds a train loop), wall (until written), user and sys CPU seconds."""
    if variant == "tmpfs":
        root = "/dev/shm"
    directory = tempfile.mkdtemp(prefix=f"bench_ckpt_{variant}_", dir=root)
    save, wait, close = (_raw_saver(directory) if variant == "raw"
                         else _orbax_saver(directory, variant))
    rows = []
    try:
        save(0, state)
        wait()
        for step in range(1, saves + 1):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            save(step, state)
            t_blocked = time.perf_counter()
            wait()
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            rows.append((t_blocked - t0, t1 - t0, r1.ru_utime - r0.ru_utime,
                         r1.ru_stime - r0.ru_stime))
    finally:
        close()
        shutil.rmtree(directory, ignore_errors=True)
    blocked, wall, user, system = (statistics.median(r[i] for r in rows) for i in range(4))
    return {"blocked_s": blocked, "wall_s": wall, "user_s": user, "sys_s": system,
            "cpu_s": user + system}


def build_state(config_name: str):
    """The bench config's initialised train state (params + AdamW moments) on this host."""
    import jax

    from ode_lm.bench import train_bench as bu
    from ode_lm.training import state as state_lib

    model_config = bu.get_config(config_name).model_config("ode")
    spec, _ = bu.bench_state_spec(model_config, bu.make_mesh(jax.devices()))
    return state_lib.init_state(spec, 0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    state = build_state(args.config)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"config {args.config}: train state {nbytes / 2**20:.1f} MiB in "
          f"{len(jax.tree.leaves(state))} arrays; {args.rounds} rounds x {args.saves} saves; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    per_round: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):  # round-robin, so drift of the host hits all variants alike
        for variant in args.variants:
            per_round[variant].append(measure(state, variant, args.saves, args.dir))
    results = {v: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for v, rows in per_round.items()}
    print(f"\n{'variant':<12} {'blocked':>8} {'wall ms':>8} {'user ms':>8} {'sys ms':>8} "
          f"{'CPU ms':>8}  what")
    for v, r in results.items():
        print(f"{v:<12} {r['blocked_s'] * 1e3:8.0f} {r['wall_s'] * 1e3:8.0f} "
              f"{r['user_s'] * 1e3:8.0f} {r['sys_s'] * 1e3:8.0f} {r['cpu_s'] * 1e3:8.0f}  "
              f"{DESCRIPTIONS[v]}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "state_bytes": nbytes, "per_save": results,
                       "rounds": per_round}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
