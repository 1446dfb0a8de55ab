"""ode-lm analyze end to end on checkpoints in the trainer's format, and its output files."""

import pathlib
import zipfile

import numpy as np
import pytest

from ode_lm.models import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[2]


def _analyze():
    from ode_lm.commands.analyze import main

    return main


def _save_run(model_dir: pathlib.Path, config: ModelConfig) -> None:
    """A run directory as the trainer leaves it: model_config.json + an orbax checkpoint."""
    import jax
    import optax

    from ode_lm import partitioning
    from ode_lm.training import checkpoint as ckpt_lib
    from ode_lm.training import state as state_lib
    from ode_lm.training.run_dir import RunDir
    from ode_lm.training.state import default_model_fn

    mesh = partitioning.create_mesh((1, 1, 1), devices=[jax.devices("cpu")[0]])
    spec = state_lib.build_state_spec(default_model_fn(config), optax.identity(), mesh,
                                      partitioning.axis_rules())
    state = state_lib.init_state(spec, seed=0)
    model_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_lib.Checkpointer(str(model_dir))
    ckpt.save(3, state, force=True)
    ckpt.wait()
    ckpt.close()
    RunDir(str(model_dir)).write_model_config(config)


def _assert_png(path: pathlib.Path, min_bytes: int = 10_000) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > min_bytes, (path, len(data))
    assert data[-12:-8] == b"\x00\x00\x00\x00" and data[-8:-4] == b"IEND", path  # complete file


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    small = dict(vocab_size=260, d_model=16, num_heads=2, max_seq_len=32, time_embed_dim=4,
                 sinusoidal_dim=8, num_steps=3, num_layers=2)
    _save_run(root / "ode", ModelConfig(**small))
    _save_run(root / "seq", ModelConfig(architecture="sequential", **small))
    return root


TOKENS = "5,9,33,2,17,40,8"


@pytest.mark.slow
def test_cli_all_commands_on_an_ode_checkpoint(runs, tmp_path, capsys):
    main = _analyze()
    out = tmp_path / "out"
    args = [f"--model_dir={runs / 'ode'}", f"--out={out}"]
    assert main(["spectral", *args, "--num_times=11", f"--compare_dir={runs / 'seq'}"]) == 0
    text = capsys.readouterr().out
    assert "step 3" in text and "t=0: QK max|λ|=" in text and "t=1: QK" in text
    assert "layer=0: QK" in text  # the baseline, per layer
    assert main(["lyapunov", *args, f"--tokens={TOKENS}", "--num_steps=2", "--position=5"]) == 0
    text = capsys.readouterr().out
    assert "top-5 sensitive tokens" in text
    top = [line for line in text.splitlines() if line.startswith("  #")]
    assert len(top) == 5 and all(int(line.split()[0][1:]) <= 5 for line in top)
    assert main(["trajectory", *args, f"--tokens={TOKENS}", "--times=0.1,0.5,0.9"]) == 0

    for name in ("spectra_magnitude", "spectra_max_abs", "spectra_ov_positive_real",
                 "spectra_complex_plane_0", "lyapunov_heatmap", "trajectory"):
        _assert_png(out / f"{name}.png")
    for name in ("spectra", "spectra_compare", "lyapunov", "trajectory"):
        assert zipfile.is_zipfile(out / f"{name}.npz")
    with np.load(out / "spectra.npz") as z:
        assert z["qk"].shape == (11, 2, 8) and z["qk"].dtype == np.complex128
    with np.load(out / "spectra_compare.npz") as z:
        assert z["qk"].shape == (2, 2, 8) and str(z["depth_kind"]) == "layer"
    with np.load(out / "lyapunov.npz") as z:
        assert z["exponents"].shape == (7, 16) and np.all(z["exponents"][6] == 0)
    with np.load(out / "trajectory.npz") as z:
        np.testing.assert_allclose(z["times"], [0, 0.1, 0.5, 0.9])
    page = (out / "lyapunov.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count('class="tok"') == 7 and "linear-gradient" in page  # tokens + legend
    assert len(page) > 2000
    assert (out / "lyapunov_summary.txt").read_text().count("#") >= 5


def test_cli_on_a_baseline_checkpoint(runs, tmp_path, capsys):
    main = _analyze()
    args = [f"--model_dir={runs / 'seq'}", f"--out={tmp_path}", f"--tokens={TOKENS}"]
    assert main(["lyapunov", *args]) == 0
    assert "euler x 2 steps" in capsys.readouterr().out
    _assert_png(tmp_path / "lyapunov_heatmap.png")


@pytest.mark.parametrize(
    "argv, match, status",  # 2: a flag's value is bad in itself; 1: it does not fit the run
    [
        (["lyapunov", "--model_dir={ode}", "--tokens=1,2,300"], "[0, 260)", 1),
        (["lyapunov", "--model_dir={ode}", "--tokens=1,x"], "--tokens='1,x'", 2),
        (["lyapunov", "--model_dir={ode}"], "no data_config.json naming the data", 1),
        (["lyapunov", "--model_dir={ode}", "--tokens=1,2", "--text=hi"], "exactly one of", 2),
        (["lyapunov", "--model_dir={ode}", "--text_file=/nonexistent.txt", "--tokenizer=bytes"],
         "--text_file=/nonexistent.txt", 1),
        (["trajectory", "--model_dir={seq}", "--tokens=1,2", "--num_steps=5"], "exactly 2 layers",
         1),
        (["spectral", "--model_dir={ode}", "--times=0.5,2"], "--times", 2),
        (["spectral", "--model_dir={ode}", "--mlp_units=0"], "--mlp_units=0", 2),
        (["spectral", "--model_dir=/nonexistent/run"], "--model_dir=/nonexistent/run", 1),
    ],
)
def test_cli_bad_input_prints_one_line_error(runs, tmp_path, capsys, argv, match, status):
    main = _analyze()
    argv = [a.format(ode=runs / "ode", seq=runs / "seq") for a in argv] + [f"--out={tmp_path}"]
    assert main(argv) == status
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_cli_text_through_the_tokenizer(runs, tmp_path, capsys):
    main = _analyze()
    text_file = tmp_path / "in.txt"
    text_file.write_text("a<b")
    argv = ["lyapunov", f"--model_dir={runs / 'ode'}", f"--text_file={text_file}",
            "--tokenizer=bytes", f"--out={tmp_path}"]
    assert main(argv) == 0
    page = (tmp_path / "lyapunov.html").read_text()
    assert ">a</span>" in page and ">&lt;</span>" in page  # token text, HTML-escaped


@pytest.mark.slow
def test_cli_end_to_end_on_a_demo_checkpoint(tmp_path, capsys):
    """The demo config (model, data, tokenizer) trained for 2 steps, then every command."""
    from ode_lm.commands.train import main as train_main

    run = tmp_path / "demo"
    assert train_main([f"--gin_file={REPO / 'configs' / 'runs' / 'demo.gin'}",
                       "--gin.TRAIN_STEPS=2", f"--gin.MODEL_DIR='{run}'",
                       "--gin.TrainConfig.eval_every=0",
                       "--gin.TrainConfig.eval_solves=('steps=2',)",
                       "--gin.DataConfig.eval_max_batches=1",
                       "--gin.CheckpointConfig.save_every=1",
                       "--gin.MeshConfig.ici_parallelism=(-1, 1, 1)"]) == 0
    capsys.readouterr()
    main = _analyze()
    out = tmp_path / "analysis"
    text = "def parse(self, text):\n    return text.split()"
    common = [f"--model_dir={run}", f"--out={out}"]
    assert main(["lyapunov", *common, f"--text={text}"]) == 0  # tokenizer from the manifest
    printed = capsys.readouterr().out
    assert "step 2" in printed and "top-5 sensitive tokens" in printed
    assert main(["spectral", *common, "--num_times=11"]) == 0
    assert "t=0.5: QK max|λ|=" in capsys.readouterr().out
    assert main(["trajectory", *common, f"--text={text}"]) == 0
    for name in ("lyapunov_heatmap", "spectra_magnitude", "spectra_ov_positive_real",
                 "trajectory"):
        _assert_png(out / f"{name}.png")
    page = (out / "lyapunov.html").read_text()
    assert "parse" in page and page.count('class="tok"') > 5
