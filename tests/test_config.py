"""ModelConfig validation gives clear errors naming the field."""

import pytest

from ode_lm.models.config import ModelConfig


def test_defaults_and_derived():
    cfg = ModelConfig(d_model=128, num_heads=4, sinusoidal_dim=16)
    assert cfg.head_dim == 32
    assert cfg.hidden_dim == 512
    assert cfg.time_feature_dim == 33
    assert cfg.tied_embeddings


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"flavour": "bert"}, "flavour"),
        ({"architecture": "rnn"}, "architecture"),
        ({"solver": "dopri5"}, "solver"),
        ({"d_model": 65, "num_heads": 2}, "num_heads"),
        ({"num_steps": 0}, "num_steps"),
    ],
)
def test_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**kw)
