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


# Every config dataclass runs ode_lm.config_types.check_types first: gin hands over whatever the
# user typed (--gin.TRAIN_STEPS=1.5 trained "step 2/1.5" before).
def _configs():
    from ode_lm.data.config import DataConfig
    from ode_lm.finetune import FinetuneConfig
    from ode_lm.lora import LoRASpec
    from ode_lm.training.checkpoint import CheckpointConfig
    from ode_lm.training.objective import TERMS
    from ode_lm.training.optim import OptimizerConfig
    from ode_lm.training.step import StepConfig
    from ode_lm.training.trainer import MeshConfig, TrainConfig

    return {**{t.__name__: t for t in TERMS}, "ModelConfig": ModelConfig,
            "DataConfig": DataConfig, "FinetuneConfig": FinetuneConfig,
            "LoRASpec": LoRASpec, "CheckpointConfig": CheckpointConfig,
            "OptimizerConfig": OptimizerConfig, "StepConfig": StepConfig,
            "MeshConfig": MeshConfig, "TrainConfig": TrainConfig}


_REQUIRED = {"FinetuneConfig": {"pretrained_dir": "/x", "num_steps": 4},
             "TrainConfig": {"model_dir": "/x", "num_train_steps": 10}}


@pytest.mark.parametrize(
    "cls, field, value, expected",
    [
        ("TrainConfig", "num_train_steps", 1.5, "expected an int"),
        ("TrainConfig", "log_every", True, "expected an int"),
        ("ModelConfig", "num_steps", 6.0, "expected an int"),
        ("ModelConfig", "d_model", "64", "expected an int"),
        ("ModelConfig", "time_scale", "fast", "expected a float"),
        ("ModelConfig", "time_dependent", 1, "expected a bool"),
        ("ModelConfig", "mlp_dim", 2.5, "expected an int or None"),
        ("DataConfig", "global_batch_size", 8.0, "expected an int"),
        ("DataConfig", "tokenizer", 4096, "expected a str"),
        ("StepConfig", "microbatches", 2.0, "expected an int"),
        ("RandomSteps", "choices", (4, 5.5), "expected a tuple of ints"),
        ("Distillation", "share", "half", "expected a float"),
        ("MeshConfig", "ici_parallelism", (1, 2), "expected a tuple of 3"),
        ("CheckpointConfig", "save_every", 0.5, "expected an int"),
        ("OptimizerConfig", "learning_rate", "3e-4", "expected a float"),
        ("LoRASpec", "rank", 4.0, "expected an int"),
        ("FinetuneConfig", "lora_rank", 2.0, "expected an int"),
    ],
)
def test_mistyped_fields_name_the_field_and_the_type(cls, field, value, expected):
    config_cls = _configs()[cls]
    with pytest.raises(TypeError) as e:
        config_cls(**{**_REQUIRED.get(cls, {}), field: value})
    assert str(e.value).startswith(f"{cls}.{field}={value!r}: {expected}")


def test_ints_widen_to_floats_and_lists_become_tuples():
    from ode_lm.training.objective import RandomSteps
    from ode_lm.training.trainer import MeshConfig

    cfg = ModelConfig(time_scale=4, rtol=1)
    assert type(cfg.time_scale) is float and type(cfg.rtol) is float
    assert RandomSteps(choices=[4, 8]).choices == (4, 8)
    assert MeshConfig(ici_parallelism=[1, -1, 1]).ici_parallelism == (1, -1, 1)
    # every config's defaults pass their own check
    for name, config_cls in _configs().items():
        config_cls(**_REQUIRED.get(name, {}))


def test_eval_solves_are_checked_when_the_config_is_built():
    """A mistyped eval setting stops before training, naming the field and the value."""
    from ode_lm.training.trainer import TrainConfig

    with pytest.raises(ValueError, match=r"^TrainConfig.eval_solves='rk4:step=8': expected"):
        TrainConfig(model_dir="/x", num_train_steps=1, eval_solves=("rk4:step=8",))
    cfg = TrainConfig(model_dir="/x", num_train_steps=1, eval_solves=["adaptive:rtol=1e-3"])
    assert cfg.eval_solves == ("adaptive:rtol=1e-3",)
