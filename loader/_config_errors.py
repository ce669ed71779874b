"""One-line config errors: a YAML syntax error or a pydantic ValidationError, said the way a user can act on.

``ConfigError`` messages name the file (with line and column where known), the key path
(``feed.pools.image.workers``) and what is allowed: the closest valid key of a misspelled one
(``difflib.get_close_matches``), the range of a number out of range, the expected type. The
first error is shown, then how many more there are.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ._errors import OmnifeedError

_BOUNDS = (("ge", "at least"), ("gt", "greater than"), ("le", "at most"), ("lt", "less than"))
_SHOWN_VALUE = 40  # characters of a bad value quoted in a message


class ConfigError(OmnifeedError, ValueError):
    """A config file or value is invalid; the message is one line naming where and what is allowed."""


def yaml_error(path: str | Path, exc: Exception) -> ConfigError:
    """A YAML parse error as ``FILE:LINE:COLUMN: problem``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return ConfigError(f"{where}: {problem} (not valid YAML)")


def describe(
    exc: ValidationError,
    model: type[BaseModel] | None = None,
    *,
    source: str | Path | None = None,
    section: Sequence[str] = (),
    flags: Mapping[str, str] | None = None,
) -> str:
    """One line for a ValidationError: its first error, then ``(and N more)``.

    ``model``: the class validated (for valid key names and ranges); ``source``: the YAML file the
    values came from; ``section``: the keys above the model's in that file (``("plan",)``);
    ``flags``: dotted key paths that came from command-line flags instead → the flag's name.
    """
    errors = exc.errors()
    first = errors[0]
    loc = tuple(str(part) for part in first["loc"])
    dotted = ".".join((*section, *loc))
    flag = next((flags[key] for key in _prefixes(".".join(loc)) if flags and key in flags), None)
    if flag is not None:
        where, subject, equals = flag, flag, " "
    else:
        equals = " = "
        position = _position(source, (*section, *loc)) if source is not None else None
        where = f"{source}:{position[0]}:{position[1]}" if position else (str(source) if source else "")
        subject = dotted or (model.__name__ if model else exc.title)
    text = _explain(first, model, loc, subject, equals)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {text}{more}" if where and where != subject else f"{text}{more}"


def _prefixes(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _explain(error: Any, model: type[BaseModel] | None, loc: tuple[str, ...], subject: str, equals: str) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    container, info = _walk(model, loc) if model is not None else (None, None)
    if kind == "extra_forbidden":
        valid = sorted(container.model_fields) if container is not None else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6) if loc else []
        hint = f"did you mean {close[0]!r}?" if close else (f"valid keys: {', '.join(valid)}" if valid else "")
        return f"{subject}: unknown key" + (f"; {hint}" if hint else "")
    if kind == "missing":
        return f"{subject}: missing (a required key)"
    value = _shown(error.get("input"))
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = _bounds(info) or {name: ctx[name] for name, _ in _BOUNDS if name in ctx}
        return f"{subject}{equals}{value}: out of range, must be {_range(bounds)}"
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if message.startswith("Input should"):
        return f"{subject}{equals}{value}: {message.removeprefix('Input ')}"
    return f"{subject}: {message}" if loc else message


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_VALUE else text[: _SHOWN_VALUE - 3] + "..."


def _bounds(info: FieldInfo | None) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for constraint in info.metadata if info is not None else ():
        for name, _ in _BOUNDS:
            if getattr(constraint, name, None) is not None:
                found[name] = getattr(constraint, name)
    return found


def _range(bounds: Mapping[str, Any]) -> str:
    if "ge" in bounds and "le" in bounds:
        return f"from {bounds['ge']} to {bounds['le']}"
    return " and ".join(f"{words} {bounds[name]}" for name, words in _BOUNDS if name in bounds)


def _walk(model: type[BaseModel], loc: tuple[str, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model class that holds ``loc``'s last key, and that key's field (None where the walk leaves models)."""
    current: Any = model
    container: type[BaseModel] | None = None
    info: FieldInfo | None = None
    for part in loc:
        container, info, mapping_value = _model_in(current), None, _mapping_value(current)
        if container is None:
            if mapping_value is None:
                return None, None
            current = mapping_value  # a dict's key (``pools.image``): step into its value type
            continue
        if part not in container.model_fields:
            return container, None
        info = container.model_fields[part]
        current = info.annotation
    return container, info


def _members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Annotated:
        return _members(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(m for arg in get_args(annotation) for m in _members(arg))
    return (annotation,)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _mapping_value(annotation: Any) -> Any:
    for member in _members(annotation):
        if get_origin(member) in (dict, Mapping) and len(get_args(member)) == 2:
            return get_args(member)[1]
    return None


def _position(source: str | Path, keys: Sequence[str]) -> tuple[int, int] | None:
    """(line, column) of the deepest of ``keys`` found in the YAML file, 1-based; None when not found."""
    import yaml

    try:
        node = yaml.compose(Path(source).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    mark = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(
            (pair for pair in node.value if isinstance(pair[0], yaml.ScalarNode) and pair[0].value == key), None
        )
        if match is None:
            break
        mark, node = match[0].start_mark, match[1]
    return (mark.line + 1, mark.column + 1) if mark is not None else None
