"""Data streams: the global batch at step ``s`` is a function of (seed, data, config, s) only,
and host ``p`` of ``P`` builds only its rows of it.

The global row stream is split into ``V = global_batch_size`` fixed *data streams*: global
row ``r`` of every batch comes from stream ``r``. Stream ``v`` reads the global document
order at positions ``v, v + V, v + 2V, ...`` and packs (and row-shuffles) its own rows, one
row a step, with ``packing.Packer``. Host ``p`` runs the streams of its rows
``[p * B/P, (p + 1) * B/P)``, the contiguous block ``jax.make_array_from_process_local_data``
gives it under the batch sharding, so every host packs ``1/P`` of the batch (cost 1x) and
the batch never depends on ``P``.

A stream may hold several *components* (a mixture, ``mixture.py``): one packer each; a
``RowPicker`` says which component each global row ``(s, r)`` draws on, from (seed, s, r)
alone, so the state stays the packers' positions.

State (JSON, global): ``{"format", "step", "num_streams", "streams": {v: {component: packer
state}}}``. Each host saves its streams' states (grain's ``process_{i}-of-{n}.json``); a
restore reads every host's file of the old run (``global_state``) and each host takes its
streams, so a run resumes on any host count that divides the batch, exact to the token
(``restore``: what the trainer calls on a checkpoint step's data item).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grain
import numpy as np
from etils import epath

from ode_lm.data.packing import BATCH_KEYS

FORMAT = "ode_lm.streams/1"
MIN_WINDOW_ROWS = 16  # a stream's row-shuffle window never drops below this (or the setting)


class DataStateError(ValueError):
    """A saved data state this pipeline cannot continue exactly."""


def host_rows(global_batch: int, process_count: int, what: str = "global_batch_size") -> int:
    """Rows of a global batch one host builds: the batch must split evenly over the hosts
    (every pipeline asks here: prepared, streaming, eval). ``what``: the DataConfig field."""
    if global_batch % process_count:
        raise ValueError(f"DataConfig.{what}={global_batch} is not divisible by "
                         f"process_count={process_count}")
    return global_batch // process_count


def host_streams(num_streams: int, process_index: int, process_count: int) -> range:
    """The streams (= global rows) host ``process_index`` builds: a contiguous block."""
    rows = host_rows(num_streams, process_count)
    return range(process_index * rows, (process_index + 1) * rows)


def window_rows(row_shuffle_window: int, num_streams: int) -> int:
    """Rows one stream packs and shuffles at once: the run's ``row_shuffle_window`` rows in
    flight, shared over the streams (so memory stays that of one window), at least
    ``MIN_WINDOW_ROWS``; 0 = off."""
    if row_shuffle_window <= 0:
        return 0
    return max(-(-row_shuffle_window // num_streams), min(row_shuffle_window, MIN_WINDOW_ROWS))


class RowPicker(Protocol):
    """Which component each global row of step ``s`` draws on (a mixture's sampling)."""

    def choose(self, step: int, rows: np.ndarray) -> np.ndarray:
        """Component indices (int) of global rows ``rows`` at step ``step``."""


# (component index, stream) -> that component's packer for the stream (rows=1)
MakePacker = Callable[[int, int], grain.DatasetIterator]


class HostStreams(grain.DatasetIterator):
    """Host-local batches: the rows of this host's streams, in stream order (module doc)."""

    def __init__(self, make_packer: MakePacker, *, names: Sequence[str], streams: range,
                 num_streams: int, picker: RowPicker | None = None, start_step: int = 0) -> None:
        super().__init__()
        self._names, self._streams, self._num_streams = list(names), streams, num_streams
        self._picker, self._step = picker, start_step
        self._packers = [[make_packer(c, v) for c in range(len(self._names))] for v in streams]
        self._rows = np.arange(streams.start, streams.stop)

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return self._step

    def choices(self, step: int) -> np.ndarray:
        """Component index of each of this host's rows at ``step``."""
        if self._picker is None:
            return np.zeros(len(self._rows), np.int64)
        return self._picker.choose(step, self._rows)

    def __next__(self) -> dict[str, np.ndarray]:
        with self._stats.record_self_time():
            picks = self.choices(self._step)
            rows = [next(self._packers[i][int(c)]) for i, c in enumerate(picks)]
            self._step += 1
            return {k: np.concatenate([r[k] for r in rows]) for k in BATCH_KEYS}

    def get_state(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self._step, "num_streams": self._num_streams,
                "streams": {str(v): {name: p.get_state() for name, p in
                                     zip(self._names, packers, strict=True)}
                            for v, packers in zip(self._streams, self._packers, strict=True)}}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != FORMAT:
            raise DataStateError("the data state was saved per host by an older ode-lm (before "
                                 "batches were the same on any host count), whose batch order "
                                 "this version cannot continue")
        if state["num_streams"] != self._num_streams:
            raise DataStateError(f"the data state has {state['num_streams']} streams (the "
                                 f"global_batch_size it was saved with); this run has "
                                 f"global_batch_size={self._num_streams}")
        saved = state["streams"]
        for v, packers in zip(self._streams, self._packers, strict=True):
            if str(v) not in saved:
                raise DataStateError(f"the data state lacks stream {v} (a host's file is "
                                     "missing)")
            for name, packer in zip(self._names, packers, strict=True):
                if name not in saved[str(v)]:
                    raise DataStateError(f"the data state has no component {name!r} (it has "
                                         f"{sorted(saved[str(v)])}); the mixture changed")
                packer.set_state(saved[str(v)][name])
        self._step = int(state["step"])

    @property
    def epoch(self) -> int:
        """The epoch the first stream's first component reads next."""
        return self._packers[0][0].epoch

    def close(self) -> None:
        for packers in self._packers:
            for p in packers:
                p.close()
        super().close()


class StreamsDataset(grain.IterDataset):
    """A fresh ``HostStreams`` per iterator (its packers hold readers and positions)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._kwargs = kwargs

    def __iter__(self) -> HostStreams:
        return HostStreams(**self._kwargs)

    def __str__(self) -> str:
        return f"StreamsDataset({len(self._kwargs['streams'])} streams)"


def global_state(saved: Mapping[tuple[int, int], Any], where: str, process_index: int,
                 process_count: int, streams: bool) -> dict[str, Any] | None:
    """The state to restore from every host's saved file ``{(i, n): state}`` of a step.

    ``streams``: the iterator is a ``HostStreams`` (its fresh state has the format). Returns
    the union of the hosts' stream states for it; ``None`` for a per-host iterator whose own
    file (this layout) is there (restored as grain does). Raises ``DataStateError`` naming
    ``where`` when the saved state cannot continue here.
    """
    if streams:
        parts = [s for s in saved.values() if isinstance(s, dict) and s.get("format") == FORMAT]
        if not parts:
            n = sorted({n for _, n in saved})
            raise DataStateError(f"{where}: the data state was saved per host on {n[0]} "
                                 "process(es) by an older ode-lm (before batches were the same "
                                 "on any host count); this version cannot continue its batch "
                                 f"order: move {where} aside to resume at the step-derived "
                                 "position")
        steps = {int(s["step"]) for s in parts}
        if len(steps) > 1:
            raise DataStateError(f"{where}: the hosts' data states are at different steps "
                                 f"{sorted(steps)}")
        union: dict[str, Any] = {}
        for s in parts:
            union.update(s["streams"])
        return {"format": FORMAT, "step": steps.pop(), "num_streams": parts[0]["num_streams"],
                "streams": union}
    if (process_index, process_count) in saved:
        return None
    n = sorted({n for _, n in saved})[0]
    first = next(iter(saved.values()))
    what = ("streaming resume needs the same host count" if isinstance(first, dict)
            and "reader" in first else "a per-host data state resumes only on its host count")
    raise DataStateError(f"{where}: {what} (saved on {n} process(es), this job has "
                         f"{process_count})")


_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")  # grain's per-process file name


def checkpointable(iterator: Any) -> bool:
    """Whether a checkpoint holds ``iterator``'s state: a grain iterator (or any with
    ``get_state`` / ``set_state``)."""
    return isinstance(iterator, grain.DatasetIterator) or (
        hasattr(iterator, "get_state") and hasattr(iterator, "set_state"))


def saved_states(data_dir: str | epath.Path) -> dict[tuple[int, int], Any]:
    """``{(process, count): parsed state}`` of every host's file in a checkpoint step's data
    item; ``{}`` without one. A file that does not parse raises here (a damaged step)."""
    data_dir = epath.Path(data_dir)
    if not data_dir.exists():
        return {}
    out: dict[tuple[int, int], Any] = {}
    for path in sorted(data_dir.iterdir()):
        m = _STATE_FILE.fullmatch(path.name)
        if m:
            out[int(m.group(1)), int(m.group(2))] = json.loads(path.read_text())
    return out


def restore(iterator: Any, data_dir: str | epath.Path, process_index: int,
            process_count: int) -> bool:
    """Restore ``iterator`` in place from a checkpoint step's data item; False when there is
    nothing to restore (no checkpointable iterator, no data item). A data-stream state is
    merged from every host's file of the saving run (``global_state``), so any host count
    resumes it; a per-host state (streaming, an injected iterator) is read from this layout's
    own file, as grain's checkpoint handler reads it."""
    if not checkpointable(iterator):
        return False
    saved = saved_states(data_dir)
    if not saved:
        return False
    fresh = iterator.get_state()
    ours = isinstance(fresh, dict) and fresh.get("format") == FORMAT
    state = global_state(saved, str(data_dir), process_index, process_count, streams=ours)
    if state is None:
        text = (epath.Path(data_dir) / f"process_{process_index}-of-{process_count}.json"
                ).read_text()
        state = json.loads(text) if isinstance(iterator, grain.DatasetIterator) else text.encode()
    try:
        iterator.set_state(state)
    except DataStateError as e:
        raise DataStateError(f"{data_dir}: {e}") from None
    if hasattr(iterator, "start_prefetch"):
        iterator.start_prefetch()
    return True
