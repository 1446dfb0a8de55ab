"""Training pipeline: batch format, packing invariants, determinism, stream disjointness, the
same global batches on any host count, resume."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from data_helpers import assert_batches_equal, builtin_config, run_resume_script, take

from ode_lm.data import host_streams as streams_lib
from ode_lm.data import load_manifest, make_train_iterator, to_global_batch
from ode_lm.data import packing as packing_lib
from ode_lm.data.pipeline import StreamOrder, open_split
from ode_lm.partitioning import LOGICAL_AXIS_RULES

PACKINGS = ("concat", "first_fit")


@pytest.mark.parametrize("packing", PACKINGS)
def test_batch_format_and_packing_invariants(packing):
    cfg = builtin_config(packing=packing)
    eos = load_manifest(cfg.data_dir)["eos_id"]
    for b in take(make_train_iterator(cfg, process_index=0, process_count=1), 5):
        shape = (cfg.global_batch_size, cfg.seq_len)
        assert {k: (v.shape, v.dtype.name) for k, v in b.items()} == {
            "inputs": (shape, "int32"), "targets": (shape, "int32"),
            "segment_ids": (shape, "int32"), "positions": (shape, "int32"),
            "loss_mask": (shape, "float32")}
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        seg, pos = b["segment_ids"], b["positions"]
        for r in range(seg.shape[0]):
            real = seg[r] > 0
            n = int(real.sum())
            assert real[:n].all() and not real[n:].any(), "padding only at the row end"
            s = seg[r, :n]
            assert s[0] == 1 and np.all(np.diff(s) >= 0) and np.all(np.diff(s) <= 1)
            starts = np.r_[True, s[1:] != s[:-1]]
            assert np.all(pos[r, :n][starts] == 0), "positions restart per segment"
            assert np.all(np.diff(pos[r, :n])[~starts[1:]] == 1)
        # loss mask rule: target real and (same segment or input is EOS)
        nxt_seg = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1)
        same = (nxt_seg == seg) & (seg > 0)
        assert np.all(b["loss_mask"][same | (b["inputs"] == eos) & (b["loss_mask"] > 0)] == 1)
        assert np.all(b["loss_mask"][seg == 0] == 0)


def stream_docs(cfg, v, num_streams):
    _, records = open_split(cfg, "train")
    order = StreamOrder(len(records), cfg.seed, v, num_streams, num_epochs=1)
    return records, [order[k] for k in range(len(order))]


def test_concat_every_token_of_an_epoch_exactly_once():
    """One data stream (a batch of one row) reads the whole epoch in packing order."""
    cfg = builtin_config(packing="concat", num_epochs=1, global_batch_size=1, seq_len=128,
                         row_shuffle_window=0)  # packing order
    records, order = stream_docs(cfg, 0, 1)
    stream = np.concatenate([records[i] for i in order]).astype(np.int32)
    rows = [np.c_[b["inputs"], b["targets"][:, -1:]] for b in make_train_iterator(
        cfg, process_index=0, process_count=1)]
    got = np.concatenate(rows).ravel()
    width = cfg.global_batch_size * (cfg.seq_len + 1)
    assert len(got) == len(stream) // width * width  # only the last partial batch is dropped
    np.testing.assert_array_equal(got, stream[: len(got)])


def test_first_fit_places_every_document_once(monkeypatch):
    cfg = builtin_config(packing="first_fit", num_epochs=1, seq_len=128, global_batch_size=1)
    records, order = stream_docs(cfg, 0, 1)
    rows = []
    to_batch = packing_lib.to_batch

    def spy(tok, seg, pos, eos):  # the packed rows of seq_len + 1, before the input/target split
        rows.append((tok.copy(), seg.copy()))
        return to_batch(tok, seg, pos, eos)

    monkeypatch.setattr(packing_lib, "to_batch", spy)
    batches = list(make_train_iterator(cfg, process_index=0, process_count=1))
    assert len(batches) == len(rows) > 0
    pieces = [tuple(tok[r][seg[r] == s]) for tok, seg in rows for r in range(len(tok))
              for s in range(1, seg[r].max() + 1)]
    width = cfg.seq_len + 1
    expected = [tuple(records[i][j:j + width]) for i in order
                for j in range(0, len(records[i]), width)]
    assert sorted(pieces) == sorted(expected), "every document (piece) exactly once"
    fill = np.mean([(seg > 0).mean() for _, seg in rows[:-1]])
    assert fill > 0.9, f"first-fit rows should be well filled, got {fill:.2f}"


@pytest.mark.parametrize("packing", PACKINGS)
def test_determinism_seed_and_throughput_settings(packing):
    cfg = builtin_config(packing=packing)
    a = take(make_train_iterator(cfg, process_index=0, process_count=1), 4)
    b = take(make_train_iterator(dataclasses.replace(cfg, num_threads=1, prefetch=3),
                                 process_index=0, process_count=1), 4)
    assert_batches_equal(a, b)
    c = take(make_train_iterator(dataclasses.replace(cfg, seed=1), process_index=0,
                                 process_count=1), 4)
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


def test_epochs_are_reshuffled_and_streams_disjoint():
    cfg = builtin_config()
    n = len(open_split(cfg, "train")[1])
    single = StreamOrder(n, cfg.seed, 0, 1, None)
    epoch0 = single.lookup(np.arange(n))
    epoch1 = single.lookup(np.arange(n, 2 * n))
    assert sorted(epoch0) == list(range(n)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1), "each epoch has its own permutation"
    hosts = [StreamOrder(n, cfg.seed, v, 4, 1) for v in range(4)]
    parts = [h.lookup(np.arange(len(h))) for h in hosts]
    union = np.concatenate(parts)
    assert len(union) == n and len(set(union.tolist())) == n, "no document twice, none skipped"
    assert set(union.tolist()) == set(epoch0.tolist())
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_per_host_batches_and_rows():
    cfg = builtin_config()
    batches = [next(make_train_iterator(cfg, process_index=p, process_count=4)) for p in range(4)]
    assert all(b["inputs"].shape == (cfg.global_batch_size // 4, cfg.seq_len) for b in batches)
    assert len({b["inputs"].tobytes() for b in batches}) == 4
    with pytest.raises(ValueError, match="global_batch_size=8 is not divisible by process_count=3"):
        make_train_iterator(cfg, process_index=0, process_count=3)


def test_corpus_smaller_than_one_batch_is_an_error():
    cfg = builtin_config(seq_len=4096, global_batch_size=512)
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_train_iterator(cfg, process_index=0, process_count=1)


@pytest.mark.parametrize("packing", PACKINGS)
def test_start_step_fallback_is_deterministic_and_not_a_restart(packing):
    cfg = builtin_config(packing=packing)
    it = make_train_iterator(cfg, process_index=0, process_count=1, start_step=50)
    info = load_manifest(cfg.data_dir)["splits"]["train"]
    expected = int(50 * (cfg.seq_len + 1) // (info["tokens"] / info["documents"]))
    state = it.get_state()
    assert set(state) == {"format", "step", "num_streams", "streams"}, "the checkpointed keys"
    assert state["step"] == 50 and sorted(map(int, state["streams"])) == list(range(8))
    for stream in state["streams"].values():  # every stream where it is after 50 rows
        assert set(stream[""]) == {"doc", "offset", "carry", "row"}
        assert stream[""]["doc"] == expected > 0
    again = make_train_iterator(cfg, process_index=0, process_count=1, start_step=50)
    assert_batches_equal(take(it, 2), take(again, 2))


@pytest.mark.parametrize("packing, window", [("concat", 4096), ("first_fit", 4096),
                                             ("concat", 20), ("first_fit", 0)])
def test_exact_resume_in_a_fresh_process(packing, window, tmp_path):
    """Saved after k batches, restored in a fresh process: the same next k batches; with a
    row shuffle the save falls inside a window (4096 rows) or, 3 batches a window (20 rows,
    rounded up to whole batches of 8), inside the third window after two whole ones."""
    cfg = builtin_config(packing=packing, prefetch=2, row_shuffle_window=window)
    k = 7
    reference = take(make_train_iterator(cfg, process_index=0, process_count=1), 2 * k)
    first = run_resume_script(cfg, "save", tmp_path / "ckpt", tmp_path / "a.npz", k)
    second = run_resume_script(cfg, "restore", tmp_path / "ckpt", tmp_path / "b.npz", k)
    assert_batches_equal(first + second, reference)


def test_to_global_batch_shards_over_activation_batch():
    import jax

    cfg = builtin_config()
    batch = next(make_train_iterator(cfg, process_index=0, process_count=1))
    devices = np.array(jax.devices()[:8]).reshape(2, 4, 1)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
    out = to_global_batch(batch, mesh, LOGICAL_AXIS_RULES)
    for k, v in out.items():
        assert v.shape == batch[k].shape and v.dtype == batch[k].dtype
        assert v.sharding.spec[0] == ("data", "fsdp")
        np.testing.assert_array_equal(np.asarray(v), batch[k])
    assert len(out["inputs"].addressable_shards) == 8


def test_to_global_batch_follows_rule_overrides():
    """A gin override of activation_batch reaches the data sharding (the trainer passes its
    rules), so the batch arrives laid out as the train step expects."""
    import jax

    from ode_lm import partitioning

    cfg = builtin_config()
    batch = next(make_train_iterator(cfg, process_index=0, process_count=1))
    devices = np.array(jax.devices()[:8]).reshape(2, 4, 1)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
    rules = partitioning.axis_rules((("activation_batch", "data"),))
    out = to_global_batch(batch, mesh, rules)
    for k, v in out.items():
        assert v.sharding.spec[0] == "data"
        np.testing.assert_array_equal(np.asarray(v), batch[k])
    assert len({str(s.index) for s in out["inputs"].addressable_shards}) == 2


def _rows(batches):
    """The packed rows (``seq_len + 1`` tokens) of batches, as bytes."""
    return [np.r_[i, t[-1:]].tobytes() for b in batches
            for i, t in zip(b["inputs"], b["targets"], strict=True)]


def test_row_shuffle_decorrelates_a_streams_steps_and_keeps_every_row():
    """Packing cuts a long document into consecutive rows, so in packing order a data stream
    (one global row) shows one document for many steps; the row shuffle (on by default)
    hands out the same rows, window by window, in a seeded order, so a stream's consecutive
    steps rarely share a document."""
    cfg = builtin_config(packing="concat", num_epochs=1, global_batch_size=4, seq_len=32)
    assert cfg.row_shuffle_window == 4096  # the default: 1024 rows per stream window here
    window_batches = streams_lib.window_rows(4096, 4)
    assert window_batches == 1024
    width = cfg.seq_len + 1
    doc_of_row = {}  # stream v's packed row (bytes) -> the documents it draws on
    for v in range(4):
        records, order = stream_docs(cfg, v, 4)
        doc_of_token = np.repeat(np.arange(len(order)), [len(records[i]) for i in order])
        doc_of_row[v] = doc_of_token

    packed = take(make_train_iterator(dataclasses.replace(cfg, row_shuffle_window=0),
                                      process_index=0, process_count=1), 2 * window_batches)
    index = [{row: s for s, row in enumerate(_rows([b])[v] for b in packed)} for v in range(4)]

    def shared(batches):
        """Fraction of (stream, step) whose row shares a document with its previous step's."""
        hits = total = 0
        for v in range(4):
            docs = [set(doc_of_row[v][index[v][r] * width:(index[v][r] + 1) * width].tolist())
                    for r in (_rows([b])[v] for b in batches)]
            hits += sum(bool(a & b) for a, b in zip(docs, docs[1:], strict=False))
            total += len(docs) - 1
        return hits / total

    shuffled = take(make_train_iterator(cfg, process_index=0, process_count=1),
                    2 * window_batches)
    for w in (0, 1):  # each window: the same rows, another order
        part = slice(w * window_batches, (w + 1) * window_batches)
        assert sorted(_rows(shuffled[part])) == sorted(_rows(packed[part]))
        assert _rows(shuffled[part]) != _rows(packed[part])
    before, after = shared(packed), shared(shuffled)
    assert before > 0.5, f"the case under test: packing order repeats documents ({before:.2f})"
    assert after < 0.1, f"shuffled, a stream's steps rarely share a document ({after:.2f})"
    again = take(make_train_iterator(cfg, process_index=0, process_count=1), 3)
    assert_batches_equal(again, shuffled[:3])  # deterministic given the seed
    other = take(make_train_iterator(dataclasses.replace(cfg, seed=1), process_index=0,
                                     process_count=1), 1)
    assert _rows(other) != _rows(shuffled[:1])


@pytest.mark.parametrize("packing, window", [("concat", 0), ("concat", 4096),
                                             ("first_fit", 0), ("first_fit", 4096)])
def test_global_batch_is_the_same_on_any_host_count(packing, window):
    """Host p's batch is rows [p*B/P, (p+1)*B/P) of one global batch that does not depend on
    P: concatenated in host order, the hosts' batches of P = 2 and 4 are those of P = 1."""
    cfg = builtin_config(packing=packing, row_shuffle_window=window)
    steps = 6
    whole = take(make_train_iterator(cfg, process_index=0, process_count=1), steps)
    for pc in (2, 4):
        hosts = [take(make_train_iterator(cfg, process_index=p, process_count=pc), steps)
                 for p in range(pc)]
        joined = [{k: np.concatenate([h[s][k] for h in hosts]) for k in whole[s]}
                  for s in range(steps)]
        assert_batches_equal(joined, whole)
    assert len({r for b in whole for r in _rows([b])}) > steps, "rows differ across the batch"


def test_data_state_resumes_on_another_host_count():
    """The hosts' saved states together are a global state: 2 hosts save after k steps, and
    1 host (or 4) restoring the union continues with the same global batches."""
    cfg = builtin_config(packing="first_fit", row_shuffle_window=40)
    k = 5
    whole = take(make_train_iterator(cfg, process_index=0, process_count=1), 2 * k)
    saved = {}
    for p in range(2):
        it = make_train_iterator(cfg, process_index=p, process_count=2)
        take(it, k)
        saved[(p, 2)] = it.get_state()
    for pc in (1, 4):
        state = streams_lib.global_state(saved, "ckpt", 0, pc, streams=True)
        hosts = []
        for p in range(pc):
            it = make_train_iterator(cfg, process_index=p, process_count=pc)
            it.set_state(state)
            hosts.append(take(it, k))
        joined = [{key: np.concatenate([h[s][key] for h in hosts]) for key in whole[0]}
                  for s in range(k)]
        assert_batches_equal(joined, whole[k:])
    with pytest.raises(streams_lib.DataStateError, match="older ode-lm"):
        streams_lib.global_state({(0, 2): {"doc": 3, "offset": 0, "carry": []}}, "ckpt/7/data",
                                 0, 1, streams=True)
    with pytest.raises(streams_lib.DataStateError, match="streaming resume needs the same host "
                       r"count \(saved on 2 process\(es\), this job has 1\)"):
        streams_lib.global_state({(0, 2): {"doc": 3, "reader": {}}}, "ckpt/7/data", 0, 1,
                                 streams=False)
