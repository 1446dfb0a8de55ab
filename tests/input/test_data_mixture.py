"""Mixtures: per-row seeded sampling on the data streams, the same batches on any host count,
exact resume across a weight change, the drawn tokens against the weights, bad mixtures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from data_helpers import _ROOT, assert_batches_equal, run_resume_script, take

from ode_lm.data import DataConfig, PreparedDataError, ensure_prepared, make_train_iterator
from ode_lm.data import mixture as mixture_lib

WEIGHTS = ((0, {"even": 0.8, "odd": 0.2}), (6, {"even": 0.25, "odd": 0.75}))


def mixture_config(**overrides) -> DataConfig:
    """The built-in corpus split in two components, prepared once per process."""
    cfg = DataConfig(tokenizer="bytes", seq_len=32, global_batch_size=8, prefetch=0,
                     holdout_fraction=0.05, mixture={
                         "even": {"source": "builtin:part=0/2", "data_dir": str(_ROOT / "even")},
                         "odd": {"source": "builtin:part=1/2", "data_dir": str(_ROOT / "odd")}},
                     mixture_weights=WEIGHTS)
    ensure_prepared(cfg)
    return dataclasses.replace(cfg, **overrides)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_mixture_batches_are_the_same_on_any_host_count(packing):
    cfg = mixture_config(packing=packing)
    whole = take(make_train_iterator(cfg, process_index=0, process_count=1), 10)
    for pc in (2, 4):
        hosts = [take(make_train_iterator(cfg, process_index=p, process_count=pc), 10)
                 for p in range(pc)]
        assert_batches_equal([{k: np.concatenate([h[s][k] for h in hosts]) for k in whole[s]}
                              for s in range(10)], whole)


def test_rows_come_from_the_picked_component():
    """A row picked for 'odd' holds odd-part tokens: each component's own stream, in turn."""
    cfg = mixture_config(row_shuffle_window=0)
    picker = mixture_lib.MixturePicker(cfg)
    it = make_train_iterator(cfg, process_index=0, process_count=1)
    single = {n: make_train_iterator(dataclasses.replace(
        c, seed=mixture_lib.component_seed(cfg, n)), process_index=0, process_count=1)
        for n, c in mixture_lib.components(cfg)}
    assert single  # the components prepared
    batches = take(it, 12)
    picks = picker.choose_many(np.arange(12), np.arange(8))
    assert set(np.unique(picks)) == {0, 1} and it.get_state()["step"] == 12
    # the sub-stream of stream r draws its rows in order: two equal picks give distinct rows
    for r in range(8):
        rows = [batches[s]["inputs"][r].tobytes() for s in range(12)]
        assert len(set(rows)) == 12


def test_exact_resume_across_a_weight_change_in_a_fresh_process(tmp_path):
    """Saved at step 4 (before the change at 6), restored in a fresh process: the next 5
    batches are the uninterrupted run's, across the change."""
    cfg = mixture_config(row_shuffle_window=64, prefetch=2, packing="first_fit")
    reference = take(make_train_iterator(cfg, process_index=0, process_count=1), 9)
    first = run_resume_script(cfg, "save", tmp_path / "ckpt", tmp_path / "a.npz", 4)
    second = run_resume_script(cfg, "restore", tmp_path / "ckpt", tmp_path / "b.npz", 4)
    assert_batches_equal(first + second, reference[:8])


def test_tokens_drawn_match_the_weights_within_binomial_noise():
    """Over 400 steps x 8 rows per stage, each component's rows follow its weight: within 4
    binomial sigmas (sqrt(n p (1-p))) per stage, and the logged counts add up."""
    cfg = mixture_config(mixture_weights=((0, {"even": 0.8, "odd": 0.2}),
                                          (400, {"even": 0.25, "odd": 0.75})))
    for lo, hi, p_even in ((0, 400, 0.8), (400, 800, 0.25)):
        rows = mixture_lib.rows_drawn(cfg, hi, start=lo)
        n = (hi - lo) * cfg.global_batch_size
        sigma = np.sqrt(n * p_even * (1 - p_even))
        assert abs(rows[0] - n * p_even) < 4 * sigma, (rows, n, p_even)
        assert rows.sum() == n
    count = mixture_lib.TokenCount(cfg)
    assert count(300)["data/even/tokens"] + count(300)["data/odd/tokens"] == 300 * 8 * 32
    full = count(800)
    assert full["data/odd/tokens"] == mixture_lib.rows_drawn(cfg, 800)[1] * 32
    assert count(10) == mixture_lib.TokenCount(cfg)(10), "going back recounts"


def test_components_that_disagree_stop_with_one_line_naming_both(tmp_path):
    with pytest.raises(ValueError, match="components 'a' and 'b' disagree on seq_len"):
        DataConfig(mixture={"a": "builtin", "b": {"source": "builtin", "seq_len": 64}})
    with pytest.raises(ValueError, match="components 'a' and 'b' disagree on tokenizer"):
        DataConfig(mixture={"a": "builtin", "b": {"source": "builtin", "tokenizer": "bytes"}})
    with pytest.raises(ValueError, match=r"mixture_weights at step 5: .* every component"):
        DataConfig(mixture={"a": "builtin", "b": "builtin"},
                   mixture_weights=((0, {"a": 1, "b": 1}), (5, {"a": 1})))
    cfg = mixture_config()
    other = DataConfig(tokenizer="bpe:300", source="builtin:part=1/2",
                       data_dir=str(tmp_path / "bpe"), holdout_fraction=0.05)
    ensure_prepared(other)  # a prepared dir brings its own tokenizer
    with pytest.raises(ValueError, match="components 'even' and 'bpe' disagree on tokenizer "
                       r"\('bytes' vs 'bpe:300'\)"):
        dataclasses.replace(cfg, mixture_weights=(),
                            mixture={"even": cfg.mixture["even"], "bpe": str(other.data_dir)})
    same_spec = [("even", {"tokenizer": {"sha256": "1", "vocab_size": 9, "eos_id": 0},
                           "data_dir": "d1"}),
                 ("odd", {"tokenizer": {"sha256": "2", "vocab_size": 9, "eos_id": 0},
                          "data_dir": "d2"})]  # bpe:N trained per component: other merges
    with pytest.raises(PreparedDataError, match=r"components 'even' \(d1\) and 'odd' \(d2\) "
                       "disagree on tokenizer sha256"):
        mixture_lib.check_manifests(same_spec)
