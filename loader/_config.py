"""What every config shares: the strict base model, YAML loading, and validation that fails in one line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ._config_errors import ConfigError, describe, yaml_error


class StrictModel(BaseModel):
    """A config model: unknown keys refused, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict.

    Raises ConfigError (one line) when the file cannot be read, is not YAML (``FILE:LINE:COLUMN:
    problem``) or does not hold a mapping at the top level.
    """
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8)") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping at the top level, found {type(data).__name__}")
    return data


_M = TypeVar("_M", bound=BaseModel)


def validated(
    model: type[_M],
    values: Mapping[str, Any],
    *,
    source: str | Path | None = None,
    section: Sequence[str] = (),
    flags: Mapping[str, str] | None = None,
) -> _M:
    """``model(**values)``, a ValidationError turned into a one-line ConfigError (see ``_config_errors.describe``).

    ``source``: the YAML file the values came from (named with the line of the bad key);
    ``section``: the keys above the model's in that file; ``flags``: key paths set by flags → flag names.
    """
    try:
        return model(**values)
    except ValidationError as exc:
        raise ConfigError(describe(exc, model, source=source, section=section, flags=flags)) from exc
