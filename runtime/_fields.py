"""Reading a JSON object field by field, each error naming the field by its path
(`stages[1].parameters[3].shard.dim: expected an int or null, got 'x'`): the checks
`runtime.manifest` reads the manifest with."""

from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")


class _Bad(Exception):
    """What is wrong, with the field's path; the reader adds the file and the fix."""


def _check(what: str, ok: Callable[[Any], bool]) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> Any:
        if not ok(value):
            raise _Bad(f"{where}: expected {what}, got {value!r}")
        return value
    return check


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_int = _check("an int", _is_int)
_count = _check("a positive int", lambda v: _is_int(v) and v >= 1)
_opt_int = _check("an int or null", lambda v: v is None or _is_int(v))
_number = _check("a number", lambda v: _is_int(v) or isinstance(v, float))
_str = _check("a string", lambda v: isinstance(v, str))
_opt_str = _check("a string or null", lambda v: v is None or isinstance(v, str))
_bool = _check("true or false", lambda v: isinstance(v, bool))
_array = _check("a list", lambda v: isinstance(v, list))
_mapping = _check("an object", lambda v: isinstance(v, Mapping))
_top_key = _check("a string or an int", lambda v: isinstance(v, str) or _is_int(v))
_opt_ints_list = _check("a list of ints or nulls", lambda v: isinstance(v, list) and all(x is None or _is_int(x) for x in v))


def _key(value: Any, where: str) -> Any:
    """An input's key: a position or keyword, or (a list in JSON) a path into a nested input."""
    if isinstance(value, list) and len(value) >= 2 and all(isinstance(v, str) or _is_int(v) for v in value):
        return tuple(value)
    return _top_key(value, where)
_from = _check('a stage index or "input"', lambda v: v == "input" or _is_int(v))
_to = _check('a list of stage indices or "output"',
             lambda v: v == "output" or (isinstance(v, list) and all(_is_int(x) for x in v)))
_index = _check('an int or "tp"', lambda v: v == "tp" or _is_int(v))
_ints = _check("a list of ints", lambda v: isinstance(v, list) and all(_is_int(x) for x in v))
_strs = _check("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
_opt_ints = _check("a list of ints or null",
                   lambda v: v is None or (isinstance(v, list) and all(_is_int(x) for x in v)))


def _shape(value: Any, where: str) -> tuple[int, ...] | None:
    return None if _opt_ints(value, where) is None else tuple(value)


class _Obj:
    """A JSON object being read, with its path (`stages[1].parameters[3]`) for errors."""

    def __init__(self, data: Any, path: str) -> None:
        self.data: Mapping[str, Any] = _mapping(data, path or "the manifest")
        self.path = path

    def get(self, key: str, check: Callable[[Any, str], T], *default: T) -> T:
        if key not in self.data:
            if default:
                return default[0]
            owner = self.path or "it"
            if owner.startswith("stages[") and owner.endswith("]") and owner[7:-1].isdigit():
                owner = f"stage {owner[7:-1]}"
            raise _Bad(f"{owner} has no {key!r} field")
        return check(self.data[key], f"{self.path}.{key}" if self.path else key)

    def obj(self, key: str, read: Callable[[_Obj], T]) -> T:
        return read(_Obj(self.get(key, _mapping), f"{self.path}.{key}" if self.path else key))

    def each(self, key: str, read: Callable[[_Obj], T], optional: bool = False) -> tuple[T, ...]:
        items = self.get(key, _array, []) if optional else self.get(key, _array)
        where = f"{self.path}.{key}" if self.path else key
        return tuple(read(_Obj(item, f"{where}[{i}]")) for i, item in enumerate(items))
