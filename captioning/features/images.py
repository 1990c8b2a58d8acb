"""Image loading for feature extraction: decode fully, convert to RGB, or reject with a human-readable reason.

``load_rgb`` is the only entry point; besides a file path it takes a tar-shard member reference
``<shard>.tar#<offset>:<size>`` (images of a WebDataset dataset, read as a byte range of the shard:
:mod:`captioning.data.tar_members`). Whatever is wrong with the *content* of a file (missing, empty, not an
image, truncated or corrupt, too large, too small, an unsupported pixel mode) comes out as
:class:`ImageRejected` with a ``reason`` that the pipeline stores next to the image's row, so one bad file never
stops a run.

Conversion rules (to ``(H, W, 3) uint8`` RGB):

* EXIF orientation is applied (``ImageOps.exif_transpose``), so width/height may swap.
* Greyscale ``1``/``L`` -> replicated; 16-bit ``I;16*`` -> scaled by 255/65535; 32-bit ``I`` -> as is when the
  values fit 0..255, scaled by 255/65535 when they fit 0..65535, else min-max stretched; float ``F`` -> scaled by
  255 when the values lie in 0..1, else clipped to 0..255 (NaN -> 0).
* Anything with transparency (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa``/``La``, palette or greyscale/RGB
  images with a ``transparency`` entry) is composited over white.
* ``P``, ``CMYK``, ``YCbCr``, ``RGBX``, ``HSV`` -> Pillow's conversion to RGB.
* Other modes (e.g. ``LAB``) are rejected as unsupported.

Truncated data is detected by Pillow itself as long as ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is False (its
default); this module never changes that process-wide switch.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from captioning.data.tar_members import MemberError, MemberRef, read_member

log = logging.getLogger(__name__)

_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
_SIMPLE_MODES = {"RGB", "1", "L", "P", "CMYK", "YCbCr", "RGBX", "HSV"}
_INT16_MODES = {"I;16", "I;16L", "I;16B", "I;16N"}
SUPPORTED_MODES = frozenset(_ALPHA_MODES | _SIMPLE_MODES | _INT16_MODES | {"I", "F"})


class ImageRejected(Exception):
    """An image that cannot be used; ``reason`` says why in words (stored as the row's reject reason)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _describe_error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_rgb(path: str | Path, *, min_side: int = 16, max_pixels: int = 100_000_000) -> np.ndarray:
    """Decode the image at ``path`` completely and return it as a C-contiguous ``(H, W, 3) uint8`` RGB array.

    Raises :class:`ImageRejected` (and nothing else) for any problem with the file or its content. The pixel
    limit is checked on the header's size before any pixel is decoded.
    """
    p = Path(path)
    source = _source(path)
    try:
        im = Image.open(source)
    except UnidentifiedImageError:
        raise ImageRejected(f"not an image (unrecognised format): {p.name}") from None
    except Image.DecompressionBombError as e:
        raise ImageRejected(f"image too large (decompression-bomb guard): {e}") from None
    except Exception as e:  # broken headers raise all sorts of things inside the plugins
        raise ImageRejected(f"unreadable image header: {_describe_error(e)}") from None

    with im:
        fmt = im.format or "image"
        w, h = im.size
        if w <= 0 or h <= 0:
            raise ImageRejected(f"empty {fmt} image ({w}x{h})")
        if w * h > max_pixels:
            raise ImageRejected(f"image too large ({w}x{h} = {w * h} px > {max_pixels} px)")
        if min(w, h) < min_side:
            raise ImageRejected(f"image too small ({w}x{h} < {min_side} px)")
        if im.mode not in SUPPORTED_MODES:
            raise ImageRejected(f"unsupported image mode {im.mode!r} ({fmt})")
        if ImageFile.LOAD_TRUNCATED_IMAGES:  # pragma: no cover - someone flipped Pillow's global switch
            log.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True: truncated images may pass undetected")
        try:
            im.load()
        except Image.DecompressionBombError as e:
            raise ImageRejected(f"image too large (decompression-bomb guard): {e}") from None
        except Exception as e:  # OSError, SyntaxError, EOFError, zlib/struct errors, ...
            kind = "truncated" if "truncated" in str(e).lower() else "corrupt"
            raise ImageRejected(f"{kind} {fmt}: {_describe_error(e)}") from None
        try:
            return _to_rgb_array(_oriented(im), fmt)
        except ImageRejected:
            raise
        except Exception as e:
            raise ImageRejected(f"cannot convert {fmt} ({im.mode}) to RGB: {_describe_error(e)}") from None


def _source(path: str | Path) -> Path | io.BytesIO:
    """What Pillow opens for ``path``: the file, or the bytes of a tar-shard member when ``path`` is a member
    reference ``<shard>.tar#<offset>:<size>`` (:mod:`captioning.data.tar_members`; WebDataset ingest records
    those; checked: range inside the shard, a tar header of that size before it). :class:`ImageRejected` when
    neither can be read."""
    ref = MemberRef.parse(path)
    if ref is not None:  # an image inside a WebDataset shard
        try:
            return io.BytesIO(read_member(ref))
        except MemberError as e:
            raise ImageRejected(str(e)) from None
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ImageRejected(f"missing file: {p}") from None
    except OSError as e:
        raise ImageRejected(f"cannot read file {p}: {_describe_error(e)}") from None
    if not p.is_file():
        raise ImageRejected(f"not a regular file: {p}")
    if st.st_size == 0:
        raise ImageRejected(f"zero-byte file: {p}")
    return p


def _oriented(im: Image.Image) -> Image.Image:
    """Apply the EXIF orientation; a broken EXIF block is ignored (the pixels are fine)."""
    try:
        out = ImageOps.exif_transpose(im)
    except Exception as e:
        log.debug("ignoring unreadable EXIF orientation: %s", e)
        return im
    return im if out is None else out


def _to_rgb_array(im: Image.Image, fmt: str = "image") -> np.ndarray:
    mode = im.mode
    if mode not in SUPPORTED_MODES:
        raise ImageRejected(f"unsupported image mode {mode!r} ({fmt})")
    if mode in _ALPHA_MODES or (mode in {"P", "L", "RGB"} and "transparency" in im.info):
        return _over_white(np.asarray(im.convert("RGBA")))
    if mode in _INT16_MODES:
        v = np.asarray(im).astype(np.uint32)
        return _grey(((v * 255 + 32767) // 65535).astype(np.uint8))
    if mode == "I":
        v = np.asarray(im).astype(np.int64)
        lo, hi = (int(v.min()), int(v.max())) if v.size else (0, 0)
        if lo >= 0 and hi <= 255:
            g = v
        elif lo >= 0 and hi <= 65535:
            g = (v * 255 + 32767) // 65535
        else:
            g = (v - lo) * 255 // max(hi - lo, 1)
        return _grey(g.astype(np.uint8))
    if mode == "F":
        v = np.nan_to_num(np.asarray(im, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if v.size and v.min() >= 0.0 and v.max() <= 1.0:
            v = v * 255.0
        return _grey(np.clip(np.rint(v), 0, 255).astype(np.uint8))
    arr = np.asarray(im if mode == "RGB" else im.convert("RGB"))
    return np.ascontiguousarray(arr, dtype=np.uint8)


def _grey(g: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.repeat(g[:, :, None], 3, axis=2))


def _over_white(rgba: np.ndarray) -> np.ndarray:
    """Composite straight-alpha RGBA over a white background, rounding to nearest."""
    rgb = rgba[:, :, :3].astype(np.uint32)
    a = rgba[:, :, 3:4].astype(np.uint32)
    out = (rgb * a + 255 * (255 - a) + 127) // 255
    return np.ascontiguousarray(out.astype(np.uint8))


#: bytes per pixel of each supported mode once decoded (before the conversion to RGB)
MODE_BYTES = {"1": 1, "L": 1, "P": 1, "LA": 2, "PA": 2, "RGB": 3, "YCbCr": 3, "LAB": 3, "HSV": 3, "RGBA": 4,
              "RGBa": 4, "RGBX": 4, "CMYK": 4, "La": 2, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2, "I": 4,
              "F": 4}


def decoded_bytes(path: str | Path) -> int:
    """What decoding the image at ``path`` costs in memory: its pixels times its mode's bytes per pixel plus the
    RGB copy, from the header alone (no pixel is decoded); :class:`ImageRejected` for a file that is not an image."""
    try:
        source = io.BytesIO(read_member(ref)) if (ref := MemberRef.parse(path)) is not None else path
        with Image.open(source) as im:
            w, h = im.size
            per = MODE_BYTES.get(im.mode, 4)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageRejected(f"unreadable image header: {_describe_error(e)}") from None
    return w * h * (per + (0 if im.mode == "RGB" else 3))
