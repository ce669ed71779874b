"""ImageFolder labels: a folder source's class folders as an int64 ``label`` field (``IndexConfig.class_folders``).

torchvision's ``ImageFolder`` and the ``datasets`` imagefolder loader take a sample's class from the
folder it is in; so does omnifeed:

- ``auto`` (the default): when the layout is unmistakable: every sample is one image, video or
  audio file, one folder deep (``ROOT/CLASS/name.ext``), in two or more class folders. Both
  libraries give the same classes there (``datasets`` takes the file's own folder and wants every
  file at one depth, torchvision the top folder);
- ``always``: the top folder of every sample's path, at any depth (torchvision's rule); a sample
  file at the top of the folder refuses the folder, and so does a sample with a ``label`` file;
- ``never``.

The classes are the sorted names of the class folders holding samples (torchvision's order), and a
sample's label is its class's position in them. The label is a field like the others: name
``label``, modality meta, its bytes the decimal number (the feed gives an int64 tensor, as for a
Parquet int column). Its location names the class folder with a trailing slash (``CLASS/``, which
no file's path has) and holds the number in ``offset``: reading it back opens nothing. The classes
are in the manifest (``classes``), `IndexReport.classes` and `SampleIndex.classes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .._errors import SourceError
from ._config import IndexConfig
from ._records import FieldLocation

LABEL_FIELD = "label"
_MEDIA = ("image", "video", "audio")


def folder_classes(groups: Mapping[str, Sequence[tuple[str, str]]], config: IndexConfig, url: str) -> list[str]:
    """The sorted class names of a folder's samples (``groups``: key → (field, relative path)), [] for no labels.

    Raises SourceError (``always`` only) for a sample outside a class folder or with a label file of its own.
    """
    if config.class_folders == "never" or not groups:
        return []
    tops = sorted({key.split("/", 1)[0] for key in groups if "/" in key})
    if config.class_folders == "auto":
        unmistakable = len(tops) >= 2 and all(
            key.count("/") == 1 and len(fields) == 1 and config.modality_of(fields[0][0]) in _MEDIA
            for key, fields in groups.items()
        )
        return tops if unmistakable else []
    outside = next((key for key in groups if "/" not in key), None)
    if outside is not None:
        raise SourceError(
            f"{url}: sample {outside!r} is not in a class folder, and class_folders is 'always'; move "
            "it into one, or set class_folders to 'auto' or 'never'",
            url=url,
            key=outside,
        )
    own = next((key for key, fields in groups.items() if any(name == LABEL_FIELD for name, _ in fields)), None)
    if own is not None:
        raise SourceError(
            f"{url}: sample {own!r} has a {LABEL_FIELD!r} file of its own, and class_folders 'always' "
            "makes its class folder the label; rename the file, or set class_folders to 'never'",
            url=url,
            key=own,
        )
    return tops


def label_field(key: str, numbers: Mapping[str, int]) -> tuple[FieldLocation, bytes]:
    """The ``label`` field of sample ``key`` (its location and bytes), ``numbers``: class name → label."""
    name = key.split("/", 1)[0]
    number = numbers[name]
    data = str(number).encode()
    return FieldLocation(LABEL_FIELD, "meta", f"{name}/", number, len(data)), data


def label_bytes(location: FieldLocation) -> bytes | None:
    """A class label's bytes from its location alone (its decimal number); None for a location that is a file."""
    if not location.member.endswith("/"):
        return None
    return str(location.offset).encode()
