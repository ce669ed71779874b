"""What every decoder shares: `DecodeError` and its reasons, the resize arithmetic, and numpy outputs."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np

from .._errors import OmnifeedError

REASONS: dict[str, str] = {
    "empty": "the field has no bytes: check the source (a zero-length member or a failed write)",
    "truncated": "the data ends early: re-fetch it (a partial read or interrupted copy) or re-encode the file",
    "corrupt": "the data is malformed or not in an accepted format: re-encode or remove the file",
    "bomb": "the declared size is over the decode guard: raise the guard in the decode config if such files "
    "are genuine, else remove the file",
    "too_long": "the content is longer than the decode guard allows: raise the guard in the decode config, "
    "or split or remove the sample",
    "encoding": "the text is not valid UTF-8: re-encode it as UTF-8",
    "unsupported": "the file holds nothing this decoder can use (no stream of that kind, or an unsupported "
    "codec or pixel format): re-encode it, or map the field to 'meta' in IndexConfig.modalities",
    "user": "a function of yours (a decoder, tokenizer or transform) raised or returned something the batch "
    "cannot hold: fix the function named (the data may be fine)",
}
"""The reasons a `DecodeError` may carry, each with what to do about it."""


class DecodeError(OmnifeedError):
    """A field's bytes could not be decoded; ``reason`` is one of `REASONS`.

    Attributes: ``key`` (sample key), ``modality`` ('image', 'video', 'audio', 'text') and
    ``reason``. The message names the key, what is wrong and what to do. Picklable.
    """

    def __init__(self, detail: str, key: str = "?", modality: str = "?", reason: str = "corrupt") -> None:
        assert reason in REASONS, reason
        what = "user code failed on" if reason == "user" else "cannot decode"
        super().__init__(f"{what} {modality} of sample {key!r} ({reason}): {detail}; {REASONS[reason]}")
        self.detail, self.key, self.modality, self.reason = detail, key, modality, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.detail, self.key, self.modality, self.reason), dict(self.__dict__))


def function_name(function: Any) -> str:
    """``module:qualname`` of a callable (a partial or a callable object by its class), for messages."""
    target = getattr(function, "func", function)  # functools.partial
    if not hasattr(target, "__qualname__"):
        target = type(target)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def user_code_error(function: str, exc: BaseException, key: str, modality: str, where: str) -> DecodeError:
    """The `DecodeError` (reason 'user') for ``exc`` raised by the user's ``function`` on sample ``key``.

    ``where`` names the field and its file (URL and member); the innermost frame of the
    traceback is named too, so the message points at the line that failed.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return DecodeError(f"{function} raised {type(exc).__name__}: {exc}{at} ({where})", key, modality, "user")


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, told without importing torch (the engine never does)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def as_numpy(value: Any) -> Any:
    """A decoder's output with torch tensors as numpy arrays (a user's decoder may return tensors).

    Tensors are detached and moved to the CPU (``.detach().cpu().numpy()``: no copy for a CPU
    tensor); tuples are converted item by item; arrays, str, bytes and anything else are
    returned as they are.
    """
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        return value.detach().cpu().numpy()
    if isinstance(value, tuple):
        return tuple(as_numpy(v) for v in value)
    return value


def resized_size(width: int, height: int, resize: str, size: int, max_size: int) -> tuple[int, int]:
    """Output (width, height) of the resize policy for a ``width × height`` source, in pixels.

    The same float64 arithmetic and round-half-even as the bucketing cost model's resize, so
    the two agree exactly; where the model's rounding reaches 0 (aspect ratios past
    ``max_size × size : 1``) the decoder keeps 1 pixel.
    """
    if resize == "fixed":
        return size, size
    if resize == "none":
        return width, height
    w, h = float(width), float(height)
    scale = size / min(w, h)
    w, h = float(round(w * scale)), float(round(h * scale))
    longest = max(w, h)
    if longest > max_size:
        cap = max_size / longest
        w, h = float(round(w * cap)), float(round(h * cap))
    return max(1, int(w)), max(1, int(h))


def center_square(width: int, height: int) -> tuple[float, float, float, float]:
    """The centred ``m × m`` box (left, top, right, bottom) of a source, ``m`` its short side."""
    m = min(width, height)
    left, top = (width - m) / 2, (height - m) / 2
    return left, top, left + m, top + m


SWSCALE_INTERPOLATION = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}
"""The config's ``resample`` names as libswscale's filters (PyAV's ``Interpolation``), for images and frames."""


def plane_rows(plane: Any, height: int) -> np.ndarray:
    """uint8 [H, line_size] view of a PyAV frame plane's rows (each row padded to ``line_size`` bytes)."""
    return np.frombuffer(memoryview(plane), np.uint8)[: height * plane.line_size].reshape(height, plane.line_size)
