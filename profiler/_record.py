"""``record``: a frozen dataclass whose methods are shared, not generated per class.

``@dataclass`` writes the source of ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``,
``__setattr__`` and ``__delattr__`` for every class and compiles it when the module is
imported: for the profiler's ~18 classes that was ~100 M of the ~680 M instructions of a whole
``cpdpkit profile`` process on a small trace (valgrind), more than the rest of the profiler's
own imports together. ``record`` keeps ``@dataclass`` for the fields (``__dataclass_fields__``,
so ``dataclasses.replace``, ``fields`` and ``asdict`` work) and gives the class generic methods
that read those fields: the same behaviour as ``@dataclass(frozen=True)`` (positional and
keyword arguments, defaults and ``default_factory``, ``kw_only``, ``__post_init__``,
``field(compare=False, repr=False)``, ``FrozenInstanceError``, the same ``TypeError`` for a
missing or unexpected argument), a little slower per instance, which the profiler creates in
the hundreds, not millions. ``tests/test_profiler_record.py`` holds it to ``@dataclass``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform

__all__ = ["record"]

T = TypeVar("T")
_MISSING = dataclasses.MISSING


def _plan(cls: type) -> tuple[tuple, tuple, tuple, tuple, tuple]:
    """(positional names, keyword-only names, defaults by name as (name, default, factory),
    compared names, repr names) of the class's fields."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    positional = tuple(f.name for f in fields if not f.kw_only)
    keyword = tuple(f.name for f in fields if f.kw_only)
    defaults = tuple((f.name, f.default, f.default_factory) for f in fields)
    compared = tuple(f.name for f in dataclasses.fields(cls) if f.compare)
    shown = tuple(f.name for f in dataclasses.fields(cls) if f.repr)
    return positional, keyword, defaults, compared, shown


def _missing_error(name: str, missing: list[str], kind: str) -> TypeError:
    quoted = [repr(m) for m in missing]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
    plural = "" if len(missing) == 1 else "s"
    return TypeError(f"{name}.__init__() missing {len(missing)} required {kind} argument{plural}: {listed}")


def _make_init(cls: type, positional: tuple, keyword: tuple, defaults: tuple) -> Callable[..., None]:
    qual = cls.__qualname__
    names = set(positional) | set(keyword)
    post_init = getattr(cls, "__post_init__", None)
    setter = object.__setattr__
    required = sum(1 for name, default, factory in defaults
                   if name in positional and default is _MISSING and factory is _MISSING)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(positional):  # counted with self, as Python counts them
            most = len(positional) + 1
            takes = f"from {required + 1} to {most}" if required + 1 < most else most
            plural = "" if takes == 1 else "s"
            raise TypeError(f"{qual}.__init__() takes {takes} positional argument{plural} but {len(args) + 1} were "
                            "given")
        for name in kwargs:
            if name not in names:
                raise TypeError(f"{qual}.__init__() got an unexpected keyword argument {name!r}")
        values = dict(zip(positional, args))
        for name in kwargs:
            if name in values:
                raise TypeError(f"{qual}.__init__() got multiple values for argument {name!r}")
        values.update(kwargs)
        missing_pos: list[str] = []
        missing_kw: list[str] = []
        for name, default, factory in defaults:
            if name in values:
                continue
            if default is not _MISSING:
                values[name] = default
            elif factory is not _MISSING:
                values[name] = factory()
            else:
                (missing_kw if name in keyword else missing_pos).append(name)
        if missing_pos:
            raise _missing_error(qual, missing_pos, "positional")
        if missing_kw:
            raise _missing_error(qual, missing_kw, "keyword-only")
        for name, _, _ in defaults:
            setter(self, name, values[name])
        if post_init is not None:
            post_init(self)

    return __init__


def _frozen_error(self: Any, name: str, *_: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delete(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


@dataclass_transform(frozen_default=True)  # type checkers see a frozen dataclass (its __init__, fields)
def record(cls: type[T] | None = None, /, *, eq: bool = True, kw_only: bool = False) -> Any:
    """``@dataclass(frozen=True, eq=eq, kw_only=kw_only)`` with shared methods (module docstring)."""

    def wrap(cls_: type[T]) -> type[T]:
        cls_ = dataclasses.dataclass(cls_, init=False, repr=False, eq=False, kw_only=kw_only)  # fields only
        # the methods are set on the class object as dataclasses itself does (a dynamic class: Any)
        c: Any = cls_
        positional, keyword, defaults, compared, shown = _plan(c)
        c.__init__ = _make_init(c, positional, keyword, defaults)

        def __repr__(self: Any) -> str:
            inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in shown)
            return f"{type(self).__qualname__}({inner})"

        c.__repr__ = __repr__
        c.__setattr__ = _frozen_error
        c.__delattr__ = _frozen_delete
        if eq:
            def key(self: Any) -> tuple:
                return tuple(getattr(self, name) for name in compared)

            def __eq__(self: Any, other: object) -> bool:
                if other.__class__ is self.__class__:
                    return key(self) == key(other)
                return NotImplemented

            c.__eq__ = __eq__
            c.__hash__ = lambda self: hash(key(self))
        params = c.__dataclass_params__
        params.init = params.repr = params.frozen = True  # what dataclasses.replace and users read
        params.eq = eq
        return cls_

    return wrap if cls is None else wrap(cls)
