"""The loop's hooks (training/hooks.py) without a model: when each runs, in which order,
how a stop reaches the hooks after it, and what the save and eval hooks do at the end."""

from __future__ import annotations

import pytest

from ode_lm.training.hooks import Evaluate, Hooks, Save, StepInfo


def _info(step: int, total: int = 6, **kw) -> StepInfo:
    return StepInfo(step, total, {"params": f"params@{step}"}, None, **kw)


def test_a_hook_runs_every_nth_step_and_at_the_last_in_the_order_added():
    calls, hooks = [], Hooks()
    hooks.add(lambda info: calls.append(("a", info.step)), every=1)
    hooks.add(lambda info: calls.append(("b", info.step)), every=4)
    for step in range(1, 7):
        hooks.run(_info(step))
    assert [s for name, s in calls if name == "b"] == [4, 6]  # the 4th, and the last (6)
    assert calls[3:5] == [("a", 4), ("b", 4)]  # in the order added
    with pytest.raises(ValueError, match="every=0"):
        hooks.add(print, every=0)


def test_a_stop_set_by_a_hook_is_seen_by_the_hooks_after_it():
    seen, hooks = [], Hooks()

    def stop(info):
        info.stopped_by = "SIGTERM"

    hooks.add(lambda info: seen.append(("before", info.last)))
    hooks.add(stop)
    hooks.add(lambda info: seen.append(("after", info.last)))
    info = _info(2)
    hooks.run(info)
    assert seen == [("before", False), ("after", True)] and info.last


def test_hooks_that_are_context_managers_are_entered_around_the_loop():
    events = []

    class Installed:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

        def __call__(self, info):
            events.append(info.step)

    hooks = Hooks()
    hooks.add(Installed())
    hooks.add(lambda info: None)  # not a context manager: only called
    with hooks:
        hooks.run(_info(1))
    assert events == ["enter", 1, "exit"]


class _Checkpointer:
    def __init__(self, interval: int):
        self.interval, self.saved, self.waited, self.polled = interval, [], 0, []

    def should_save(self, step):
        return step % self.interval == 0

    def save(self, step, state, data, force=False):
        if force or self.should_save(step):
            self.saved.append(step)
            return True
        return False

    def wait(self):
        self.waited += 1

    def is_written(self, step):  # written by the step after the one that handed it over
        self.polled.append(step)
        return self.polled.count(step) > 1


class _Reader:
    def __init__(self):
        self.drained = []
        self.window = self

    def drain(self, *, dispatched):
        self.drained.append(dispatched)

    def restart(self):
        self.drained.append("restart")


def test_save_reads_the_metrics_first_writes_the_run_files_once_and_waits_at_the_end():
    ckpt, reader, files = _Checkpointer(2), _Reader(), []
    save = Save(ckpt, reader, lambda: files.append("run files"), saved=None)
    for step in range(1, 6):
        save(_info(step, total=5))
    assert ckpt.saved == [2, 4, 5] and save.saved == 5  # the interval, then the last step
    assert reader.drained == [2, 4, 5]  # before each save: no gap in the metrics
    assert files == ["run files"] and ckpt.waited == 1  # with the first; the last waits


def test_the_run_files_wait_until_their_checkpoint_is_written():
    ckpt, reader, files = _Checkpointer(2), _Reader(), []
    save = Save(ckpt, reader, lambda: files.append("run files"), saved=None)
    save(_info(2, total=9))  # handed over, not yet written: no config for it yet
    assert files == []
    save(_info(3, total=9))  # written now
    assert files == ["run files"]


def test_a_stop_saves_at_once_and_skips_the_eval():
    ckpt, reader = _Checkpointer(10), _Reader()
    save = Save(ckpt, reader, lambda: None, saved=3)
    evaluate = Evaluate(lambda params, step: {"eval/loss": float(step)},
                        lambda step, results: None, reader)
    save(_info(4, stopped_by="Ctrl-C"))
    evaluate(_info(4, stopped_by="Ctrl-C"))
    assert ckpt.saved == [4] and ckpt.waited == 1 and evaluate.results == {}
    evaluate(_info(6))  # the last step: the final eval, the window restarted after it
    assert evaluate.results == {"eval/loss": 6.0} and reader.drained[-2:] == [6, "restart"]
