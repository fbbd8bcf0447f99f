"""How a typed message crosses the workers' channel: a dataclass as a JSON array of its fields, in order, checked
field by field against its annotations when it arrives.

Positional arrays rather than objects: the channel carries every admit and release of every worker, and both
ends are the same build of the gateway (the authority starts its workers from its own code), so names would only
cost bytes. The checks are compiled once per class (``decoder``, ``encoder``) from the annotations:

- ``int``, ``bool``, ``str``: that exact JSON type (a bool is no int here); ``float``: any JSON number;
- ``X | None``; ``tuple[X, ...]`` and ``tuple[A, B]`` from arrays; ``dict[str, X]`` and ``dict[int, X]`` from
  objects (orjson writes int keys as their digits);
- ``Sequence[int]`` (a prompt's token ids, up to a context's worth): ``array('q')``'s bytes, little-endian, in
  hex. As a JSON array of numbers, 1,000 ids (of a 150k vocabulary) cost 32 us to decode (orjson's integers,
  then the array, on the authority's core) and 15 us to encode; in hex 14 and 6 us, in base64 28 and 9 (CPU
  time, best of 5 x 5,000 on the 2-core machine). Every 8 bytes are a 64-bit id: only the digits and the length
  can be wrong;
- a nested dataclass: an array of its fields; ``Any``: as it came.

Anything else is ``Malformed``: the channel logs it and closes (``channel.py``).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import types
import typing
from array import array
from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[Any], Any]
Encode = Callable[[Any], Any]

_ID_BYTES = array("q").itemsize  # 8
_SWAP = sys.byteorder != "little"  # ids cross little-endian


class Malformed(ValueError):
    """A message that is not what its kind says: a bug of ours on the other end, never a client's doing."""

    droppable = False  # nothing waits on a message of its kind nor counts by it: dropped, the channel kept


def _exact(kind: type) -> Decode:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise Malformed(f"{kind.__name__} expected, got {type(value).__name__}")
        return value

    return check


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise Malformed(f"a number expected, got {type(value).__name__}")


def _ids(value: Any) -> array[int]:
    if type(value) is not str:
        raise Malformed(f"token ids in hex expected, got {type(value).__name__}")
    try:
        raw = bytes.fromhex(value)
    except ValueError as exc:
        raise Malformed(f"token ids in hex expected ({exc})") from None
    if len(raw) % _ID_BYTES:
        raise Malformed(f"token ids of {_ID_BYTES} bytes each expected, got {len(raw)} bytes")
    ids = array("q")
    ids.frombytes(raw)
    if _SWAP:
        ids.byteswap()
    return ids


def _any(value: Any) -> Any:
    return value


def _optional(inner: Decode) -> Decode:
    def check(value: Any) -> Any:
        return None if value is None else inner(value)

    return check


def _list_of(value: Any) -> list[Any]:
    if type(value) is not list:
        raise Malformed(f"an array expected, got {type(value).__name__}")
    return value


def _tuple(args: tuple[Any, ...]) -> Decode:
    if len(args) == 2 and args[1] is Ellipsis:
        item = decoder(args[0])
        return lambda value: tuple([item(x) for x in _list_of(value)])
    items = [decoder(a) for a in args]
    size = len(items)

    def fixed(value: Any) -> tuple[Any, ...]:
        if len(_list_of(value)) != size:
            raise Malformed(f"an array of {size} expected, got {len(value)}")
        return tuple([check(x) for check, x in zip(items, value, strict=True)])

    return fixed


def _int_key(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise Malformed(f"an integer key expected, got {key[:40]!r}") from None


def _dict(key_type: Any, value_type: Any) -> Decode:
    value_of = decoder(value_type)
    if key_type is str:
        key_of: Decode = _any  # JSON's keys are strings
    elif key_type is int:
        key_of = _int_key
    else:
        raise TypeError(f"no decoder for keys of {key_type!r}")

    def check(value: Any) -> dict[Any, Any]:
        if type(value) is not dict:
            raise Malformed(f"an object expected, got {type(value).__name__}")
        return {key_of(k): value_of(v) for k, v in value.items()}

    return check


_EXACT = (int, bool, str)


def _dataclass(cls: type) -> Decode:
    """The class's decoder, written out as Python (as ``dataclasses`` writes ``__init__``): a field of an exact type
    is checked inline, without a call; measured, a third of the cost of a call per field."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    scope: dict[str, Any] = {"cls": cls, "Malformed": Malformed, "list": list}
    lines = [
        "def build(value):",
        f"    if type(value) is not list or len(value) != {len(fields)}:",
        f"        raise Malformed('{cls.__name__}: an array of its {len(fields)} fields expected')",
    ]
    if fields:
        lines.append(f"    {', '.join(f'v{i}' for i in range(len(fields)))}, = value")
    args = []
    for i, name in enumerate(fields):
        tp, arg = hints[name], f"v{i}"
        inner, optional = _optional_of(tp)
        if inner in _EXACT:
            scope[f"t{i}"] = inner
            none = f"v{i} is not None and " if optional else ""
            lines += [f"    if {none}type(v{i}) is not t{i}:",
                      f"        raise Malformed('{cls.__name__}.{name}: {inner.__name__} expected')"]
        elif tp is not Any:
            scope[f"c{i}"] = decoder(tp)
            arg = f"c{i}(v{i})"
        args.append(arg)
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), scope)  # our own text, from the class's annotations
    build: Decode = scope["build"]
    return build


def _optional_of(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


_SIMPLE: dict[Any, Decode] = {
    int: _exact(int), bool: _exact(bool), str: _exact(str), float: _float, Any: _any, type(None): _exact(type(None)),
}


def decoder(tp: Any) -> Decode:
    """A function from what ``orjson.loads`` gave to a value of type ``tp``, or ``Malformed``."""
    simple = _SIMPLE.get(tp)
    if simple is not None:
        return simple
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return _optional(decoder(next(a for a in args if a is not type(None))))
    if origin is tuple:
        return _tuple(args)
    if origin is dict:
        return _dict(*args)
    if origin is Sequence and args == (int,):
        return _ids
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass(tp)
    raise TypeError(f"no decoder for {tp!r}")


def _seq_encoder(item: Encode) -> Encode:
    return lambda value: [item(x) for x in value]


def _ids_out(value: Any) -> Any:
    ids = value if isinstance(value, array) and value.typecode == "q" else array("q", value)
    if _SWAP:
        ids = array("q", ids)
        ids.byteswap()
    return ids.tobytes().hex()


def encoder(tp: Any) -> Encode | None:
    """A function from a value of type ``tp`` to what orjson writes as JSON; None: orjson writes it as it is."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [encoder(a) for a in args if a is not type(None)]
        if len(inner) == 1 and inner[0] is not None:
            some = inner[0]
            return lambda value: None if value is None else some(value)
        return None
    if origin is tuple:
        parts = [encoder(a) for a in args if a is not Ellipsis]
        if not any(parts):
            return None
        if args[-1] is Ellipsis:
            assert parts[0] is not None
            return _seq_encoder(parts[0])
        return lambda value: [e(x) if e else x for e, x in zip(parts, value, strict=True)]
    if origin is dict:
        value_out = encoder(args[1])
        return None if value_out is None else (lambda value: {k: value_out(v) for k, v in value.items()})
    if origin is Sequence:
        return _ids_out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_encoder(tp)
    return None


def _dataclass_encoder(cls: type) -> Encode:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    parts = [encoder(hints[name]) for name in names]
    if len(names) == 0:
        return lambda value: []
    if len(names) == 1:
        (only,), (part,) = names, parts
        return (lambda value: [getattr(value, only)]) if part is None else (lambda value: [part(getattr(value, only))])
    fields = operator.attrgetter(*names)  # one C call for every field
    if not any(parts):
        return fields  # a tuple: orjson writes it as an array
    return lambda value: [e(x) if e else x for e, x in zip(parts, fields(value), strict=True)]
