"""The modalities: one definition, in one order, for every part of the loader."""

from __future__ import annotations

MODALITIES: tuple[str, ...] = ("text", "image", "video", "audio")
"""The decoded modalities, each with its decoder, pool and batch entry."""

META = "meta"
"""Fields kept as values (labels, JSON, ...), not decoded by a modality's decoder."""

FIELD_MODALITIES: tuple[str, ...] = (*MODALITIES, META)
"""Every modality a field can have."""
