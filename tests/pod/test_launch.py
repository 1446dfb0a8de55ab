"""launch/tpu_vm.sh against a fake `gcloud` that records its arguments and plays a pod.

The fake runs every `ssh --command` with bash in per-worker home folders (worker 0, 1),
with a fake `python3` that records its argv, so the remote commands are checked by
executing them, not by string matching alone.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "launch" / "tpu_vm.sh"
NUM_WORKERS = 2

FAKE_GCLOUD = """\
#!{python}
import json, os, pathlib, shutil, subprocess, sys
argv = sys.argv[1:]
root = pathlib.Path(os.environ["FAKE_TPU_ROOT"])
with open(root / "gcloud_calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\\n")
assert argv[:3] == ["compute", "tpus", "tpu-vm"], argv
verb = argv[3]
opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
workers = sorted(root.glob("worker*"))
if verb in ("create", "delete"):
    sys.exit(0)
if verb == "describe":
    states = (root / "vm_state").read_text().split()
    print(states[0])
    (root / "vm_state").write_text(" ".join(states[1:] or states))
    sys.exit(0)
targets = workers if opts.get("worker") == "all" else [root / ("worker" + opts["worker"])]
if verb == "scp":
    src, dest = [a for a in argv[4:] if not a.startswith("--")]
    for w in targets:
        shutil.copy(src, w / dest.split(":", 1)[1])
    sys.exit(0)
assert verb == "ssh", argv
rc = 0
for w in targets:
    env = dict(os.environ, HOME=str(w), FAKE_WORKER=w.name[len("worker"):],
               PATH=os.environ["FAKE_WORKER_BIN"] + ":" + os.environ["PATH"])
    rc |= subprocess.run(["bash", "-c", opts["command"]], cwd=w, env=env).returncode
sys.exit(rc)
"""

FAKE_PYTHON3 = """\
#!{python}
import json, os, pathlib, sys
home = pathlib.Path(os.environ["HOME"])
with open(home / "python3_calls.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["-m", "ode_lm.commands.train"]:
    codes = (home / "train_exit_codes").read_text().split()
    (home / "train_exit_codes").write_text(" ".join(codes[1:] or codes))
    print("worker", os.environ["FAKE_WORKER"], "step 5 loss 3.25", flush=True)
    sys.exit(int(codes[0]))
"""

FAKE_CURL = "#!/usr/bin/env bash\necho \"$FAKE_WORKER\"\n"


@pytest.fixture()
def pod(tmp_path):
    """A repo copy holding the script and a gin file, a fake pod, and a runner."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    (repo / "configs" / "runs").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "launch" / "tpu_vm.sh")
    (repo / "configs" / "runs" / "demo.gin").write_text("train.steps = 5\n")
    (repo / "ignored.txt").write_text("not shipped\n")
    (repo / ".gitignore").write_text("ignored.txt\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    root = tmp_path / "pod"
    for i in range(NUM_WORKERS):
        (root / f"worker{i}" / "ode-lm").mkdir(parents=True)  # for --skip_sync runs
        (root / f"worker{i}" / "train_exit_codes").write_text("0")
    (root / "vm_state").write_text("READY")
    bin_dir, worker_bin = tmp_path / "bin", tmp_path / "worker_bin"
    bin_dir.mkdir()
    worker_bin.mkdir()
    for path, text in [(bin_dir / "gcloud", FAKE_GCLOUD), (worker_bin / "python3", FAKE_PYTHON3),
                       (worker_bin / "curl", FAKE_CURL)]:
        path.write_text(text.format(python=sys.executable))
        path.chmod(0o755)
    env = dict(os.environ, FAKE_TPU_ROOT=str(root), FAKE_WORKER_BIN=str(worker_bin),
               PATH=f"{bin_dir}:{os.environ['PATH']}")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(repo / "launch" / "tpu_vm.sh"), *args], env=env,
                              capture_output=True, text=True, timeout=60)

    def calls() -> list[list[str]]:
        log = root / "gcloud_calls.jsonl"
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    def worker_calls(i: int) -> list[list[str]]:
        log = root / f"worker{i}" / "python3_calls.jsonl"
        return [json.loads(x) for x in log.read_text().splitlines()]

    return repo, root, run, calls, worker_calls


BASE = ["--tpu", "my-pod", "--zone", "us-east5-a", "--project=my-proj",
        "--gin_file", "configs/runs/demo.gin", "--gin.train.steps=7",
        "--gin.train.model_dir='gs://bucket/run 1'"]
SCOPE = ["--zone=us-east5-a", "--project=my-proj"]
TRAIN_ARGV = ["-m", "ode_lm.commands.train", "--gin_file=configs/runs/demo.gin",
              "--gin.train.steps=7", "--gin.train.model_dir='gs://bucket/run 1'"]


def _shape(call: list[str]) -> list[str]:
    """A gcloud call without its --command text, for comparing the command sequence."""
    return [a for a in call if not a.startswith("--command=")]


def test_full_run_on_all_workers(pod):
    repo, root, run, calls, worker_calls = pod
    res = run(*BASE, "--create", "--accelerator-type", "v5p-16", "--version=v2-alpha-tpuv5",
              "--spot")
    assert res.returncode == 0, res.stderr
    tpu = ["compute", "tpus", "tpu-vm"]
    assert [_shape(c) for c in calls()] == [
        tpu + ["create", "my-pod", *SCOPE, "--accelerator-type=v5p-16",
               "--version=v2-alpha-tpuv5", "--spot"],
        tpu + ["scp", calls()[1][4], "my-pod:ode-lm-src.tar.gz", "--worker=all", *SCOPE],
        tpu + ["ssh", "my-pod", "--worker=all", *SCOPE],  # unpack
        tpu + ["ssh", "my-pod", "--worker=all", *SCOPE],  # pip install
        tpu + ["ssh", "my-pod", "--worker=all", *SCOPE],  # start
        tpu + ["ssh", "my-pod", "--worker=0", *SCOPE],  # stream worker 0
        tpu + ["ssh", "my-pod", "--worker=0", *SCOPE],  # exit status
    ]
    for i in range(NUM_WORKERS):
        home = root / f"worker{i}"
        # synced: tracked/untracked files, not git-ignored ones
        assert (home / "ode-lm" / "configs" / "runs" / "demo.gin").exists()
        assert (home / "ode-lm" / "launch" / "tpu_vm.sh").exists()
        assert not (home / "ode-lm" / "ignored.txt").exists()
        assert worker_calls(i) == [["-m", "pip", "install", "-q", "-e", ".[tpu]"], TRAIN_ARGV]
        log = (home / "ode-lm" / "logs" / f"worker-{i}.log").read_text()
        assert f"worker {i} step 5 loss 3.25" in log
        assert (home / "ode-lm" / "logs" / f"exit-{i}").read_text().strip() == "0"
    assert "worker 0 step 5 loss 3.25" in res.stdout  # worker 0's log was streamed
    assert "worker 1" not in res.stdout


def test_retries_restart_after_failure(pod):
    repo, root, run, calls, worker_calls = pod
    for i in range(NUM_WORKERS):
        (root / f"worker{i}" / "train_exit_codes").write_text("1 0")
    res = run(*BASE, "--skip_sync", "--skip_install", "--retries=2")
    assert res.returncode == 0, res.stderr
    assert "restart 1 of 2" in res.stderr
    verbs = [c[3] for c in calls()]
    assert verbs == ["ssh", "ssh", "ssh", "describe", "ssh", "ssh", "ssh", "ssh"]
    assert "kill -TERM" in calls()[4][-1]  # stale job stopped before the restart
    for i in range(NUM_WORKERS):
        assert worker_calls(i) == [TRAIN_ARGV, TRAIN_ARGV]


def test_preempted_vm_is_recreated(pod):
    repo, root, run, calls, worker_calls = pod
    for i in range(NUM_WORKERS):
        (root / f"worker{i}" / "train_exit_codes").write_text("1 0")
    (root / "vm_state").write_text("PREEMPTED READY")
    res = run(*BASE, "--create", "--accelerator-type=v5p-16", "--version=v", "--retries=1",
              "--skip_install")
    assert res.returncode == 0, res.stderr
    verbs = [c[3] for c in calls()]
    # a re-created VM is fresh: it is synced and installed even under --skip_install
    assert verbs == ["create", "scp", "ssh", "ssh", "ssh", "ssh", "describe", "delete",
                     "create", "scp", "ssh", "ssh", "ssh", "ssh", "ssh"]
    assert 'pip install -q -e ".[tpu]"' in calls()[11][-1]
    pip = ["-m", "pip", "install", "-q", "-e", ".[tpu]"]
    for i in range(NUM_WORKERS):
        assert worker_calls(i) == [TRAIN_ARGV, pip, TRAIN_ARGV]


def test_failure_without_retries_exits_nonzero(pod):
    repo, root, run, calls, worker_calls = pod
    (root / "worker0" / "train_exit_codes").write_text("3")
    res = run(*BASE, "--skip_sync", "--skip_install")
    assert res.returncode == 1
    assert "failed on my-pod with status 3 after 1 attempt" in res.stderr


def test_stop_kills_the_job_on_all_workers(pod):
    repo, root, run, calls, worker_calls = pod
    procs = []
    for i in range(NUM_WORKERS):
        logs = root / f"worker{i}" / "ode-lm" / "logs"
        logs.mkdir(parents=True)
        p = subprocess.Popen(["setsid", "bash", "-c", "sleep 60 & wait"])
        procs.append(p)
        (logs / "train.pid").write_text(f"{p.pid}\n")
    time.sleep(0.2)
    try:
        res = run("--tpu", "my-pod", "--zone", "us-east5-a", "--stop")
        assert res.returncode == 0, res.stderr
        for p in procs:
            assert p.wait(timeout=10) == -signal.SIGTERM
        assert [c[3:6] for c in calls()] == [["ssh", "my-pod", "--worker=all"]]
        assert not (root / "worker0" / "ode-lm" / "logs" / "train.pid").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_dry_run_prints_every_command_and_runs_none(pod):
    repo, root, run, calls, worker_calls = pod
    res = run(*BASE, "--create", "--accelerator-type", "v5p-64", "--version", "v2-alpha-tpuv5",
              "--dry-run")
    assert res.returncode == 0, res.stderr
    assert calls() == []
    lines = res.stdout.splitlines()
    gcloud = [x for x in lines if x.startswith("gcloud ")]
    assert len(gcloud) == 6 and len(lines) == 7  # + the local tar line
    assert gcloud[0] == ("gcloud compute tpus tpu-vm create my-pod --zone=us-east5-a "
                         "--project=my-proj --accelerator-type=v5p-64 --version=v2-alpha-tpuv5")
    assert "--worker=all" in gcloud[1] and " scp " in gcloud[1]
    assert 'pip install -q -e ".[tpu]"' in gcloud[3]
    assert "python3 -m ode_lm.commands.train --gin_file=configs/runs/demo.gin" in gcloud[4]
    assert gcloud[5].endswith("-F ode-lm/logs/worker-0.log'") and "--worker=0" in gcloud[5]


def test_dry_run_commands_execute_as_printed(pod):
    """The printed start command, pasted into a shell, starts the same job."""
    repo, root, run, calls, worker_calls = pod
    res = run(*BASE, "--skip_sync", "--skip_install", "--dry-run")
    start = res.stdout.splitlines()[0]
    assert start.startswith("gcloud compute tpus tpu-vm ssh my-pod --worker=all")
    subprocess.run(["bash", "-c", start], check=True, env=_pod_env(pod), timeout=30)
    for i in range(NUM_WORKERS):
        for _ in range(100):
            if (root / f"worker{i}" / "ode-lm" / "logs" / f"exit-{i}").exists():
                break
            time.sleep(0.05)
        assert worker_calls(i) == [TRAIN_ARGV]


def _pod_env(pod) -> dict[str, str]:
    repo, root, *_ = pod
    tmp = root.parent
    return dict(os.environ, FAKE_TPU_ROOT=str(root), FAKE_WORKER_BIN=str(tmp / "worker_bin"),
                PATH=f"{tmp / 'bin'}:{os.environ['PATH']}")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zone", "z", "--gin_file", "configs/runs/demo.gin"], "--tpu NAME is required"),
        (["--tpu", "t", "--gin_file", "configs/runs/demo.gin"], "--zone ZONE is required"),
        (["--tpu", "t", "--zone", "z"], "at least one --gin_file is required"),
        (["--tpu", "t", "--zone", "z", "--gin_file", "no.gin"], "--gin_file 'no.gin' not found"),
        (["--tpu", "t", "--zone", "z", "--bogus"], "unknown argument '--bogus'"),
        (["--tpu", "t", "--zone", "z", "--retries", "x"], "--retries must be a non-negative"),
        (["--tpu", "--zone", "z"], "flag --tpu needs a value"),
        (["--tpu", "t", "--zone", "z", "--gin.oops"], "must have the form --gin.SCOPE.PARAM"),
        (["--tpu", "t", "--zone", "z", "--gin_file", "configs/runs/demo.gin", "--create",
          "--version", "v"], "--create needs --accelerator-type"),
    ],
)
def test_bad_input_is_a_clear_error(pod, args, message):
    repo, root, run, calls, worker_calls = pod
    res = run(*args)
    assert res.returncode == 2
    assert message in res.stderr
    assert calls() == []


def test_usage_text(pod):
    res = pod[2]("--help")
    assert res.returncode == 0
    assert res.stdout.startswith("Usage: launch/tpu_vm.sh --tpu NAME")
    for flag in ("--dry-run", "--stop", "--retries", "--create", "--gin_file", "--gin.X=Y"):
        assert flag in res.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_clean():
    res = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    assert textwrap.dedent(SCRIPT.read_text()).splitlines()[1:10].count("set -euo pipefail") == 1
