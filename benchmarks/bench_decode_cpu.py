"""CPU per sample of omnifeed's decoders against a torchvision-style DataLoader decode, same inputs, same output.

    python benchmarks/bench_decode.py --cpu-per-sample [--photos 200] [--rounds 3]

Inputs, generated in memory with a fixed seed: ``photos`` camera/web-sized JPEGs (long side
640–1600 px, 4:3, 3:2 or 16:9, either orientation; a gradient with shapes and sensor-like
noise; Pillow's default quality, 75) and one H.264 clip for every 16 photos (3 s of 640×360 at
25 fps, keyframe every 250 frames, x264 veryfast), decoded to 8 frames spread over the clip.

Output, identical for both sides: photos as uint8 [3, 224, 224] (the centred square resized
to 224×224, bilinear), clip frames as uint8 [8, 3, 224, 224] (resize 'fixed').

- ``dataloader``: what a torchvision-style ``Dataset.__getitem__`` does in a DataLoader
  worker: ``Image.open``, ``convert('RGB')``, ``resize`` of the centred square, to a CHW
  array; a clip is decoded frame by frame with PyAV (every frame up to the last one taken),
  the 8 taken frames converted to RGB at full size, then resized with Pillow.
- ``omnifeed``: `decode_image` / `decode_video` with the defaults (JPEG DCT-domain scaling on).
- ``omnifeed_exact``: `decode_image` with ``draft=False, scaler="pillow"`` (pixel-exact with ``dataloader``;
  asserted on every photo).
- ``omnifeed_pillow``: the defaults but ``scaler="pillow"`` (Pillow's draft decode and resize: the image path
  before JPEGs went through simplejpeg and the resize through libswscale).
- ``mix_images``: the training scenario's pictures (the demo generator's JPEGs and PNGs of 160–640 px, as
  many samples' worth as ``photos``), short side to 224 with the aspect kept, each side as above.
- ``omnifeed_epoch2``: what a field costs the feed from the second epoch when the node's RAM
  tier had room (``cache.decoded_when_room``): the decoded entry read from a real RAM tier
  segment and parsed (`RamTier.get` + `decode_decoded`), no decoder run.

CPU is ``time.process_time()`` of this single-threaded process over one pass; each
decoder's best of ``rounds`` passes (the passes are interleaved), divided by the samples.

``--feed-epochs`` (`feed_epochs_report`): the same photos in a WebDataset tar, through a whole
`Feed` (1 GiB RAM tier, batches of 64, 224 × 224 centre crops) for three epochs, with
``cache.decoded_when_room`` off and on: the process's CPU per delivered sample in each epoch.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import xxhash
from PIL import Image

from omnifeed.cache import CacheConfig, RamTier, RamTierConfig
from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader.decode._common import center_square, resized_size
from omnifeed.loader.decode._config import DecodeConfig, ImageDecodeConfig, VideoDecodeConfig
from omnifeed.loader.decode._registry import decode_image, decode_video
from omnifeed.loader.feed._decoded_codec import decode_decoded, encode_decoded
from omnifeed.tools._demo_data import DemoDatasetSpec, _picture, demo_samples, encode_video

SIZE, FRAMES, PHOTOS_PER_CLIP = 224, 8, 16
IMAGE = ImageDecodeConfig(resize="short_side", size=SIZE, crop="center")
IMAGE_EXACT = ImageDecodeConfig(resize="short_side", size=SIZE, crop="center", draft=False, scaler="pillow")
IMAGE_PILLOW = ImageDecodeConfig(resize="short_side", size=SIZE, crop="center", scaler="pillow")
MIX_IMAGE = ImageDecodeConfig(resize="short_side", size=SIZE)  # the training scenario's: aspect kept
MIX_IMAGE_PILLOW = ImageDecodeConfig(resize="short_side", size=SIZE, scaler="pillow")
VIDEO = VideoDecodeConfig(num_frames=FRAMES, resize="fixed", size=SIZE)


def make_photos(count: int, seed: int = 29) -> list[bytes]:
    """``count`` camera/web-sized JPEGs at Pillow's default quality."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        long_side = int(rng.integers(640, 1601))
        aspect = float(rng.choice([4 / 3, 3 / 2, 16 / 9]))
        width, height = long_side, int(round(long_side / aspect))
        if rng.random() < 0.3:
            width, height = height, width
        pixels = _picture(width, height, rng) + rng.normal(0.0, rng.uniform(2.0, 12.0), (height, width, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


def make_mix_images(count: int) -> list[bytes]:
    """The pictures of the training scenario's mix (the demo generator's: JPEG and PNG, 160–640 px a side)."""
    spec = DemoDatasetSpec(num_samples=count, num_shards=1, image_px=(160, 640))
    return [data for sample in demo_samples(spec) for name, data in sample.fields.items() if name in ("jpg", "png")]


def dataloader_mix_image(data: bytes) -> np.ndarray:
    """A torchvision-style decode of a mix picture: open, convert to RGB, short side to 224 (aspect kept), CHW."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        size = resized_size(rgb.width, rgb.height, "short_side", SIZE, MIX_IMAGE.max_size)
        out = np.asarray(rgb.resize(size, Image.Resampling.BILINEAR))
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def make_clips(count: int) -> list[bytes]:
    """``count`` 3-second 640×360 H.264 clips at 25 fps."""
    return [encode_video(75, 640, 360, 25, seed=i) for i in range(count)]


def dataloader_image(data: bytes) -> np.ndarray:
    """A torchvision-style decode: open, convert to RGB, resize the centred square to 224×224, CHW."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        box = center_square(*rgb.size)
        out = np.asarray(rgb.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box))
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def dataloader_video(data: bytes) -> np.ndarray:
    """Decode frame by frame up to the last taken; the 8 taken ones to RGB at full size, then resized with Pillow."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        total = stream.frames or 1
        wanted = {total * i // FRAMES for i in range(FRAMES)}
        frames = []
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                rgb = Image.fromarray(frame.to_ndarray(format="rgb24"))
                frames.append(np.asarray(rgb.resize((SIZE, SIZE), Image.Resampling.BILINEAR)).transpose(2, 0, 1))
            if i >= max(wanted):
                break
    return np.stack(frames)


def _pass(decode: Callable[[bytes], Any], inputs: list[bytes]) -> float:
    started = time.process_time()
    for data in inputs:
        decode(data)
    return time.process_time() - started


def cpu_per_sample_report(photos: int, rounds: int) -> dict[str, Any]:
    """Milliseconds of CPU per sample, and the ratios to the DataLoader's, for photos, clips and the mix."""
    images, clips = make_photos(photos), make_clips(max(1, photos // PHOTOS_PER_CLIP))
    mix_images = make_mix_images(photos)  # about 0.45 pictures a sample
    for data in images:  # same output: the exact path equals the DataLoader's pixel for pixel
        assert np.array_equal(decode_image(data, IMAGE_EXACT), dataloader_image(data))
    sides: dict[str, dict[str, Callable[[bytes], Any]]] = {
        "photos": {
            "dataloader": dataloader_image,
            "omnifeed": lambda d: decode_image(d, IMAGE),
            "omnifeed_exact": lambda d: decode_image(d, IMAGE_EXACT),
            "omnifeed_pillow": lambda d: decode_image(d, IMAGE_PILLOW),
        },
        "clips": {"dataloader": dataloader_video, "omnifeed": lambda d: decode_video(d, VIDEO)},
        "mix_images": {
            "dataloader": dataloader_mix_image,
            "omnifeed": lambda d: decode_image(d, MIX_IMAGE),
            "omnifeed_pillow": lambda d: decode_image(d, MIX_IMAGE_PILLOW),
        },
    }
    inputs = {"photos": images, "clips": clips, "mix_images": mix_images}
    ram = RamTier(RamTierConfig(name=f"bench-decode-cpu-{os.getpid()}", capacity_bytes=512 * 2**20))
    try:
        for kind, decoders in sides.items():  # the entries epoch 1 left in the RAM tier
            for data in inputs[kind]:
                ram.put(xxhash.xxh3_128_digest(data), encode_decoded(decoders["omnifeed"](data)))
            decoders["omnifeed_epoch2"] = lambda d: decode_decoded(ram.get(xxhash.xxh3_128_digest(d)) or b"")
        best: dict[str, dict[str, float]] = {kind: {} for kind in sides}
        for _ in range(rounds):
            for kind, decoders in sides.items():
                for name, decode in decoders.items():
                    seconds = _pass(decode, inputs[kind])
                    best[kind][name] = min(best[kind].get(name, float("inf")), seconds)
    finally:
        ram.unlink()
    report: dict[str, Any] = {"photos": len(images), "clips": len(clips), "rounds": rounds, "ms_cpu_per_sample": {}}
    for kind, seconds in best.items():
        report["ms_cpu_per_sample"][kind] = {
            name: round(1000 * s / len(inputs[kind]), 3) for name, s in seconds.items()
        }
    mix = {name: best["photos"][name] + best["clips"][name] for name in ("dataloader", "omnifeed", "omnifeed_epoch2")}
    count = len(images) + len(clips)
    report["ms_cpu_per_sample"]["mix"] = {name: round(1000 * s / count, 3) for name, s in mix.items()}
    report["ratio_to_dataloader"] = {
        "photos": round(best["photos"]["omnifeed"] / best["photos"]["dataloader"], 3),
        "photos_exact": round(best["photos"]["omnifeed_exact"] / best["photos"]["dataloader"], 3),
        "photos_pillow_scaler": round(best["photos"]["omnifeed_pillow"] / best["photos"]["dataloader"], 3),
        "mix_images": round(best["mix_images"]["omnifeed"] / best["mix_images"]["dataloader"], 3),
        "mix_images_pillow_scaler": round(best["mix_images"]["omnifeed_pillow"] / best["mix_images"]["dataloader"], 3),
        "clips": round(best["clips"]["omnifeed"] / best["clips"]["dataloader"], 3),
        "mix": round(mix["omnifeed"] / mix["dataloader"], 3),
        "mix_epoch2": round(mix["omnifeed_epoch2"] / mix["dataloader"], 3),
    }
    return report


def feed_epochs_report(photos: int, epochs: int = 3) -> dict[str, Any]:
    """Milliseconds of process CPU per delivered sample of a `Feed` in each epoch, decoded_when_room off and on."""
    work = Path(tempfile.mkdtemp(prefix="bench-decode-cpu-"))
    with tarfile.open(work / "photos-0000.tar", "w") as tar:
        for i, data in enumerate(make_photos(photos)):
            member = tarfile.TarInfo(f"{i:06d}.jpg")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    build_index([str(work / "photos-0000.tar")], work / "index", IndexConfig(workers=1), progress=False)
    index = SampleIndex(work / "index")
    report: dict[str, Any] = {"photos": photos}
    for when_room in (False, True):
        name = f"bench-decode-cpu-{uuid.uuid4().hex[:8]}"
        cache = CacheConfig(ram=RamTierConfig(name=name, capacity_bytes=2**30), decoded_when_room=when_room)
        decode = DecodeConfig(image=ImageDecodeConfig(resize="short_side", size=SIZE, crop="center"))
        config = FeedConfig(plan=PlanConfig(seed=1, batch_size=64), cache=cache, decode=decode)
        try:
            with Feed(index, config) as feed:
                per_epoch = []
                for _ in range(epochs):
                    started, samples = time.process_time(), 0
                    for batch in feed:
                        samples += len(batch["__key__"])
                    per_epoch.append(round(1000 * (time.process_time() - started) / samples, 3))
                image = feed.metrics()["modalities"]["image"]
        finally:
            RamTier.remove(name)
        report[f"decoded_when_room={str(when_room).lower()}"] = {
            "ms_cpu_per_sample_by_epoch": per_epoch,
            "fields_decoded": image["decoded"] - image["from_decoded_cache"],
            "fields_from_decoded_cache": image["from_decoded_cache"],
        }
    return report
