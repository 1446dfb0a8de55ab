"""lm-eval through the native adapter (ode_lm.harness) on the local tasks in tests/lm_eval_tasks:
the same scores as ``lm_eval --model hf`` on an export at the same N, request by request; the
scoring rule itself; ``ode-lm eval --lm_eval_tasks``; and the trainer's lm_eval/<task>/<metric>."""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: no hub here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from export_helpers import make_run, tiny_config  # noqa: E402

pytest.importorskip("lm_eval", reason="pip install -e '.[lmeval]' for the lm-eval tests")

from lm_eval.api.instance import Instance  # noqa: E402

from ode_lm.data import DataConfig  # noqa: E402
from ode_lm.harness import run as harness  # noqa: E402
from ode_lm.harness.adapter import OdeLM  # noqa: E402
from ode_lm.models.solve import Solve
from ode_lm.training.run_dir import RunDir  # noqa: E402
from ode_lm.training.saved_run import load_model  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
TASKS = "tests/lm_eval_tasks"  # relative: the YAMLs' data_files are relative to the repo root
ALL = ["ode_lm_tiny"]  # the tag of the four tasks: mc, cloze, perplexity, generation
N = 4  # evaluated at a depth the model was not trained at (its num_steps is 3)


@pytest.fixture(scope="module", autouse=True)
def _at_repo_root():
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        yield


def _task_texts() -> list[str]:
    texts = []
    for name in ("tiny_mc", "tiny_ppl", "tiny_cloze"):
        with open(REPO / TASKS / f"{name}.jsonl") as f:
            texts += [" ".join(map(str, json.loads(line).values())) for line in f]
    return texts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(run dir, data dir, tokenizer): an ODE gpt2 run (random init, saved from 8 devices)
    with a byte-level BPE trained on the task texts, and the data_config.json that
    ``ode-lm eval`` reads."""
    from ode_lm.data.tokenizers import get_tokenizer, train_bpe

    root = tmp_path_factory.mktemp("lmeval")
    data, run = root / "data", str(root / "run")
    data.mkdir()
    train_bpe(_task_texts() * 2, 300, data / "tokenizer.json")
    tok = get_tokenizer("bpe:300", str(data))
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {
        "spec": "bpe:300", "file": "tokenizer.json", "sha256": tok.fingerprint,
        "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}}))
    make_run(run, tiny_config("gpt2", vocab_size=384, max_seq_len=64, num_steps=3,
                              init_std=0.3))
    RunDir(run).write_data_config(DataConfig(data_dir=str(data), tokenizer="bpe:300"))
    return run, str(data), tok


@pytest.fixture(scope="module")
def ours(tiny):
    """The adapter's results at N on every local task, with the per-request responses."""
    run, _, tok = tiny
    model, _ = load_model(run)
    # One width for every request (64 = max_seq_len): one compiled scorer and one compiled
    # generation loop; the bucketing itself is exercised by the scoring-rule test below.
    lm = OdeLM(model, tok, num_steps=N, batch_size=5, length_bucket=64)
    return harness.simple_evaluate(lm, ALL, include_path=TASKS, log_samples=True)


def _responses(results) -> dict[tuple[str, int], list]:
    return {(task, s["doc_id"]): s["filtered_resps"] for task, samples in
            results["samples"].items() for s in samples}


def test_adapter_scores_as_lm_eval_hf_on_the_export(tiny, ours, tmp_path):
    """Same model, same N: the adapter on the checkpoint and ``--model hf`` on the export
    (materialised at N Euler steps) agree on every request and every metric."""
    pytest.importorskip("transformers", reason="pip install -e '.[hf]' for the export")
    from lm_eval.models.huggingface import HFLM

    from ode_lm.export import export

    run, data, tok = tiny
    out = str(tmp_path / "hf")
    export(run, "hf", out, num_steps=N, data_dir=data)
    hf = HFLM(pretrained=out, trust_remote_code=True, dtype="float32", batch_size=5,
              device="cpu")
    theirs = harness.simple_evaluate(hf, ALL, include_path=TASKS, log_samples=True)

    # The tasks reach every rule: a context truncated from the left, a document scored in
    # several rolling windows, empty contexts (the prefix token), stop sequences.
    assert max(len(tok.encode(t)) for t in _task_texts()) > 2 * 64
    ours_resp, hf_resp = _responses(ours), _responses(theirs)
    assert ours_resp.keys() == hf_resp.keys() and len(ours_resp) == 12 + 6 + 6 + 12
    for key, mine in ours_resp.items():
        other = hf_resp[key]
        if key[0] == "ode_lm_tiny_gen":
            assert mine == other, key  # greedy text up to the first stop sequence
            continue
        for a, b in zip(mine, other, strict=True):
            a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
            # fp32: the logits agree to ~1e-5 (the export test's bound is 1e-4 per logit);
            # a sum of up to 150 token log-probs keeps that relative precision.
            np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-4, err_msg=str(key))
            assert a[1:] == b[1:], key  # is_greedy
    mine, other = harness.metrics(ours), harness.metrics(theirs)
    assert mine.keys() == other.keys() and len(mine) == 8, sorted(mine)
    for k, v in mine.items():
        np.testing.assert_allclose(v, other[k], rtol=1e-5, err_msg=k)
    assert {s["filtered_resps"][0] for s in ours["samples"]["ode_lm_tiny_gen"]} - {""}


def _instances(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def test_scores_are_the_log_likelihood_of_the_left_truncated_window(tiny):
    """The rule, against a plain forward of each window: log p(continuation | context), the
    window cut to the model's last 64 positions; the batch and padding never matter."""
    from flax import nnx

    run, _, tok = tiny
    model, _ = load_model(run)
    long_context = " ".join(_task_texts()[:6])
    assert len(tok.encode(long_context)) > 64  # the second pair is truncated
    pairs = [("The solver takes one step of the", " ODE"), (long_context, " the mesh"),
             ("", "The vector field")]
    lm = OdeLM(model, tok, num_steps=N, batch_size=5)
    together = lm.loglikelihood(_instances(pairs))
    alone = [lm.loglikelihood(_instances([p]))[0] for p in pairs]  # other rows: padding
    np.testing.assert_allclose([t[0] for t in together], [a[0] for a in alone], rtol=1e-6)

    @nnx.jit
    def log_probs(m, tokens):  # right padding without segment ids: causal, so harmless
        return jax.nn.log_softmax(m(tokens, solve=Solve(None, N))[0], axis=-1)

    for (ctx, cont), (ll, greedy) in zip(pairs, together, strict=True):
        whole = [int(t) for t in tok.encode(ctx + cont)]
        n_cont = len(whole) - len(tok.encode(ctx)) if ctx else len(whole)
        window = (whole if ctx else [tok.eos_id] + whole)[-65:]
        padded = np.zeros((1, 64), np.int32)
        padded[0, :len(window) - 1] = window[:-1]
        logp = np.asarray(log_probs(model, jnp.asarray(padded)))
        rows = range(len(window) - 1 - n_cont, len(window) - 1)
        want = sum(logp[r, window[r + 1]] for r in rows)
        np.testing.assert_allclose(ll, want, rtol=1e-5, err_msg=ctx[:30])
        assert greedy == all(int(np.argmax(logp[r])) == window[r + 1] for r in rows)


def test_eval_cli_runs_lm_eval_tasks_at_each_n(tiny, ours, capsys):
    from ode_lm.commands import eval as eval_cli

    run, _, _ = tiny
    rc = eval_cli.main(["--model_dir", run, "--num_steps", f"3,{N}", "--lm_eval_tasks",
                        "ode_lm_tiny_cloze", "--lm_eval_include_path", TASKS])
    out = capsys.readouterr().out
    assert rc == 0
    got = json.loads(out.strip().splitlines()[-1])
    assert got["step"] == 5
    want = {k: v for k, v in harness.metrics(ours).items() if "_cloze/" in k}
    assert len(want) == 2
    for k, v in want.items():  # restored onto 8 devices, batch 16: the same scores
        np.testing.assert_allclose(got[f"{k}@steps={N}"], v, rtol=1e-5, err_msg=k)
    ppl = "lm_eval/ode_lm_tiny_cloze/perplexity"
    # named as eval/ is: the model's own N (3) unsuffixed, another N as @steps=N
    assert f"{ppl}@steps=3" not in got
    assert got[ppl] != pytest.approx(got[f"{ppl}@steps={N}"], rel=1e-3)
    assert f"{ppl}: " in out and f"{ppl}@steps={N}: " in out


def test_trainer_writes_lm_eval_scalars_every_eval(tmp_path):
    """TrainConfig.lm_eval_tasks: lm_eval/<task>/<metric> in TensorBoard at each eval, equal
    to the adapter on the saved checkpoint of that step."""
    from data_helpers import small_texts, write_jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ode_lm.data.tokenizers import get_tokenizer
    from ode_lm.gin_setup import in_loop_evals
    from ode_lm.training.trainer import TrainConfig, Trainer

    corpus = write_jsonl(tmp_path / "corpus.jsonl", small_texts(200) + _task_texts())
    data = DataConfig(source=str(corpus), data_dir=str(tmp_path / "data"), tokenizer="bytes",
                      seq_len=16, global_batch_size=8, holdout_fraction=0.1,
                      eval_max_batches=1)
    model_dir = str(tmp_path / "run")
    cfg = TrainConfig(model_dir=model_dir, num_train_steps=2, eval_every=1,
                      lm_eval_tasks=("ode_lm_tiny_cloze",), lm_eval_include_path=TASKS,
                      lm_eval_limit=3)
    result = Trainer(model_config=tiny_config("gpt2", vocab_size=384, max_seq_len=64,
                                              init_std=0.3),
                     data_config=data, train_config=cfg, devices=jax.devices()[:1],
                     evals=in_loop_evals(cfg), print_fn=lambda _: None).run()
    acc = EventAccumulator(model_dir)
    acc.Reload()
    ppl = "lm_eval/ode_lm_tiny_cloze/perplexity"
    assert {"lm_eval/ode_lm_tiny_cloze/acc", ppl} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars(ppl)] == [1, 2]
    model, _ = load_model(model_dir, 2)
    direct = harness.evaluate_model(model, get_tokenizer("bytes"), ["ode_lm_tiny_cloze"],
                                    include_path=TASKS, limit=3)
    np.testing.assert_allclose(acc.Scalars(ppl)[-1].value, direct[ppl], rtol=1e-5)
    assert result.eval[ppl] == pytest.approx(direct[ppl], rel=1e-5)


def test_bad_train_config_lm_eval_values_stop_before_training(tmp_path):
    """TrainConfig checks the lm-eval values when it is built, before any step; a trainer
    handed lm-eval tasks without the hook refuses them rather than skip them."""
    from ode_lm.training.trainer import TrainConfig, Trainer

    with pytest.raises(ValueError, match="TrainConfig.lm_eval_include_path='/nowhere'"):
        TrainConfig(model_dir=str(tmp_path), num_train_steps=1, lm_eval_tasks=("x",),
                    lm_eval_include_path="/nowhere")
    with pytest.raises(ValueError, match="TrainConfig.lm_eval_limit=0"):
        TrainConfig(model_dir=str(tmp_path), num_train_steps=1, lm_eval_tasks=("x",),
                    lm_eval_limit=0)
    cfg = TrainConfig(model_dir=str(tmp_path / "run"), num_train_steps=1, lm_eval_tasks=("x",))
    with pytest.raises(ValueError, match="TrainConfig.lm_eval_tasks: the trainer runs"):
        Trainer(model_config=tiny_config("gpt2", vocab_size=384), train_config=cfg,
                data_config=DataConfig(data_dir=str(tmp_path / "data")),
                devices=jax.devices()[:1])
    assert not (tmp_path / "run").exists()
