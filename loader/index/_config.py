"""`IndexConfig`: how `omnifeed index` scans sources and writes the index (docs/config.md)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from .._config import StrictModel
from .._modalities import FIELD_MODALITIES

_DEFAULT_EXTENSIONS: dict[str, str] = {
    **dict.fromkeys(("jpg", "jpeg", "png", "webp"), "image"),
    **dict.fromkeys(("mp4", "webm", "mkv", "avi", "mov"), "video"),
    **dict.fromkeys(("flac", "wav", "mp3", "ogg", "m4a"), "audio"),
    **dict.fromkeys(("txt", "text"), "text"),
}


class IndexConfig(StrictModel):
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
    key_column: str = Field(
        default="__key__",
        description="Parquet/Arrow column holding the sample key. The default '__key__' is used when a file has it; "
        "a file without it gets the keys '<file stem>/<row>' (row: 0-based within the file). Another name must exist.",
    )
    strict: bool = Field(
        default=False,
        description="Refuse a whole shard at its first damaged sample (unreadable header, ...), instead of "
        "leaving that sample out, naming it, and indexing the rest.",
    )
    class_folders: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Folder sources: the class folder of each sample becomes an int64 'label' (sorted class names, "
        "as torchvision's ImageFolder). 'auto': when the layout is unmistakably ImageFolder's (every sample one "
        "image, video or audio file, one folder deep, in two or more folders); 'always': the top folder of every "
        "sample; 'never'.",
    )
    media_root: str | None = Field(
        default=None,
        description="Local folder under which Parquet/Arrow media cells holding only a path (datasets' to_parquet "
        "of local files) are read, confined to it as a folder source; None: such cells refuse their file.",
    )
    allow_meta_only: bool = Field(
        default=False,
        description="Index a folder whose samples carry no medium (no image, video, audio or text field) with a "
        "warning, instead of refusing it.",
    )

    @field_validator("tokenizer")
    @classmethod
    def _known_tokenizer(cls, value: str) -> str:
        from ._tokenizers import make_token_counter

        make_token_counter(value)  # raises ValueError naming the choices
        return value

    @field_validator("media_root")
    @classmethod
    def _local_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "://" in value or "::" in value:
            raise ValueError(
                f"{value!r}: give a local folder (media files are opened beneath it, without following "
                "links out of it), not a URL"
            )
        return os.path.abspath(os.path.expanduser(value))

    @field_validator("modalities")
    @classmethod
    def _known_modalities(cls, value: dict[str, str]) -> dict[str, str]:
        for name, modality in value.items():
            if modality not in FIELD_MODALITIES:
                raise ValueError(f"field {name!r}: modality {modality!r} is not one of {', '.join(FIELD_MODALITIES)}")
        return {name.lower(): modality for name, modality in value.items()}

    def explicit_modality(self, field_name: str) -> str | None:
        """The modality ``modalities`` gives a field (by its whole name, else its last extension), or None."""
        name = field_name.lower()
        if name in self.modalities:
            return self.modalities[name]
        return self.modalities.get(name.rsplit(".", 1)[-1])

    def modality_of(self, field_name: str) -> str:
        """Modality of a field by its name: the override, else the last extension's default, else 'meta'."""
        explicit = self.explicit_modality(field_name)
        if explicit is not None:
            return explicit
        return _DEFAULT_EXTENSIONS.get(field_name.lower().rsplit(".", 1)[-1], "meta")
