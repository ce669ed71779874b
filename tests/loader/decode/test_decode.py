"""The decoder registry, DecodeError, text, and the bad-input corpus: each bad file is a DecodeError with its reason."""

from __future__ import annotations

import functools
import io
import logging
import pickle
import resource
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import pytest
import simplejpeg
from PIL import Image

from omnifeed.loader._errors import OmnifeedError, add_context
from omnifeed.loader.decode import _registry as _decode
from omnifeed.loader.decode import follow_index_tokenizer
from omnifeed.loader.decode._config import (
    AudioDecodeConfig,
    DecodeConfig,
    ImageDecodeConfig,
    TextDecodeConfig,
    VideoDecodeConfig,
)
from omnifeed.loader.decode._registry import (
    REASONS,
    DecodeError,
    decode_audio,
    decode_image,
    decode_text,
    decode_video,
    make_decoder,
)
from omnifeed.loader.index._tokenizers import make_token_counter
from omnifeed.tools._demo_data import encode_flac, encode_image, encode_video


@functools.cache
def _jpeg() -> bytes:
    return encode_image(320, 240, "jpg")


@functools.cache
def _png() -> bytes:
    return encode_image(120, 80, "png")


@functools.cache
def _mp4() -> bytes:
    return encode_video(12, 64, 48, 10)


@functools.cache
def _flac() -> bytes:
    return encode_flac(2.0, 22050, 2)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header(width: int, height: int) -> bytes:
    """A valid PNG signature, IHDR declaring ``width × height`` RGB, one empty IDAT and IEND."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"")) + _png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def _broken_moov() -> bytes:
    data = bytearray(_mp4())
    at = data.find(b"moov")
    data[at : at + 4] = b"xxxx"  # the index box is no longer found
    return bytes(data)


def _smashed_moov() -> bytes:
    data = bytearray(_mp4())
    at = data.find(b"moov")
    data[at + 4 : at + 200] = b"\xff" * 196  # the box is found but its contents are garbage
    return bytes(data)


def _bmp() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="BMP")
    return buf.getvalue()


def _huge_sample_table() -> bytes:
    data = bytearray(_mp4())
    at = data.find(b"stts")
    data[at + 8 : at + 12] = struct.pack(">I", 0x3FFFFFFF)  # FFmpeg refuses the allocation: ENOMEM, not OOM
    return bytes(data)


IMAGE = ImageDecodeConfig(formats=("JPEG", "PNG"))
VIDEO, AUDIO = VideoDecodeConfig(), AudioDecodeConfig()
DECODERS: dict[str, Callable[[bytes, str], object]] = {
    "image": lambda data, key: decode_image(data, IMAGE, key),
    "video": lambda data, key: decode_video(data, VIDEO, key),
    "audio": lambda data, key: decode_audio(data, AUDIO, key),
    "text": lambda data, key: decode_text(data, TextDecodeConfig(tokenizer="bytes", max_tokens=1000), key),
}
CORPUS: list[tuple[str, str, Callable[[], bytes], str]] = [
    ("truncated-jpeg", "image", lambda: _jpeg()[: len(_jpeg()) // 2], "truncated"),
    ("truncated-jpeg-header-only", "image", lambda: _jpeg()[:700], "truncated"),
    ("truncated-png", "image", lambda: _png()[: len(_png()) // 2], "truncated"),
    ("zero-bytes-image", "image", lambda: b"", "empty"),
    ("zero-bytes-video", "video", lambda: b"", "empty"),
    ("zero-bytes-audio", "audio", lambda: b"", "empty"),
    ("garbage-as-image", "image", lambda: bytes(range(256)) * 8, "corrupt"),
    ("text-as-image", "image", lambda: b"hello, I am a .jpg", "corrupt"),
    ("bmp-outside-the-allowed-formats", "image", lambda: _bmp(), "corrupt"),
    ("mp4-broken-moov", "video", _broken_moov, "corrupt"),
    ("mp4-smashed-moov", "video", _smashed_moov, "corrupt"),
    ("mp4-huge-sample-table", "video", _huge_sample_table, "corrupt"),
    ("mp4-cut-in-half", "video", lambda: _mp4()[: len(_mp4()) // 2], "corrupt"),  # the moov at the end is gone
    ("flac-cut-in-the-middle", "audio", lambda: _flac()[: len(_flac()) // 2], "truncated"),
    ("flac-cut-in-the-header", "audio", lambda: _flac()[:30], "corrupt"),  # too short to be recognised as FLAC
    ("png-30000x30000-header", "image", lambda: _png_header(30000, 30000), "bomb"),
    ("image-without-audio", "audio", _png, "unsupported"),
    ("audio-without-video", "video", _flac, "unsupported"),
    ("text-not-utf8", "text", lambda: "naïve".encode("latin-1"), "encoding"),
    ("text-too-long", "text", lambda: b"x" * 1001, "too_long"),
    ("text-lone-surrogate", "text", lambda: b"\xed\xa0\x80", "encoding"),
]


@pytest.mark.parametrize(("modality", "make", "reason"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_bad_input_is_a_decode_error_with_its_reason(modality: str, make: Callable[[], bytes], reason: str) -> None:
    with pytest.raises(DecodeError) as caught:
        DECODERS[modality](make(), "sample-7")
    error = caught.value
    assert (error.reason, error.modality, error.key) == (reason, modality, "sample-7")
    assert "'sample-7'" in str(error) and REASONS[reason] in str(error)


def test_bomb_header_is_refused_without_allocating_the_pixels() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(DecodeError, match="bomb"):
        decode_image(_png_header(30000, 30000), ImageDecodeConfig(max_pixels=10**12))  # Pillow's own guard
    with pytest.raises(DecodeError, match="max_pixels"):
        decode_image(_png_header(5000, 5000), ImageDecodeConfig(max_pixels=10**6))  # under Pillow's limit, over ours
    with pytest.raises(DecodeError) as caught:
        decode_image(_png(), ImageDecodeConfig(max_pixels=100))
    assert caught.value.reason == "bomb"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # 2.7 GB would show


def test_guards_on_long_audio_and_video() -> None:
    with pytest.raises(DecodeError) as caught:
        decode_audio(_flac(), AudioDecodeConfig(max_seconds=1.0))
    assert caught.value.reason == "too_long"
    with pytest.raises(DecodeError) as caught:
        decode_video(_mp4(), VideoDecodeConfig(max_decoded_frames=3))
    assert caught.value.reason == "too_long"
    with pytest.raises(DecodeError) as caught:
        decode_video(_mp4(), VideoDecodeConfig(max_pixels=64 * 47))
    assert caught.value.reason == "bomb"


@pytest.mark.parametrize("seed", range(6))
def test_mp4_with_corrupt_packets_decodes_damaged_frames_or_is_corrupt(seed: int) -> None:
    data = bytearray(_mp4())
    start, end = data.find(b"mdat") + 4, data.find(b"moov")
    for at in np.random.default_rng(seed).integers(start, end, 40):
        data[at] ^= 0xFF
    try:
        out = decode_video(bytes(data), VIDEO)
    except DecodeError as exc:
        assert exc.reason in ("corrupt", "truncated")
    else:
        assert out.dtype == np.uint8 and out.shape[1:] == (3, 224, 299) and 1 <= out.shape[0] <= 12


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.6, 0.9, 0.99])
def test_flac_cut_anywhere_is_truncated(fraction: float) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_audio(_flac()[: int(len(_flac()) * fraction)], AUDIO)
    assert caught.value.reason == "truncated"


def test_system_errors_are_never_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    for error in (MemoryError, KeyboardInterrupt):

        def boom(*args: object, error: type[BaseException] = error, **kwargs: object) -> None:
            raise error()

        monkeypatch.setattr(Image, "open", boom)
        monkeypatch.setattr(simplejpeg, "decode_jpeg", boom)
        monkeypatch.setattr(av, "open", boom)
        with pytest.raises(error):
            decode_image(_jpeg(), IMAGE)
        with pytest.raises(error):
            decode_video(_mp4(), VIDEO)
        with pytest.raises(error):
            decode_audio(_flac(), AUDIO)


def test_decode_error_pickles_with_its_fields_and_notes() -> None:
    error = DecodeError("bad", "k1", "image", "truncated")
    add_context(error, "stage=decode")
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, OmnifeedError)
    assert (again.key, again.modality, again.reason, str(again)) == ("k1", "image", "truncated", str(error))
    assert getattr(again, "__notes__", None) == ["stage=decode"]


def test_registry_builds_picklable_decoders_for_every_modality() -> None:
    config = DecodeConfig()
    samples = {"image": _jpeg(), "video": _mp4(), "audio": _flac(), "text": "héllo".encode(), "meta": b"{}"}
    for modality, data in samples.items():
        decoder = pickle.loads(pickle.dumps(make_decoder(modality, config)))
        value = decoder(data, "k")
        if modality == "meta":
            assert value == b"{}"
        elif modality == "text":
            assert isinstance(value, tuple) and value[0] == "héllo"
        else:
            assert isinstance(value, np.ndarray)
    with pytest.raises(ValueError, match="unknown modality"):
        make_decoder("smell", config)


def test_text_bytes_tokenizer_and_limits() -> None:
    text, ids = decode_text("héllo".encode(), TextDecodeConfig(tokenizer="bytes"))
    assert text == "héllo" and ids.dtype == np.int64 and ids.tolist() == list("héllo".encode())
    assert decode_text(b"", TextDecodeConfig(tokenizer="bytes"))[1].size == 0
    assert (
        decode_text(b"abc", TextDecodeConfig(tokenizer="bytes", max_tokens=3))[1].size == 3
    )  # the limit itself is fine


@pytest.mark.parametrize("name", ["regex", "whitespace", "bytes"])
def test_text_builtin_tokenizers_make_as_many_ids_as_the_index_counts(name: str) -> None:
    text = "naïve café—déjà vu? 3.14 is π… (roughly)\n\ufeffok"
    _, ids = decode_text(text.encode(), TextDecodeConfig(tokenizer=name))
    assert ids.dtype == np.int64 and ids.size == make_token_counter(name)(text)
    assert decode_text(text.encode(), TextDecodeConfig(tokenizer=name))[1].tolist() == ids.tolist(), "stable ids"


def test_an_unset_text_tokenizer_follows_the_index_and_a_different_one_is_refused() -> None:
    manifest = {"config": {"tokenizer": "whitespace"}, "modalities": {"text": 3}}
    assert follow_index_tokenizer(DecodeConfig(), manifest).text.tokenizer == "whitespace"
    with pytest.raises(ValueError, match="differs from the index's tokenizer 'whitespace'"):
        follow_index_tokenizer(DecodeConfig(text=TextDecodeConfig(tokenizer="bytes")), manifest)
    no_text = {**manifest, "modalities": {"image": 3}}  # nothing to tokenize: nothing to refuse
    assert (
        follow_index_tokenizer(DecodeConfig(text=TextDecodeConfig(tokenizer="bytes")), no_text).text.tokenizer
        == "bytes"
    )


def test_text_module_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tok.py").write_text(
        "def words(text):\n    return [len(w) for w in text.split()]\n"
        "def bad(text):\n    return ['a', 'b']\n"
        "def tensor(text):\n    import torch\n"
        "    return torch.tensor([len(w) for w in text.split()], dtype=torch.int32)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    text, ids = decode_text(b"a bb ccc", TextDecodeConfig(tokenizer="my_tok:words"))
    assert ids.tolist() == [1, 2, 3] and ids.dtype == np.int64
    _, ids = decode_text(b"a bb ccc", TextDecodeConfig(tokenizer="my_tok:tensor"))  # a tensor becomes numpy
    assert isinstance(ids, np.ndarray) and ids.tolist() == [1, 2, 3] and ids.dtype == np.int64
    with pytest.raises(DecodeError) as caught:
        decode_text(b"a bb ccc", TextDecodeConfig(tokenizer="my_tok:words", max_tokens=2))
    assert caught.value.reason == "too_long"
    with pytest.raises(TypeError, match="sequence of int"):
        decode_text(b"a", TextDecodeConfig(tokenizer="my_tok:bad"))
    with pytest.raises(ValueError, match="no attribute"):
        make_decoder("text", DecodeConfig(text=TextDecodeConfig(tokenizer="my_tok:missing")))


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        (ImageDecodeConfig, {"crop": "center", "resize": "fixed"}),
        (ImageDecodeConfig, {"size": 300, "max_size": 200}),
        (ImageDecodeConfig, {"colour": True}),
        (ImageDecodeConfig, {"formats": ("JPEG", "HEIC-ISH")}),
        (VideoDecodeConfig, {"num_frames": 4, "fps": 2.0}),
        (VideoDecodeConfig, {"num_frames": 65}),
        (AudioDecodeConfig, {"channels": 3}),
        (TextDecodeConfig, {"tokenizer": "gpt"}),
    ],
)
def test_inconsistent_configs_are_refused(model: type, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        model(**kwargs)


def test_dali_backend_without_dali_warns_once_and_uses_pillow(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "omnifeed.loader.decode._dali", None)  # as if nvidia.dali were missing
    _decode._warn_no_dali.cache_clear()
    config = DecodeConfig(image=ImageDecodeConfig(backend="dali"))
    with caplog.at_level(logging.WARNING, logger=_decode.__name__):
        decoders = [make_decoder("image", config) for _ in range(3)]
    warnings = [r.getMessage() for r in caplog.records if r.name == _decode.__name__]
    assert warnings == ["DALI is not installed (pip install 'omnifeed[dali]'); decoding images with Pillow"]
    assert np.array_equal(decoders[0](_jpeg(), "k"), decode_image(_jpeg(), config.image))  # type: ignore[arg-type]
    _decode._warn_no_dali.cache_clear()


def test_dali_backend_matches_pillow() -> None:
    pytest.importorskip("nvidia.dali")
    for image in (ImageDecodeConfig(backend="dali", draft=False), ImageDecodeConfig(backend="dali", crop="center")):
        decoder = pickle.loads(pickle.dumps(make_decoder("image", DecodeConfig(image=image))))
        for data in (_jpeg(), _png(), encode_image(50, 300, "jpg")):
            got, want = decoder(data, "k"), decode_image(data, image)
            assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == np.uint8
            assert np.abs(got.astype(np.float32) - want.astype(np.float32)).mean() < 3.0
        for bad, reason in ((b"", "empty"), (_jpeg()[:2000], "truncated"), (b"x" * 99, "corrupt")):
            with pytest.raises(DecodeError) as caught:
                decoder(bad, "k")
            assert caught.value.reason == reason
        assert decoder(_jpeg(), "k").shape == decode_image(_jpeg(), image).shape  # rebuilt after a failure
