"""Parameter and FLOP accounting."""

import math

import pytest

from ode_lm.models import ModelConfig
from ode_lm.models.accounting import config_param_count, flops_per_token

GPT2_SMALL = ModelConfig(vocab_size=50257, d_model=768, num_heads=12, max_seq_len=1024,
                         num_layers=12, time_embed_dim=20, sinusoidal_dim=128)


def test_gpt2_small_baseline_has_exactly_124_439_808_parameters():
    counts = config_param_count(GPT2_SMALL.replace(architecture="sequential"))
    assert counts["total"] == 124_439_808
    assert counts["embeddings"] == 50257 * 768 + 1024 * 768
    assert counts["head"] == 0  # tied


def test_ode_breakdown_matches_the_hypernetwork_formula():
    cfg = ModelConfig(vocab_size=100, d_model=16, num_heads=2, max_seq_len=8,
                      time_embed_dim=3, sinusoidal_dim=4)
    c = config_param_count(cfg)
    d, f, e, h = 3, 9, 16, 64
    time_mlp = f * d + d + d * d + d
    dense = [(e, 3 * e), (e, e), (e, h), (h, e)]  # qkv, out, mlp in, mlp out (with biases)
    hyper = sum((d + 1) * i * o + d * o + time_mlp for i, o in dense)
    norms = 2 * (time_mlp + 2 * d * e) + 2 * e  # two temporal LayerNorms + final LayerNorm
    assert c["hypernetwork"] == hyper
    assert c["norms"] == norms
    assert c["time_mlps"] == 6 * time_mlp
    assert c["total"] == hyper + norms + 100 * 16 + 8 * 16
    auto = config_param_count(cfg.replace(time_dependent=False))
    assert auto["hypernetwork"] == sum(i * o + o for i, o in dense)  # one static block


def test_flops_ode_equals_discrete_plus_batch_independent_generation():
    ode, seq = flops_per_token(GPT2_SMALL, 12), flops_per_token(
        GPT2_SMALL.replace(architecture="sequential"))
    assert ode.block_forward == seq.block_forward and ode.evaluations == 12
    gen = ode.weight_generation_per_batch
    d = 20
    assert gen > 12 * 2 * d * 12 * 768 * 768  # at least the 2·D·In·Out of the 12·E² weights
    big = flops_per_token(GPT2_SMALL, 12, tokens_per_batch=1024 * 512)
    assert math.isclose(ode.forward - big.forward, gen / 1024 - gen / (1024 * 512))
    assert big.training == 3 * big.forward
    rk4 = flops_per_token(GPT2_SMALL, 12, solver="rk4")
    assert rk4.evaluations == 48 and rk4.weight_generation_per_batch == 4 * gen
    # 6N rule of thumb for the discrete model (N = non-embedding params) plus attention
    n = 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    assert math.isclose(seq.training, 6 * n + 3 * (12 * 2 * 768 * 1025 + 2 * 768 * 50257))


def test_flops_bad_arguments():
    with pytest.raises(ValueError, match="tokens_per_batch=0"):
        flops_per_token(GPT2_SMALL, tokens_per_batch=0)
