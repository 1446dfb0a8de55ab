"""Gin flag parsing (t5x style) and layered configs: later files/bindings win, typos fail."""

import gin
import pytest

from ode_lm import gin_setup


def test_parse_flags_collects_files_bindings_and_search_paths():
    flags = gin_setup.parse_flags([
        "--gin_file=a.gin", "--gin_file", "b.gin", "--gin.MODEL_DIR=/tmp/x",
        "--gin.TrainConfig.log_every=5", "--gin_bindings=D_MODEL = 64",
        "--gin.MeshConfig.ici_parallelism=(2, -1, 1)", "--gin_search_paths=/p,/q", "--other",
    ])
    assert flags.files == ["a.gin", "b.gin"]
    assert flags.bindings == ["MODEL_DIR = '/tmp/x'", "TrainConfig.log_every = 5",
                              "D_MODEL = 64", "MeshConfig.ici_parallelism = (2, -1, 1)"]
    assert flags.search_paths == ["/p", "/q"] and flags.rest == ["--other"]
    with pytest.raises(ValueError, match="expected --gin.NAME=VALUE"):
        gin_setup.parse_flags(["--gin.D_MODEL"])


def test_layered_configs_later_wins_and_macros_scale_the_model(tmp_path):
    override = tmp_path / "override.gin"
    override.write_text("D_MODEL = 256\nODE_STEPS = 8\n")
    flags = gin_setup.parse_flags(["--gin_file=runs/demo.gin", f"--gin_file={override}",
                                   "--gin.ODE_STEPS=6", "--gin.MODEL_DIR=/tmp/somewhere"])
    gin_setup.parse_gin(flags)
    model = gin_setup.GinModelConfig()
    assert (model.d_model, model.num_steps, model.num_heads) == (256, 6, 4)
    assert gin.query_parameter("%MODEL_DIR") == "/tmp/somewhere"
    assert gin_setup.GinDataConfig().seq_len == 128
    gin.clear_config()


@pytest.mark.parametrize("name", ["tiny", "cpu_small", "small", "medium", "large", "llama_1b"])
def test_every_model_config_parses(name):
    gin_setup.parse_gin(gin_setup.GinFlags(files=[f"models/{name}.gin"]))
    model = gin_setup.GinModelConfig()
    expected = {"tiny": (128, 4, 4, 20, 16), "cpu_small": (256, 4, 6, 20, 64),
                "small": (768, 12, 12, 20, 128), "medium": (1024, 16, 24, 20, 128),
                "large": (1280, 20, 36, 20, 128), "llama_1b": (2048, 16, 16, 96, 256)}[name]
    assert (model.d_model, model.num_heads, model.num_steps, model.time_embed_dim,
            model.sinusoidal_dim) == expected
    if name == "llama_1b":
        assert model.flavour == "llama" and model.hidden_dim == 8192
    gin.clear_config()


def test_misspelled_binding_is_gins_error():
    with pytest.raises(ValueError, match="doesn't have a parameter named 'd_modle'"):
        gin_setup.parse_gin(gin_setup.parse_flags(["--gin_file=models/tiny.gin",
                                                   "--gin.ModelConfig.d_modle=3"]))
    with pytest.raises(FileNotFoundError, match="--gin_file=nope.gin"):
        gin_setup.parse_gin(gin_setup.parse_flags(["--gin_file=nope.gin"]))
    gin.clear_config()
