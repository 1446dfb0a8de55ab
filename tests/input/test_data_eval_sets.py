"""Eval pipeline: unshuffled, padded, every validation token counted exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import builtin_config

from ode_lm.data import load_manifest, make_eval_iterator
from ode_lm.data.eval_sets import EvalStream


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_counts_every_validation_token_once(process_count):
    cfg = builtin_config(eval_batch_size=4, seq_len=48)
    manifest = load_manifest(cfg.data_dir)
    counted = 0.0
    targets = []
    for p in range(process_count):
        for b in make_eval_iterator(cfg, process_index=p, process_count=process_count):
            assert b["inputs"].shape == (4 // process_count, 48)
            counted += b["loss_mask"].sum()
            targets.append(b["targets"][b["loss_mask"] > 0])
    assert counted == manifest["splits"]["validation"]["tokens"] > 0
    stream = EvalStream(cfg, "validation").tokens
    assert sorted(np.concatenate(targets).tolist()) == sorted(stream[1:].tolist())


def test_eval_is_in_order_and_prefix_is_fixed():
    cfg = builtin_config(eval_batch_size=2, seq_len=32)
    full = list(make_eval_iterator(cfg, process_index=0, process_count=1))
    again = list(make_eval_iterator(cfg, process_index=0, process_count=1))
    stream = EvalStream(cfg, "validation").tokens
    np.testing.assert_array_equal(full[0]["inputs"][0], stream[:32])  # no shuffle
    np.testing.assert_array_equal(full[0]["targets"][0], stream[1:33])
    np.testing.assert_array_equal(full[-1]["targets"], again[-1]["targets"])
    assert full[-1]["loss_mask"][-1, -1] == 0, "the last batch is padded"
    prefix = list(make_eval_iterator(builtin_config(eval_batch_size=2, seq_len=32,
                                                    eval_max_batches=3),
                                     process_index=0, process_count=1))
    assert len(prefix) == 3
    np.testing.assert_array_equal(prefix[2]["inputs"], full[2]["inputs"])
