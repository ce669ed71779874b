"""Images with an NVIDIA DALI CPU pipeline (optional: ``pip install 'omnifeed[dali]'``).

Imported only when ``ImageDecodeConfig.backend == 'dali'``; importing this module without
DALI raises ImportError, which the registry turns into one warning and a Pillow fallback.

Each sample's header is read with Pillow first, so the format allow-list, the bomb guard
and the output geometry are exactly those of the Pillow path; DALI then decodes
(``fn.decoders.image``, EXIF orientation not applied) and resamples the same source box to
the same size (``fn.resize`` with an ROI). Formats DALI does not decode (GIF) and any sample
DALI fails on go through Pillow, which decodes it or raises the precise DecodeError; a
failed DALI pipeline is rebuilt. One pipeline per thread (DALI pipelines are not
thread-safe), built on first use, so the decoder pickles (to worker processes) as its config.
"""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

import numpy as np
from nvidia.dali import fn, pipeline_def, types  # ImportError without DALI: see the registry
from PIL import Image

from ._common import DecodeError
from ._config import ImageDecodeConfig
from ._image import checked_size, decode_image, hwc_to_chw, image_error, output_geometry

logger = logging.getLogger(__name__)

_DALI_FORMATS = frozenset({"JPEG", "PNG", "TIFF", "BMP", "WEBP", "PPM", "JPEG2000"})
_INTERP = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC, "lanczos": types.INTERP_LANCZOS3}


def _build(resample: str) -> Any:
    @pipeline_def(
        batch_size=1, num_threads=1, device_id=None, exec_async=False, exec_pipelined=False, prefetch_queue_depth=1
    )
    def image_pipeline() -> Any:
        data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
        width = fn.external_source(name="width", dtype=types.FLOAT, ndim=0)
        height = fn.external_source(name="height", dtype=types.FLOAT, ndim=0)
        roi_start = fn.external_source(name="roi_start", dtype=types.FLOAT, ndim=1)  # (y, x)
        roi_end = fn.external_source(name="roi_end", dtype=types.FLOAT, ndim=1)
        image = fn.decoders.image(data, device="cpu", output_type=types.RGB, adjust_orientation=False)
        return fn.resize(
            image,
            resize_x=width,
            resize_y=height,
            roi_start=roi_start,
            roi_end=roi_end,
            roi_relative=False,
            interp_type=_INTERP[resample],
            antialias=True,
        )

    pipeline = image_pipeline()
    pipeline.build()
    return pipeline


class DaliImageDecoder:
    """``(bytes, key) -> uint8 [3, H, W]``, like `decode_image` but decoded by DALI on the CPU."""

    def __init__(self, config: ImageDecodeConfig) -> None:
        self.config = config
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    def _pipeline(self) -> Any:
        pipeline = getattr(self._local, "pipeline", None)
        if pipeline is None:
            pipeline = self._local.pipeline = _build(self.config.resample)
        return pipeline

    def __call__(self, data: bytes, key: str = "?") -> np.ndarray:
        """Decode one image; raises DecodeError on bad input (as `decode_image`)."""
        if not data:
            raise DecodeError("the field is zero bytes long", key, "image", "empty")
        try:
            with Image.open(io.BytesIO(data), formats=list(self.config.formats)) as header:
                width, height = checked_size(header, self.config.max_pixels, key)
                fmt = header.format
        except DecodeError:
            raise
        except MemoryError:
            raise
        except Exception as exc:
            raise image_error(exc, key) from exc
        if fmt not in _DALI_FORMATS:
            return decode_image(data, self.config, key)
        (out_w, out_h), (left, top, right, bottom), _ = output_geometry(width, height, self.config)
        pipeline = self._pipeline()
        try:
            pipeline.feed_input("data", [np.frombuffer(data, dtype=np.uint8)])
            pipeline.feed_input("width", [np.float32(out_w)])
            pipeline.feed_input("height", [np.float32(out_h)])
            pipeline.feed_input("roi_start", [np.array([top, left], dtype=np.float32)])
            pipeline.feed_input("roi_end", [np.array([bottom, right], dtype=np.float32)])
            (output,) = pipeline.run()
            array = np.array(output.as_tensor())[0]
        except MemoryError:
            raise
        except Exception as exc:  # DALI leaves a failed pipeline unusable: rebuild it next time
            self._local.pipeline = None
            logger.debug("DALI failed on %s (%s); decoding it with Pillow", key, exc)
            return decode_image(data, self.config, key)
        if array.shape != (out_h, out_w, 3):
            raise DecodeError(f"DALI produced {array.shape}, expected {(out_h, out_w, 3)}", key, "image", "corrupt")
        return hwc_to_chw(array)
