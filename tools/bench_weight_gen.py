"""Benchmark weight generation inside the scan vs precomputed, against the parallel baseline.

Prints, for the loss+gradient of one batch: XLA's compiled memory figures (temp = peak
scratch beyond arguments/outputs) and the measured step time. Example:

    python tools/bench_weight_gen.py --d_model 256 --steps 12 --batch 8 --seq 256
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from ode_lm import cli
from ode_lm.models import ModelConfig, build_model
from ode_lm.models.config import REMAT


def _loss(model, x):
    logits = model(x[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1).mean()


def measure(config: ModelConfig, batch: int, seq: int, repeats: int) -> dict[str, float]:
    model = build_model(config, nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def grad_fn(state, x):
        return jax.grad(lambda s: _loss(nnx.merge(graphdef, s), x))(state)

    x = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, config.vocab_size)
    compiled = jax.jit(grad_fn).lower(state, x).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(state, x))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(compiled(state, x))
    step = (time.perf_counter() - start) / repeats
    return {"temp_MiB": mem.temp_size_in_bytes / 2**20,
            "args_MiB": mem.argument_size_in_bytes / 2**20, "step_s": step}


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="ODE steps N = baseline layers")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--time_embed_dim", type=int, default=20)
    p.add_argument("--remat", default="none", choices=REMAT)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.d_model, args.steps, args.batch, args.seq, args.repeats) < 1:
        raise SystemExit("bench_weight_gen: --d_model/--steps/--batch/--seq/--repeats must be >= 1")
    base = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, num_heads=args.heads,
                       max_seq_len=args.seq, num_steps=args.steps, num_layers=args.steps,
                       time_embed_dim=args.time_embed_dim, sinusoidal_dim=64,
                       remat=args.remat)
    variants = {
        "parallel baseline": base.replace(architecture="parallel"),
        "ode in_scan": base.replace(weight_generation="in_scan"),
        "ode precompute": base.replace(weight_generation="precompute"),
    }
    one_layer = 4 * (args.d_model**2) * 3 * 4 / 2**20  # qkv+out+mlp kernels, fp32 MiB
    print(f"d_model={args.d_model} N={args.steps} batch={args.batch} seq={args.seq} "
          f"remat={args.remat}; one layer of generated kernels = {one_layer:.1f} MiB")
    results = {}
    for name, cfg in variants.items():
        r = measure(cfg, args.batch, args.seq, args.repeats)
        results[name] = r
        print(f"{name:18s} temp {r['temp_MiB']:8.1f} MiB  args {r['args_MiB']:7.1f} MiB  "
              f"step {r['step_s'] * 1e3:8.1f} ms")
    for name in ("ode in_scan", "ode precompute"):
        ratio = results[name]["step_s"] / results["parallel baseline"]["step_s"]
        print(f"step time {name} / parallel baseline = {ratio:.3f}")


if __name__ == "__main__":
    main()
