"""decode_meta: meta fields decoded by type — labels as ints, JSON parsed, text as str, bytes only for unknown types."""

from __future__ import annotations

import pytest

from omnifeed.loader.decode import DecodeError, decode_meta


@pytest.mark.parametrize(
    ("field", "data", "column", "expected"),
    [
        ("cls", b"8", None, 8),
        ("cls", b" -3\n", None, -3),
        ("sample.label", b"+12", None, 12),
        ("idx", b"9223372036854775807", None, 2**63 - 1),
        ("id", b"9223372036854775808", None, "9223372036854775808"),  # past int64: kept as its digits
        ("id", b"abc-1", None, "abc-1"),  # an id that is not a number stays text
        ("cls", "١٢".encode(), None, "١٢"),  # only ASCII digits make an int
        ("json", b'{"a": [1, 2.5, null], "b": "x"}', None, {"a": [1, 2.5, None], "b": "x"}),
        ("seg.json", b"[1, 2]", None, [1, 2]),
        ("json", b'{"big": 123456789012345678901234567890}', None, {"big": "123456789012345678901234567890"}),
        ("txt", "héllo".encode(), None, "héllo"),
        ("caption.transcript", b"words", None, "words"),
        ("seg", b"\x00\xff", None, b"\x00\xff"),  # unknown type: the bytes
        ("raw", b"\x00\xff", "binary", b"\x00\xff"),
        ("caption", b"a picture", "string", "a picture"),  # a Parquet string column: str
        ("year", b"1999", "json", 1999),  # a Parquet int column, whatever its name
        ("score", b"0.25", "json", 0.25),
        ("tags", b'["x", "y"]', "json", ["x", "y"]),
        ("label", b"7", "string", 7),  # a string column named like a label: an int when it is one
    ],
)
def test_meta_fields_are_decoded_by_name_and_column_type(
    field: str, data: bytes, column: str | None, expected: object
) -> None:
    value = decode_meta(data, "k", field, column)  # type: ignore[arg-type]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("field", "data", "reason"),
    [
        ("json", b'{"a": ', "corrupt"),
        ("json", b"\xff\xfe", "encoding"),
        ("txt", b"\xff", "encoding"),
        ("cls", b"\xff", "encoding"),
    ],
)
def test_a_typed_meta_field_that_does_not_parse_fails_its_sample_with_a_reason(
    field: str, data: bytes, reason: str
) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_meta(data, "sample-3", field)
    assert caught.value.reason == reason and caught.value.modality == "meta"
    assert "'sample-3'" in str(caught.value) and repr(field) in str(caught.value)
