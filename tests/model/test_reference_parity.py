"""Parity with the paper's own implementation (qkvflow, GPT-2 flavour) on its micro config."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference_model import load_qkvflow_reference, reference_param_paths


@pytest.fixture(scope="module")
def reference(reference_dir):
    data = dict(np.load(reference_dir / "qkvflow_micro_perturbed.npz"))
    grads = dict(np.load(reference_dir / "qkvflow_micro_perturbed_grads.npz"))
    return data, grads, load_qkvflow_reference(data)


def _loss(model, ids):
    logits = model(ids)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return nll.mean()


def test_config_matches_meta(reference):
    data, _, model = reference
    meta = json.loads(str(data["meta/config_json"]))
    n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == meta["n_params"] == 468880


def test_trajectory_and_logits_match(reference):
    data, _, model = reference
    ids = jnp.asarray(data["input/input_ids"])
    traj = np.asarray(model.trajectory(ids))
    np.testing.assert_allclose(traj[0], data["debug/embed_out"], atol=1e-6)
    assert np.abs(traj[1:] - data["debug/trajectory"]).max() < 1e-4
    logits = np.asarray(model(ids))
    ref = data["output/logits"]
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4


def test_loss_and_grads_match(reference):
    data, grads, model = reference
    ids = jnp.asarray(data["input/input_ids"])
    loss, g = nnx.value_and_grad(_loss)(model, ids)
    assert abs(float(loss) - float(data["output/loss"])) < 1e-5
    flat = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(g)}
    paths = reference_param_paths()
    assert len(paths) == len([k for k in grads if k.startswith("grad/")])
    for src, dst in paths.items():
        ref = grads[f"grad/{src}"]
        ours = flat[dst]
        if src.endswith(("f_weight", "f_bias")) and "ln" in src:
            ours = ours.T
        rel = np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-12)
        assert rel < 1e-3, (src, rel)
