"""The seams the package keeps, read from its source (nothing imported or run): the run
directory's file names have one owner, gin has one owner, and the trainer does not reach
up into the lm-eval harness (which imports ``training.evaluation``)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ode_lm"
RUN_FILES = {"metrics.jsonl", "sharding.txt", "run.lock", "model_config.json",
             "data_config.json", "finetune.json", "finetune_result.json", "checkpoints",
             "config.gin"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text())


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_only_run_dir_spells_a_run_file_name():
    spelled = {(name, node.value) for name, tree in _modules()
               for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value in RUN_FILES}
    assert {name for name, _ in spelled} == {"ode_lm/training/run_dir.py"}, spelled


def test_only_the_gin_owner_and_compat_import_gin():
    users = {name for name, tree in _modules()
             if any(m == "gin" or m.startswith("gin.") for m in _imports(tree))}
    assert users == {"ode_lm/gin_setup.py", "ode_lm/compat.py"}


def test_training_imports_neither_the_harness_nor_the_gin_layer():
    for name, tree in _modules():
        if name.startswith("ode_lm/training/"):
            up = {m for m in _imports(tree)
                  if m.startswith(("ode_lm.harness", "ode_lm.gin_setup", "ode_lm.commands"))}
            assert not up, (name, up)
