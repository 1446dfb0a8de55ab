"""One type check for every config dataclass, run first in its ``__post_init__``, and the
value checks that follow it (``require*``): every setting is checked where it is made.

gin passes whatever the user wrote: ``--gin.TRAIN_STEPS=1.5`` must stop with
``TrainConfig.num_train_steps=1.5: expected an int`` instead of training "step 2/1.5". The
annotations are the contract: ints reject floats and bools, floats accept ints (coerced, so a
frozen config holds one type), tuples accept lists (gin writes ``[4, 8]`` as a list) and are
stored as tuples. Annotations this module does not understand (callables, ``Any``) pass.
Both raise ``errors.SettingError`` (exit 2 on the command line): one line naming the class,
the field and the value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Collection
from typing import Any, Union

from ode_lm.errors import SettingError, SettingTypeError

_NO_VALUE = object()


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple or tp is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple of {_describe(args[0]).split(' ', 1)[-1]}s"
        if args:
            return f"a tuple of {len(args)} ({', '.join(_describe(a) for a in args)})"
        return "a tuple"
    article = "an" if getattr(tp, "__name__", "x")[0] in "aeiou" else "a"
    return f"{article} {getattr(tp, '__name__', str(tp))}"


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (ints widened to float, lists to tuples), or _NO_VALUE."""
    if tp is Any or isinstance(tp, typing.TypeVar):
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _coerce(value, arg)
            if out is not _NO_VALUE:
                return out
        return _NO_VALUE
    if tp is type(None):
        return value if value is None else _NO_VALUE
    if tp is bool:
        return value if isinstance(value, bool) else _NO_VALUE
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value if ok else _NO_VALUE
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return _NO_VALUE
        return float(value)
    if tp is str:
        return value if isinstance(value, str) else _NO_VALUE
    if tp is tuple or origin is tuple:
        if not isinstance(value, tuple | list):
            return _NO_VALUE
        args = typing.get_args(tp)
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(v, args[0]) for v in value]
        elif len(args) == len(value):
            items = [_coerce(v, a) for v, a in zip(value, args, strict=True)]
        else:
            return _NO_VALUE
        return _NO_VALUE if any(i is _NO_VALUE for i in items) else tuple(items)
    return value  # callables, nested configs ...: their own checks


def check_types(config: Any) -> None:
    """Raise ``SettingTypeError('<Class>.<field>=<value>: expected <type>')`` (a TypeError)
    for a mistyped field.

    Coerced values (int → float, list → tuple) are written back, frozen or not."""
    cls = type(config)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(config):
        tp = hints.get(field.name, Any)
        value = getattr(config, field.name)
        out = _coerce(value, tp)
        if out is _NO_VALUE:
            raise SettingTypeError(
                f"{cls.__name__}.{field.name}={value!r}: expected {_describe(tp)}")
        if out is not value:
            object.__setattr__(config, field.name, out)



# ------------------------------------------------------------- value checks


def require(config: Any, field: str, ok: bool, why: str) -> None:
    """Unless ``ok``: ``SettingError('<Class>.<field>=<value>: <why>')``, the one line every
    config class refuses a value with (exit 2 on the command line)."""
    if not ok:
        value = getattr(config, field)
        raise SettingError(f"{type(config).__name__}.{field}={value!r}: {why}")


def require_one_of(config: Any, field: str, allowed: Collection[Any]) -> None:
    """``field`` is one of ``allowed`` (a solver, a dtype, a mode)."""
    require(config, field, getattr(config, field) in allowed,
            f"expected one of {tuple(allowed)}")


def require_at_least(config: Any, minimum: float, *fields: str) -> None:
    """Each of ``fields`` is ``>= minimum`` (a count; ``None``, where allowed, passes)."""
    for field in fields:
        value = getattr(config, field)
        require(config, field, value is None or value >= minimum, f"must be >= {minimum}")


def require_positive(config: Any, *fields: str) -> None:
    """Each of ``fields`` is a finite number ``> 0`` (a rate, a tolerance, a scale;
    ``None``, where allowed, passes)."""
    for field in fields:
        value = getattr(config, field)
        require(config, field, value is None or 0 < value < float("inf"),
                "must be a finite number > 0")


def require_fraction(config: Any, field: str, *, closed: bool = False) -> None:
    """``field`` is in [0, 1) (``closed``: [0, 1]): a share, a rate of dropout, a holdout."""
    value = getattr(config, field)
    ok = 0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0
    require(config, field, ok, f"must be in [0, {'1]' if closed else '1)'}")
