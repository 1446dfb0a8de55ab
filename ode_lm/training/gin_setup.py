"""Gin wiring (t5x style): configurable classes, the ``train`` entry and flag parsing.

Flags: ``--gin_file=F`` (repeatable), ``--gin_bindings='A.b = 1'`` (repeatable),
``--gin.NAME=VALUE`` (shorthand for a binding; a bare word VALUE is taken as a string) and
``--gin_search_paths=a,b``. Files are parsed first in order, then bindings in order, so
later ones win. The package's ``configs/`` directory is always on the search path.
A command-line macro (``--gin.NAME=V``) that no loaded config references is an error
(``check_cli_macros``), as gin itself makes an unknown configurable or parameter one.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import os
import pathlib
import tokenize
from collections.abc import Sequence

import gin

from ode_lm.config_types import register_with_gin
from ode_lm.data.config import DataConfig
from ode_lm.errors import UsageError
from ode_lm.models.config import ModelConfig
from ode_lm.training.checkpoint import CheckpointConfig
from ode_lm.training.optim import OptimizerConfig
from ode_lm.training.step import StepConfig
from ode_lm.training.trainer import MeshConfig, TrainConfig, Trainer, TrainResult

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


GinModelConfig = register_with_gin(ModelConfig)
GinDataConfig = register_with_gin(DataConfig)
GinOptimizerConfig = register_with_gin(OptimizerConfig)
GinStepConfig = register_with_gin(StepConfig)
GinCheckpointConfig = register_with_gin(CheckpointConfig)
GinMeshConfig = register_with_gin(MeshConfig)
GinTrainConfig = register_with_gin(TrainConfig)


@dataclasses.dataclass
class GinFlags:
    files: list[str] = dataclasses.field(default_factory=list)
    bindings: list[str] = dataclasses.field(default_factory=list)
    search_paths: list[str] = dataclasses.field(default_factory=list)
    rest: list[str] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)  # the flag of each binding


def _binding_value(value: str) -> str:
    """Keep gin literals/references; quote a bare word so --gin.MODEL_DIR=/tmp/x works."""
    stripped = value.strip()
    if stripped[:1] in "@%([{'\"" or stripped in ("True", "False", "None"):
        return stripped
    try:
        ast.literal_eval(stripped)
        return stripped
    except (ValueError, SyntaxError):
        return repr(stripped)


def parse_flags(argv: Sequence[str]) -> GinFlags:
    """Split argv into gin files, bindings and search paths (other flags are returned)."""
    flags = GinFlags()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if not eq and name in ("--gin_file", "--gin_bindings", "--gin_search_paths"):
            if i + 1 >= len(args):
                raise UsageError(f"flag {name} needs a value")
            i += 1
            value = args[i]
        if name == "--gin_file":
            flags.files.append(value)
        elif name == "--gin_bindings":
            flags.bindings.append(value)
            flags.sources.append(f"--gin_bindings={value!r}")
        elif name == "--gin_search_paths":
            flags.search_paths.extend(p for p in value.split(",") if p)
        elif name.startswith("--gin."):
            if not eq:
                raise UsageError(f"flag {arg!r}: expected --gin.NAME=VALUE")
            flags.bindings.append(f"{name[len('--gin.'):]} = {_binding_value(value)}")
            flags.sources.append(arg)
        else:
            flags.rest.append(arg)
        i += 1
    return flags


def parse_gin(flags: GinFlags) -> None:
    """Parse files then bindings; gin's error (unknown configurable/parameter) stops here."""
    gin.clear_config()
    for path in [*flags.search_paths, str(CONFIGS_DIR), os.getcwd()]:
        gin.add_config_file_search_path(path)
    for f in flags.files:
        if not os.path.exists(f) and not any(
            os.path.exists(os.path.join(p, f)) for p in [*flags.search_paths, str(CONFIGS_DIR)]
        ):
            raise FileNotFoundError(f"--gin_file={f}: no such file")
    for f in flags.files:
        try:
            gin.parse_config_file(f)
        except tokenize.TokenError as e:  # an unclosed bracket: gin lets tokenize's error out
            raise ValueError(f"--gin_file={f}: {e.args[0]} (an unclosed bracket?)") from None
    extra = flags.bindings[len(flags.sources):]
    sources = [*flags.sources, *(f"--gin_bindings={b!r}" for b in extra)]
    for binding, source in zip(flags.bindings, sources, strict=True):
        try:
            gin.parse_config(binding)
        except (SyntaxError, tokenize.TokenError) as e:  # gin's text names no flag
            msg = e.msg if isinstance(e, SyntaxError) else f"{e.args[0]} (an unclosed bracket?)"
            raise UsageError(f"{source}: {msg}") from None


def macro_values() -> dict[str, str]:
    """NAME -> value (gin's text) of every macro the parsed config defines, in the order they
    were first defined (files and their includes, then bindings): what ``--help`` lists."""
    from gin import config as gin_config

    return {scope: gin_config._format_value(params["value"])
            for (scope, selector), params in gin_config._CONFIG.items()
            if selector == "gin.macro" and "value" in params}


def _macro_key(binding: str) -> str | None:
    """NAME when the binding sets a macro (``NAME = v``, no configurable before a dot)."""
    key = binding.partition("=")[0].strip()
    return key if key.isidentifier() else None


def referenced_macros() -> set[str]:
    """Macros the parsed config refers to (``%NAME`` anywhere, in files or bindings)."""
    from gin import config as gin_config

    return {ref.config_key[0] for ref in gin_config.iterate_references(gin_config._CONFIG)
            if ref.config_key[1] == "gin.macro"}


def check_cli_macros(flags: GinFlags) -> None:
    """A macro set on the command line must be used by a loaded config: ``--gin.ODE_STEP=8``
    for ``ODE_STEPS`` would otherwise train the wrong model without a word."""
    used = referenced_macros()
    extra = flags.bindings[len(flags.sources):]  # GinFlags built in code, without sources
    sources = [*flags.sources, *(f"--gin_bindings={b!r}" for b in extra)]
    for binding, source in zip(flags.bindings, sources, strict=True):
        name = _macro_key(binding)
        if name is None or name in used:
            continue
        close = difflib.get_close_matches(name, sorted(used), n=1, cutoff=0.6)
        hint = (f"did you mean {close[0]}?" if close
                else f"the loaded configs use {', '.join(sorted(used)) or 'no macros'}")
        raise ValueError(f"{source}: no loaded config uses the macro {name} ({hint})")


def check_one_binding(entry: str, knobs: Sequence[str] = ("model_dir", "num_train_steps")) -> None:
    """``<entry>.model_dir`` / ``.num_train_steps`` set the TrainConfig fields of the same name;
    a ``TrainConfig.<knob>`` binding as well would be silently overridden: one name per knob."""
    for knob in knobs:
        try:
            value = gin.query_parameter(f"TrainConfig.{knob}")
        except ValueError:  # not bound: the one name is used
            continue
        raise ValueError(f"TrainConfig.{knob} = {value!r} is bound, but {entry}.{knob} sets "
                         f"it: bind {entry}.{knob} (the configs' macro) only")


@gin.configurable("train", module="ode_lm")
def train(
    model_dir: str = gin.REQUIRED,
    num_train_steps: int = gin.REQUIRED,
    model: ModelConfig = gin.REQUIRED,
    data: DataConfig = gin.REQUIRED,
    report_unigram_entropy: bool = False,
) -> TrainResult:
    """Build everything from gin and run the loop. Returns the TrainResult."""
    check_one_binding("train")
    trainer = Trainer(
        model_config=model,
        data_config=data,
        train_config=GinTrainConfig(model_dir=model_dir, num_train_steps=num_train_steps),
        optimizer_config=GinOptimizerConfig(),
        step_config=GinStepConfig(),
        checkpoint_config=GinCheckpointConfig(),
        mesh_config=GinMeshConfig(),
        operative_config=gin.operative_config_str,
    )
    result = trainer.run()
    if report_unigram_entropy:
        from ode_lm.training.corpus_stats import unigram_entropy

        result.eval["data/unigram_entropy"] = unigram_entropy(data)
    return result
