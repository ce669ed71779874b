"""Typed, validated configuration for indexing and planning (see docs/config.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from omnifeed.bucketing import BucketingConfig

from ._config_errors import ConfigError, describe, yaml_error

_DEFAULT_EXTENSIONS: dict[str, str] = {
    **dict.fromkeys(("jpg", "jpeg", "png", "webp"), "image"),
    **dict.fromkeys(("mp4", "webm", "mkv", "avi", "mov"), "video"),
    **dict.fromkeys(("flac", "wav", "mp3", "ogg", "m4a"), "audio"),
    **dict.fromkeys(("txt", "text"), "text"),
}
_MODALITY_NAMES = ("text", "image", "video", "audio", "meta")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IndexConfig(_Model):
    """How `omnifeed index` scans sources and writes the index."""

    partitions: int = Field(default=16, ge=1, le=1024, description="Parquet partitions, by hash of the sample key.")
    workers: int = Field(default=2, ge=1, le=1024, description="Processes scanning shards in parallel.")
    tokenizer: str = Field(
        default="regex",
        description="Text length measure: 'regex' (words and punctuation), 'whitespace', "
        "'bytes' (UTF-8 bytes), or 'module:function' returning a count or a token list.",
    )
    modalities: dict[str, str] = Field(
        default_factory=dict,
        description="Field name (lower-case extension, e.g. 'cap') -> modality; overrides the defaults.",
    )
    key_column: str = Field(default="__key__", description="Parquet column holding the sample key.")

    @field_validator("tokenizer")
    @classmethod
    def _known_tokenizer(cls, value: str) -> str:
        from ._text import make_token_counter

        make_token_counter(value)  # raises ValueError naming the choices
        return value

    @field_validator("modalities")
    @classmethod
    def _known_modalities(cls, value: dict[str, str]) -> dict[str, str]:
        for name, modality in value.items():
            if modality not in _MODALITY_NAMES:
                raise ValueError(f"field {name!r}: modality {modality!r} is not one of {', '.join(_MODALITY_NAMES)}")
        return {name.lower(): modality for name, modality in value.items()}

    def modality_of(self, field_name: str) -> str:
        """Modality of a field by its name: the override, else the last extension's default, else 'meta'."""
        name = field_name.lower()
        if name in self.modalities:
            return self.modalities[name]
        last = name.rsplit(".", 1)[-1]
        if last in self.modalities:
            return self.modalities[last]
        return _DEFAULT_EXTENSIONS.get(last, "meta")


class PlanConfig(_Model):
    """What fixes the global micro-batch sequence (with the index fingerprint and the epoch)."""

    seed: int = Field(default=0, ge=0, lt=2**63, description="Shuffle seed.")
    batch_size: int = Field(default=8, ge=1, description="Samples per micro-batch.")
    shuffle: Literal["permutation", "shard_block", "none"] = Field(
        default="permutation",
        description="'permutation': keyed pseudo-random permutation of all samples; "
        "'shard_block': shuffled shard order, shuffled within windows of shards (sequential reads); "
        "'none': index order.",
    )
    shards_per_window: int = Field(default=4, ge=1, description="Shards per shuffle window in 'shard_block' mode.")
    window_size: int | None = Field(
        default=None, ge=1,
        description="Samples per window of the shuffled stream (not in 'shard_block' mode, where a window is "
        "shards_per_window shards): micro-batches are formed window by window, and resuming computes one window. "
        "Default: 64 micro-batches for fixed-size batches, 65536 samples with bucketing (it needs hundreds of "
        "micro-batches per window to fill them tightly).",
    )
    bucketing: BucketingConfig | None = Field(
        default=None, description="Length-bucketed, cost-budgeted micro-batches or packing instead of batch_size."
    )
    drop_last: bool = Field(
        default=False,
        description="Drop each epoch's last, short micro-batch (its samples are reported, never silently lost); "
        "fixed-size batches only.",
    )

    @model_validator(mode="after")
    def _drop_last_needs_fixed_batches(self) -> PlanConfig:
        if self.drop_last and self.bucketing is not None:
            raise ValueError("drop_last applies to fixed-size batches; with bucketing no micro-batch is short")
        return self

    def fingerprint(self) -> str:
        """Stable hash of every setting that changes the micro-batch sequence."""
        values = self.model_dump()
        if self.bucketing is not None:  # the memory-feedback bounds steer budgets; the cursor records each
            values["bucketing"] = {k: v for k, v in values["bucketing"].items()
                                   if k not in ("min_budget", "max_budget", "target_headroom")}
        payload = json.dumps(values, sort_keys=True)
        return xxhash.xxh3_64_hexdigest(payload.encode())


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
