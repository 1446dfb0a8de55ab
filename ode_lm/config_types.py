"""One type check for every config dataclass, run first in its ``__post_init__``.

gin passes whatever the user wrote: ``--gin.TRAIN_STEPS=1.5`` must stop with
``TrainConfig.num_train_steps=1.5: expected an int`` instead of training "step 2/1.5". The
annotations are the contract: ints reject floats and bools, floats accept ints (coerced, so a
frozen config holds one type), tuples accept lists (gin writes ``[4, 8]`` as a list) and are
stored as tuples. Annotations this module does not understand (callables, ``Any``) pass.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

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
    """Raise ``TypeError('<Class>.<field>=<value>: expected <type>')`` for a mistyped field.

    Coerced values (int → float, list → tuple) are written back, frozen or not."""
    cls = type(config)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(config):
        tp = hints.get(field.name, Any)
        value = getattr(config, field.name)
        out = _coerce(value, tp)
        if out is _NO_VALUE:
            raise TypeError(f"{cls.__name__}.{field.name}={value!r}: expected {_describe(tp)}")
        if out is not value:
            object.__setattr__(config, field.name, out)

