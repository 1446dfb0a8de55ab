"""The spectra statistics of the claims suite's ODE models before training (step 0).

    python tools/claims_init_spectra.py /tmp/ode_lm/claims/builtin [--json=FILE]

For each `ode-<recipe>-s<seed>-*` run under WORK_DIR/runs: the same model config, initialised
with nnx.Rngs(seed), and the statistics `qk-grows-*` and `ov-attractive-*` judge (Spearman's ρ
of the median |λ(QK)| with t, its last/first ratio, the OV share of Re λ > 0 near t = 1):
where the statistic of an untrained model lies, beside what training moved it to.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work_dir", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    from flax import nnx

    from ode_lm.analysis.model_access import model_spectra
    from ode_lm.claims.statistics import NEAR_OUTPUT, NUM_TIMES, spearman
    from ode_lm.models import build_model
    from ode_lm.training.run_dir import RunDir

    out = {}
    for run in sorted((args.work_dir / "runs").glob("ode-*-s*-*")):
        name, seed = run.name.rsplit("-", 2)[0], int(run.name.rsplit("-", 2)[1][1:])
        model = build_model(RunDir(str(run)).model_config(), nnx.Rngs(seed))
        spec = model_spectra(model, ts=np.linspace(0.0, 1.0, NUM_TIMES))
        depth = spec.normalized_depth
        qk = spec.magnitude_quantiles("qk", [0.5])[0]
        ov = spec.positive_real_fraction("ov")
        out[f"{name}-s{seed}"] = {"qk_rank_correlation": spearman(depth, qk),
                                  "qk_last_first_ratio": float(qk[-1] / qk[0]),
                                  "ov_positive_real_near_output":
                                      float(ov[depth >= NEAR_OUTPUT].mean())}
        print(name, seed, {k: round(v, 3) for k, v in out[f"{name}-s{seed}"].items()})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
