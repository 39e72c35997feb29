"""Hypothesis strategies that break valid documents: JSON and TOML trees, and the bytes of any file.

Used by the loader fuzzers (``tests/_fuzz_targets.py``). A document is mutated as a tree first (a
field dropped, a value replaced by a value of another type, a huge integer, NaN, a deeply nested
array, a duplicated key), then written with a writer of our own that can spell what ``json.dumps``
and a TOML writer refuse (``NaN``, ``1e400``, 100,000 nested arrays, duplicate keys), then possibly
broken as bytes (truncated at a random offset, bytes flipped or inserted, non-UTF-8 bytes, random
bytes).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

__all__ = ["Raw", "Pairs", "deep", "nasty_values", "mutated_tree", "dump_json", "dump_toml", "broken_bytes"]


@dataclass(frozen=True)
class Raw:
    """Text written as it is, in JSON and in TOML (``NaN``, ``1e400``, ``[[[...]]]``)."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """An object written with these (key, value) pairs in order: keys may repeat."""

    items: tuple[tuple[str, Any], ...]


def deep(depth: int, opener: str = "[", closer: str = "]") -> Raw:
    return Raw(opener * depth + closer * depth)


_DEPTHS = (40, 300, 1_000, 5_000, 100_000)
_SCALARS = (
    None, True, False, 0, -1, 1, 3, 2**31, -(2**31) - 1, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**400,
    0.5, -0.0, 1e-320, 1e308, -1e308, math.nan, math.inf, -math.inf,
    "", "x", "auto", "NVLINK", "\u0000", "é\u2028", "a\nb", "[1, 2]", "[/x]", "9" * 20,
)


@functools.cache  # one strategy object: hypothesis validates a new one on each draw (most of the time spent)
def nasty_values() -> st.SearchStrategy[Any]:
    """Values of the wrong type or out of every range, including ones no serialiser writes."""
    raw = st.sampled_from([Raw("NaN"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("9" * 5000),
                           Raw("0x10"), Raw("1_000"), Raw("01")])
    nested = st.sampled_from(_DEPTHS).map(deep)
    objects = st.sampled_from(_DEPTHS[:3]).map(lambda d: deep(d, '{"a":', "}"))
    small = st.recursive(
        st.sampled_from(_SCALARS) | st.integers() | st.floats() | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6,
    )
    return st.one_of(st.sampled_from(_SCALARS), raw, nested, objects, small)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys and indices) to a node of ``tree``, the root included."""
    out = [prefix]
    if isinstance(tree, dict):
        for key, value in tree.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            out += _paths(value, (*prefix, i))
    return out


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _mutate_at(tree: Any, path: tuple, op: str, value: Any, key: str) -> Any:
    if not path:
        if op == "replace":
            return value
        if op == "wrap":
            return [tree]
        if op == "drop" and isinstance(tree, (dict, list)) and tree:
            return tree[:-1] if isinstance(tree, list) else dict(list(tree.items())[1:])
        if op == "add" and isinstance(tree, dict):
            return {**tree, key: value}
        if op == "add" and isinstance(tree, list):
            return [*tree, value]
        if op == "dup" and isinstance(tree, dict) and tree:
            first = next(iter(tree))
            return Pairs((*tree.items(), (first, value)))
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict) and head in tree:
        if op == "drop" and not rest:
            return {k: v for k, v in tree.items() if k != head}
        return {**tree, head: _mutate_at(tree[head], rest, op, value, key)}
    if isinstance(tree, list) and isinstance(head, int) and head < len(tree):
        if op == "drop" and not rest:
            return tree[:head] + tree[head + 1:]
        return [*tree[:head], _mutate_at(tree[head], rest, op, value, key), *tree[head + 1:]]
    return tree


_OPS = st.sampled_from(["replace", "replace", "replace", "drop", "add", "wrap", "dup"])
_KEYS = st.text(max_size=5)


@st.composite
def mutated_tree(draw: st.DrawFn, seeds: list[Any], max_mutations: int = 3) -> Any:
    """One of ``seeds`` (JSON-like trees) with 0..``max_mutations`` mutations at random nodes."""
    tree = _copy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, max_mutations))):
        if isinstance(tree, Pairs):
            break
        paths = _paths(tree)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        op = draw(_OPS)
        tree = _mutate_at(tree, path, op, draw(nasty_values()), draw(_KEYS))
    return tree


def _json_float(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def dump_json(value: Any) -> str:
    """``value`` as JSON text; :class:`Raw`, :class:`Pairs`, NaN and Infinity written as they are."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump_json(v)}" for k, v in value.items) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump_json(v) for v in value) + "]"
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, (dt.date, dt.time)):
        return json.dumps(value.isoformat())
    return json.dumps(value)


def _toml_key(key: Any) -> str:
    return json.dumps(str(key), ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if value is None:
        return '""'  # TOML has no null: the nearest wrong value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Pairs):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def dump_toml(tree: Any) -> str:
    """A TOML document: one ``key = value`` line per top-level entry (tables written inline)."""
    items = tree.items if isinstance(tree, Pairs) else tree.items() if isinstance(tree, dict) else [("value", tree)]
    return "".join(f"{_toml_key(k)} = {_toml_value(v)}\n" for k, v in items)


@st.composite
def broken_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` unchanged (often), or truncated, with bytes flipped, inserted or replaced, or random."""
    op = draw(st.sampled_from(["keep"] * 4 + ["truncate", "flip", "insert", "non-utf8", "random", "empty"]))
    if op == "keep" or not data and op != "random":
        return data
    if op == "truncate":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    if op == "random":
        return draw(st.binary(max_size=200))
    if op == "empty":
        return b""
    at = draw(st.integers(0, len(data) - 1))
    if op == "flip":
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    junk = draw(st.binary(min_size=1, max_size=8)) if op == "insert" else draw(st.sampled_from(
        [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf"]))
    return data[:at] + junk + data[at:]
