"""The one gin owner (t5x style): every gin configurable is registered here (the config
classes, the ``train`` and ``finetune`` entries), the flags are parsed here, and every gin
text is read here (the run record's config changes, old runs' data settings, the bench
presets, sweep files). No other module imports gin except the gin CLIs' entry modules;
the layers below get what they need from gin handed in (``GinRecord``, ``run_dir``).
Over 400 lines for that reason: a second module for part of it would be a second gin owner.

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
from collections.abc import Iterator, Sequence
from typing import Any

import gin
from gin import config_parser

from ode_lm import compat
from ode_lm.data.config import DataConfig
from ode_lm.distributed import DistributedConfig
from ode_lm.errors import SettingError, UsageError
from ode_lm.finetune import FinetuneConfig, run_finetune
from ode_lm.harness.run import LmEval
from ode_lm.models.config import ModelConfig
from ode_lm.training.checkpoint import CheckpointConfig
from ode_lm.training.config import MeshConfig, TrainConfig
from ode_lm.training.evaluation import EvalHook, EvalSets, LossEval
from ode_lm.training.inputs import default_eval_data
from ode_lm.training.objective import TERMS
from ode_lm.training.optim import OptimizerConfig
from ode_lm.training.run_dir import RunDir
from ode_lm.training.step import StepConfig
from ode_lm.training.trainer import Trainer, TrainResult

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def register_with_gin(cls: type) -> Any:
    """``cls`` as a gin configurable in module ``ode_lm`` (bound as ``ClassName.field``);
    the existing one when the module is imported again (tests reload modules)."""
    try:
        return gin.external_configurable(cls, module="ode_lm")
    except ValueError:  # already registered
        return gin.get_configurable(cls.__name__)


GinModelConfig = register_with_gin(ModelConfig)
GinDataConfig = register_with_gin(DataConfig)
GinOptimizerConfig = register_with_gin(OptimizerConfig)
GinStepConfig = register_with_gin(StepConfig)
GinCheckpointConfig = register_with_gin(CheckpointConfig)
GinMeshConfig = register_with_gin(MeshConfig)
GinTrainConfig = register_with_gin(TrainConfig)
GinFinetuneConfig = register_with_gin(FinetuneConfig)
GinDistributedConfig = register_with_gin(DistributedConfig)
# the training objective's terms, listed by recipes: StepConfig.terms = [@KineticEnergy(), ...]
GinTerms = {cls.__name__: register_with_gin(cls) for cls in TERMS}


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
    return compat.gin_macros()


def _macro_key(binding: str) -> str | None:
    """NAME when the binding sets a macro (``NAME = v``, no configurable before a dot)."""
    key = binding.partition("=")[0].strip()
    return key if key.isidentifier() else None


def referenced_macros() -> set[str]:
    """Macros the parsed config refers to (``%NAME`` anywhere, in files or bindings)."""
    return compat.gin_macro_references()


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
        raise SettingError(f"TrainConfig.{knob} = {value!r} is bound, but {entry}.{knob} sets "
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
    train_config = GinTrainConfig(model_dir=model_dir, num_train_steps=num_train_steps)
    trainer = Trainer(
        model_config=model,
        data_config=data,
        train_config=train_config,
        optimizer_config=GinOptimizerConfig(),
        step_config=GinStepConfig(),
        checkpoint_config=GinCheckpointConfig(),
        mesh_config=GinMeshConfig(),
        config_record=GinRecord(),
        evals=in_loop_evals(train_config, data),
    )
    result = trainer.run()
    if report_unigram_entropy:
        from ode_lm.training.corpus_stats import unigram_entropies

        result.eval.update(unigram_entropies(data))
    return result


@gin.configurable("finetune", module="ode_lm")
def finetune(model_dir: str = gin.REQUIRED, num_train_steps: int = gin.REQUIRED,
             data: Any = gin.REQUIRED, print_fn=print):
    """Build the fine-tune from gin and run it (``ode_lm.finetune.run_finetune``); returns
    (TrainResult, trainable counts)."""
    check_one_binding("finetune")
    cfg = GinFinetuneConfig()
    train_config = GinTrainConfig(model_dir=model_dir, num_train_steps=num_train_steps)
    return run_finetune(
        cfg, data, train_config,
        optimizer_config=GinOptimizerConfig(), step_config=GinStepConfig(),
        checkpoint_config=GinCheckpointConfig(), mesh_config=GinMeshConfig(),
        config_record=GinRecord(), evals=in_loop_evals(train_config), read_run=run_dir,
        print_fn=print_fn)


def in_loop_evals(train_config: TrainConfig, data: Any = None) -> list[EvalHook]:
    """The trainer's in-loop evaluations from ``TrainConfig``, built (and checked) before any
    step: the loss at the model's own N, the depth sweep and ``eval_solves`` (also per eval
    set of a mixture, ``eval/<component>/...``); then the ``lm_eval_tasks``."""
    return [LossEval.from_config(train_config), *eval_set_evals(train_config, data),
            *LmEval.from_config(train_config)]


def query(name: str) -> Any:
    """The value bound to ``name`` (``configurable.parameter`` or a macro); ValueError if
    nothing is bound."""
    return gin.query_parameter(name)


def clear() -> None:
    """Forget every parsed binding (a tool that parses several runs' configs in turn)."""
    gin.clear_config()


# ------------------------------------------------------------------ reading gin text


class GinRecord:
    """The operative config as the trainer records it (``run_dir.ConfigRecord``): its text,
    the text as TensorBoard shows it, and the bindings that changed between two texts."""

    def text(self) -> str:
        return gin.operative_config_str()

    def markdown(self, text: str) -> str:
        return gin.markdown(text)

    def changes(self, old: str, new: str, model_dir: str | None = None) -> list[str]:
        return config_changes(old, new, model_dir=model_dir)


def run_dir(path: str) -> RunDir:
    """``RunDir(path)`` that also reads runs from before ``data_config.json``: their data
    settings, from the literal ``DataConfig.*`` bindings of their ``config.gin``."""
    return RunDir(path, legacy_bindings=lambda text: literal_bindings(text, "DataConfig"))


class _Reference:
    def __init__(self, name: str, macro: bool, evaluate: bool = False):
        self.name, self.macro, self.evaluate = name, macro, evaluate


class _Literals(config_parser.ParserDelegate):
    """gin parser delegate: keep macro names (to follow), mark configurable references."""

    def configurable_reference(self, scoped_name, evaluate):
        return _Reference(scoped_name, macro=False, evaluate=evaluate)

    def macro(self, macro_name):
        return _Reference(macro_name, macro=True)


def _bindings(text: str, delegate: Any = None) -> Iterator[config_parser.BindingStatement]:
    """The binding statements of a gin text (gin's parser; nothing registered or bound)."""
    for stmt in config_parser.ConfigParser(text, delegate or _Literals()):
        if isinstance(stmt, config_parser.BindingStatement):
            yield stmt


def literal_bindings(text: str, selector: str) -> dict[str, Any]:
    """``{arg: value}`` for the unscoped ``selector.arg = literal`` lines of a gin text,
    ``%MACRO`` values resolved through the text's macro lines; references are dropped."""
    bindings, macros = {}, {}
    for stmt in _bindings(text):
        if stmt.scope:
            continue
        if stmt.arg_name == "":  # NAME = value: a macro
            macros[stmt.selector] = stmt.value
        elif stmt.selector.split(".")[-1] == selector:
            bindings[stmt.arg_name] = stmt.value
    out = {}
    for name, value in bindings.items():
        for _ in range(8):
            if not (isinstance(value, _Reference) and value.macro):
                break
            value = macros.get(value.name)
        if not isinstance(value, _Reference):
            out[name] = value
    return out


def config_changes(old: str, new: str, limit: int = 6, *, model_dir: str | None = None
                   ) -> list[str]:
    """``NAME old → new`` for each binding or macro whose value differs between two
    operative gin configs (gin's parser, nothing bound); at most ``limit`` entries, then
    ``+k more``. Values are compared as values (a list of ``@Term()`` references by their
    names, ``1e-3`` equal to ``0.001``, a list equal to the tuple gin writes back), so a
    hand-edited or re-rendered file is no change. A binding whose new value is
    ``model_dir`` is where the run lives (a moved or copied run), not how it trains."""
    a, b = _gin_values(old), _gin_values(new)
    here = _canonical(model_dir) if model_dir is not None else None
    changes = [f"{k} {_shown(a.get(k, _UNSET))} → {_shown(b.get(k, _UNSET))}"
               for k in sorted(set(a) | set(b))
               if a.get(k, _UNSET) != b.get(k, _UNSET) and b.get(k, _UNSET) != here]
    if len(changes) > limit:
        changes = [*changes[:limit], f"+{len(changes) - limit} more"]
    return changes


def _gin_values(text: str) -> dict[str, Any]:
    out = {}
    for stmt in _bindings(text):
        key = stmt.selector if stmt.arg_name == "" else f"{stmt.selector}.{stmt.arg_name}"
        key = f"{stmt.scope}/{key}" if stmt.scope else key
        out[key] = _canonical(stmt.value)
    return out


class _Ref(tuple):
    """A configurable reference or macro as a comparable value: ``@name``, ``@name()``,
    ``%name``."""

    def __repr__(self) -> str:
        return "".join(self)


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


_UNSET = _Unset()


def _canonical(value: Any) -> Any:
    """A parsed gin value as something ``==`` compares by value: references by name,
    lists as tuples (what the config classes make of them), dicts by items."""
    if isinstance(value, _Reference):
        return _Ref(("%" if value.macro else "@", value.name,
                     "()" if value.evaluate else ""))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((k, _canonical(v)) for k, v in value.items()), key=repr))
    return value


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and not isinstance(value, _Ref):
        return "(" + ", ".join(map(_shown, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


class _MacrosInOrder(config_parser.ParserDelegate):
    """Resolves ``%MACRO`` from the macros defined earlier in the same file."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.macros: dict[str, Any] = {}

    def configurable_reference(self, scoped_name: str, evaluate: bool) -> str:
        return f"@{scoped_name}"

    def macro(self, macro_name: str) -> Any:
        if macro_name not in self.macros:
            raise ValueError(f"{self.path}: macro %{macro_name} is used before it is defined")
        return self.macros[macro_name]


def model_file_bindings(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(macros, ``ModelConfig`` bindings) of one model gin file (a bench preset), macros
    resolved in file order."""
    reader = _MacrosInOrder(path)
    bindings: dict[str, Any] = {}
    for stmt in _bindings(path.read_text(), reader):
        if not stmt.scope and not stmt.arg_name:  # NAME = value: a macro
            reader.macros[stmt.selector] = stmt.value
        elif stmt.selector == "ModelConfig" and not stmt.scope:
            value = stmt.value
            bindings[stmt.arg_name] = tuple(value) if isinstance(value, list) else value
    return reader.macros, bindings


class _LiteralsOnly(config_parser.ParserDelegate):
    """Files of plain values: configurable references and macros are errors."""

    def __init__(self, where: str):
        self.where = where

    def configurable_reference(self, scoped_name, evaluate):
        raise ValueError(f"{self.where}: @{scoped_name} not allowed in a sweep file "
                         "(literals only)")

    def macro(self, macro_name):
        raise ValueError(f"{self.where}: %{macro_name} not allowed in a sweep file "
                         "(literals only)")


def literal_statements(text: str, where: str) -> Iterator[tuple[str, str, Any] | None]:
    """``(selector, arg, value)`` of each statement of a file of plain values (a sweep
    file), None for a statement that is not a binding (an import, an include); a
    configurable reference or a macro is an error naming ``where``."""
    for stmt in config_parser.ConfigParser(text, _LiteralsOnly(where)):
        if isinstance(stmt, config_parser.BindingStatement):
            yield stmt.selector, stmt.arg_name, stmt.value
        else:
            yield None


def eval_set_evals(train_config: TrainConfig, data_config: Any) -> list[EvalHook]:
    """The per-eval-set losses (a mixture's components: ``eval/<name>/loss`` ...) at the
    settings ``LossEval.from_config`` evaluates; ``[]`` for one eval set."""
    from ode_lm import data as data_lib

    if not getattr(data_config, "mixture", None):
        return []
    sets = [(name, lambda mesh, rules, c=c: default_eval_data(c, mesh, rules))
            for name, c in data_lib.eval_configs(data_config)]
    return [EvalSets(LossEval.from_config(train_config).solves, sets)]
