"""Speed of the analyses on the cpu_small model: ``python -m ode_lm.commands.analysis_speed``.

It times Lyapunov exponents of a 128-token text and spectra at 101 t values (docs/analysis.md
records measured times). Times are wall clock and include compilation (what a CLI user
waits for), and CPU time of this process (what it costs when the cores are not shared); a
randomly initialised model costs exactly what a trained one does.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main(argv: list[str] | None = None,
         prog: str = "python -m ode_lm.commands.analysis_speed") -> int:
    from ode_lm.models.config import SOLVERS

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--num_tokens", type=int, default=128)
    p.add_argument("--num_times", type=int, default=101)
    p.add_argument("--solver", default="euler", choices=SOLVERS)
    args = p.parse_args(argv)

    from flax import nnx

    from ode_lm.analysis import model_access
    from ode_lm.bench.presets import get_config
    from ode_lm.models import build_model

    config = get_config("cpu_small").model_config("ode")  # configs/models/cpu_small.gin
    model = build_model(config, nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, args.num_tokens)
    print(f"cpu_small: width {config.d_model}, {config.num_heads} heads, {config.num_steps} "
          f"steps, D={config.time_embed_dim}, S={config.sinusoidal_dim}, vocab "
          f"{config.vocab_size}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")

    start, cpu = time.perf_counter(), time.process_time()
    spec = model_access.model_spectra(model, np.linspace(0, 1, args.num_times))
    print(f"spectra: {args.num_times} t values, {spec.qk.size + spec.ov.size + spec.mlp.size} "
          f"eigenvalues: {time.perf_counter() - start:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU")

    start, cpu = time.perf_counter(), time.process_time()
    res = model_access.model_lyapunov(model, tokens, solver=args.solver)
    print(f"lyapunov: {args.num_tokens} tokens x {res.exponents.shape[1]} exponents, "
          f"{args.solver} x {res.num_steps} steps: {time.perf_counter() - start:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU")
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes share the cores: "
          "wall time on a busy machine exceeds CPU time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
