"""The W(t) smoothness figure of the depth analysis. The train step's depth settings (random
N, kinetic energy, the other terms) are in tests/train/test_objective.py; the model's
continuous depth in tests/model/test_continuous_depth.py; ode-lm eval and depth-report in
tests/cli/test_eval_depth_cli.py."""

from __future__ import annotations

import model_helpers
from flax import nnx
from model_helpers import LIVELY

from ode_lm.models import build_model


def test_smoothness_separates_paper_and_smooth_time_features():
    """At init, the paper's sin(1000·t·ω) features move W(t) orders of magnitude faster."""
    from ode_lm.analysis.depth import weight_smoothness

    rates = {}
    for scale, period in ((1000.0, 10000.0), (4.0, 100.0)):
        config = model_helpers.tiny_config(LIVELY, max_seq_len=16, time_scale=scale,
                                           time_max_period=period)
        model = build_model(config, nnx.Rngs(0))
        rates[scale] = weight_smoothness(model.weights_at, num_times=33)["max"]
    assert rates[1000.0] > 30 * rates[4.0], rates
