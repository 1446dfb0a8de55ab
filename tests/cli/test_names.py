"""Every option a message, docstring, doc page or config comment names exists: each
``Class.field`` of a gin configurable is a field of it, each ``--gin.X`` a binding (or a
macro some config defines) and each ``--flag`` a flag some ode-lm parser (a command, a tool,
a launch script) accepts. A renamed option otherwise leaves readers a name that fails.

docs/log.md is a dated history: it keeps the names of its day and is not scanned."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import gin
import pytest

REPO = Path(__file__).resolve().parents[2]

# (file, name): names the scan takes for options that are not, each with its reason
ALLOWED = {
    ("*", "--gin.NAME"): "the placeholder of the --gin.NAME=VALUE shorthand",
    ("*", "--gin.X"): "the placeholder of the --gin.X shorthand",
    ("ode_lm/commands/sweep.py", "--gin.Sweep.FIELD"): "placeholder for a Sweep field",
    ("ode_lm/commands/sweep.py", "--gin.Sweep"): "the --gin.Sweep.* prefix",
    ("ode_lm/commands/sweep.py", "Sweep.x"): "placeholder: Sweep.x=y overrides",
    ("ode_lm/harness/run.py", "TrainConfig.lm_eval"): "prefix of the lm_eval_* fields",
    ("ode_lm/gin_setup.py", "--gin.ODE_STEP"): "the example of a mistyped macro",
    ("ode_lm/cli.py", "--num_step"): "the example of an abbreviated flag",
    ("ode_lm/commands/train.py", "--logdir"): "tensorboard's flag",
    ("ode_lm/harness/run.py", "--model"): "lm_eval's flag",
    ("ode_lm/harness/adapter.py", "--model"): "lm_eval's flag",
    ("docs/benchmarks.md", "--no-deps"): "pip's flag",
    ("ode_lm/provenance.py", "--porcelain"): "git's flag",
}
# Stale names in files this change does not own; each is checked to still be there, so
# the entry goes once the file is fixed (then the scan covers the line).
PENDING: dict[tuple[str, str], str] = {}  # (file, name) -> the name it should be

FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)(?![\w.-])")
GIN_FLAG = re.compile(r"--gin\.([A-Za-z_][\w./]*)")
# where a doc line or a config comment names flags of ours: after an ode-lm command
COMMAND = re.compile(r"ode-lm\s|-m ode_lm\b|tools/\w+\.(?:py|sh)|launch/\w+\.sh")


def configurables() -> dict[str, set[str]]:
    """Each gin configurable of ode-lm (and the sweep file's ``Sweep``) -> its parameters."""
    from ode_lm import gin_setup
    from ode_lm.commands import sweep

    names = [n[3:] for n, v in vars(gin_setup).items()
             if n.startswith("Gin") and n[3:4].isupper() and isinstance(v, type)
             and n not in ("GinFlags", "GinRecord")]
    names += [*gin_setup.GinTerms, "train", "finetune"]
    out = {}
    for name in names:
        c = gin.get_configurable(name)  # raises if not registered
        fields = ({f.name for f in dataclasses.fields(c)} if dataclasses.is_dataclass(c)
                  else set(inspect.signature(c).parameters))
        out[name] = fields | {m for m in dir(c) if not m.startswith("_")}  # methods too
    out["Sweep"] = set(sweep.SWEEP_FIELDS)
    return out


def known_flags() -> set[str]:
    """Every flag an argparse parser in ode_lm/ or tools/ adds, and the shell scripts' own."""
    flags = {"--help", "--version"}
    for path in [*REPO.glob("ode_lm/**/*.py"), *REPO.glob("tools/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value.split("=")[0] for a in node.args if isinstance(a, ast.Constant)
                          and isinstance(a.value, str) and a.value.startswith("--")}
    for path in [*REPO.glob("tools/*.sh"), *REPO.glob("launch/*.sh")]:
        text = path.read_text()
        for arm in re.findall(r"^\s*([-\w|=*]+)\)", text, re.M):  # case arms
            flags |= {f.split("=")[0] for f in arm.split("|") if f.startswith("--")}
        flags |= set(re.findall(r'== "(--[\w-]+)"', text))
    return flags


def macros() -> set[str]:
    return {m for path in REPO.glob("configs/**/*.gin")
            for m in re.findall(r"^([A-Z][A-Z0-9_]*)\s*=", path.read_text(), re.M)}


def texts() -> Iterator[tuple[str, int, str]]:
    """(file, line, text): the string constants of ode_lm/, the doc pages' lines and the
    configs' comments."""
    for path in sorted(REPO.glob("ode_lm/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield str(path.relative_to(REPO)), node.lineno, node.value
    for path in [*sorted(REPO.glob("docs/*.md")), REPO / "README.md"]:
        if path.name != "log.md":
            for i, line in enumerate(path.read_text().splitlines(), 1):
                yield str(path.relative_to(REPO)), i, line
    for path in sorted(REPO.glob("configs/**/*.gin")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "#" in line:
                yield str(path.relative_to(REPO)), i, line[line.index("#"):]


def named_options(where: str, text: str, params: dict[str, set[str]], flags: set[str],
                  macro_names: set[str]) -> Iterator[str]:
    """The options ``text`` names that do not exist."""
    classes = "|".join(sorted(n for n in params if n[0].isupper()))
    for m in re.finditer(rf"(?<![\w.])({classes})\.([A-Za-z_]\w*)(?!\w*\*)", text):
        if m.group(2) not in params[m.group(1)]:
            yield m.group(0)
    for m in GIN_FLAG.finditer(text):
        name = m.group(1).rstrip(".")
        binding = name.split("/")[-1]  # a scope/ prefix
        if "." in binding:
            configurable, param = binding.split(".", 1)
            if param not in params.get(configurable, ()):
                yield f"--gin.{name}"
        elif name not in macro_names:
            yield f"--gin.{name}"
    if not where.endswith(".py"):  # prose: only flags given to one of our commands
        command = COMMAND.search(text)
        if command is None:
            return
        text = text[command.start():]
    for m in FLAG.finditer(text):
        if f"--{m.group(1)}" not in flags:
            yield f"--{m.group(1)}"


@pytest.fixture(scope="module")
def found() -> dict[tuple[str, str], list[int]]:
    params, flags, macro_names = configurables(), known_flags(), macros()
    out: dict[tuple[str, str], list[int]] = {}
    for where, line, text in texts():
        for name in named_options(where, text, params, flags, macro_names):
            out.setdefault((where, name), []).append(line)
    return out


def test_every_named_option_exists(found):
    unknown = {f"{where}:{lines[0]}: {name}" for (where, name), lines in found.items()
               if (where, name) not in ALLOWED and ("*", name) not in ALLOWED
               and (where, name) not in PENDING}
    assert not unknown, sorted(unknown)


def test_pending_names_are_still_there(found):
    """Drop an entry of PENDING once its file is fixed."""
    assert not [k for k in PENDING if k not in found]


def test_the_scan_finds_a_wrong_name():
    params = {"StepConfig": {"terms"}, "train": {"model"}}
    bad = list(named_options("x.md", "ode-lm train --gin.StepConfig.distill_weight=1 --nope "
                             "StepConfig.terms StepConfig.recipe --steps", params,
                             {"--steps"}, set()))
    assert bad == ["StepConfig.recipe", "--gin.StepConfig.distill_weight", "--nope"]
