"""load_rgb: every convertible image becomes (H, W, 3) uint8 RGB; every bad one is rejected with a clear reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioning.features.images import ImageRejected, load_rgb


def _save(im: Image.Image, path: Path, **kw) -> Path:
    im.save(path, **kw)
    return path


def _rejected(path, **kw) -> str:
    with pytest.raises(ImageRejected) as info:
        load_rgb(path, **kw)
    assert str(info.value) == info.value.reason
    return info.value.reason


@pytest.fixture
def noise() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)


# ---------------------------------------------------------------------- conversions
def test_rgb_jpeg(tmp_path):
    yy, xx = np.mgrid[0:48, 0:64]
    smooth = np.stack([xx * 4, yy * 5, np.full_like(xx, 100)], axis=2).astype(np.uint8)
    p = _save(Image.fromarray(smooth), tmp_path / "a.jpg", quality=95)
    out = load_rgb(p)
    assert out.shape == (48, 64, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert np.abs(out.astype(int) - smooth.astype(int)).mean() < 3  # lossy, but the same picture


def test_rgb_png_is_exact(tmp_path, noise):
    p = _save(Image.fromarray(noise), tmp_path / "a.png")
    assert np.array_equal(load_rgb(str(p)), noise)  # str paths work too


def test_greyscale_png(tmp_path):
    p = _save(Image.new("L", (30, 20), 77), tmp_path / "g.png")
    out = load_rgb(p)
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8
    assert np.all(out == 77)


def test_greyscale_16bit_png_is_scaled(tmp_path):
    v = np.zeros((20, 30), dtype=np.uint16)
    v[:, 10:20] = 257 * 100
    v[:, 20:] = 65535
    im = Image.fromarray(v)
    assert im.mode == "I;16"
    p = _save(im, tmp_path / "g16.png")
    assert Image.open(p).mode.startswith("I")
    out = load_rgb(p)
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8
    assert out[0, 0].tolist() == [0, 0, 0]
    assert out[0, 15].tolist() == [100, 100, 100]
    assert out[0, 25].tolist() == [255, 255, 255]


def test_float_tiff_in_unit_range_is_scaled(tmp_path):
    v = np.full((20, 30), 0.5, dtype=np.float32)
    p = _save(Image.fromarray(v, mode="F"), tmp_path / "f.tif")
    out = load_rgb(p)
    assert out.shape == (20, 30, 3) and np.all(out == 128)


def test_rgba_composited_over_white(tmp_path):
    a = np.zeros((20, 30, 4), dtype=np.uint8)
    a[:, :10] = (255, 0, 0, 128)  # half-transparent red
    a[:, 10:20] = (0, 0, 255, 255)  # opaque blue
    a[:, 20:] = (0, 255, 0, 0)  # fully transparent
    p = _save(Image.fromarray(a, mode="RGBA"), tmp_path / "rgba.png")
    out = load_rgb(p)
    assert out.shape == (20, 30, 3)
    assert np.abs(out[5, 5].astype(int) - [255, 127, 127]).max() <= 1
    assert out[5, 15].tolist() == [0, 0, 255]
    assert out[5, 25].tolist() == [255, 255, 255]


def test_la_composited_over_white(tmp_path):
    im = Image.new("LA", (20, 20), (0, 0))  # black, fully transparent
    out = load_rgb(_save(im, tmp_path / "la.png"))
    assert np.all(out == 255)


def test_palette_with_transparency(tmp_path):
    idx = np.zeros((20, 30), dtype=np.uint8)
    idx[:, 15:] = 1
    im = Image.fromarray(idx, mode="P")
    im.putpalette([0, 0, 0, 200, 10, 20] + [0] * (254 * 3))
    p = _save(im, tmp_path / "p.png", transparency=0)
    assert Image.open(p).mode == "P" and "transparency" in Image.open(p).info
    out = load_rgb(p)
    assert out.shape == (20, 30, 3)
    assert out[0, 0].tolist() == [255, 255, 255]  # transparent index -> white
    assert out[0, 20].tolist() == [200, 10, 20]


def test_palette_without_transparency(tmp_path):
    im = Image.new("RGB", (30, 20), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE)
    out = load_rgb(_save(im, tmp_path / "p.gif"))
    assert out.shape == (20, 30, 3) and np.all(np.abs(out.astype(int) - [10, 200, 30]) <= 8)


def test_cmyk_jpeg(tmp_path):
    im = Image.new("CMYK", (30, 20), (0, 255, 255, 0))  # red in CMYK
    p = _save(im, tmp_path / "cmyk.jpg", quality=95)
    assert Image.open(p).mode == "CMYK"
    out = load_rgb(p)
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8
    assert np.abs(out[10, 15].astype(int) - [255, 0, 0]).max() <= 10


def test_ycbcr_jpeg_array(tmp_path):
    im = Image.new("RGB", (30, 20), (0, 0, 255)).convert("YCbCr")
    p = _save(im, tmp_path / "ycc.tif")
    out = load_rgb(p)
    assert out.shape == (20, 30, 3) and np.abs(out[3, 3].astype(int) - [0, 0, 255]).max() <= 6


def test_exif_orientation_is_applied(tmp_path):
    a = np.zeros((20, 40, 3), dtype=np.uint8)  # 40 wide, 20 high: left half red, right half blue
    a[:, :20] = (255, 0, 0)
    a[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    p = _save(Image.fromarray(a), tmp_path / "rot.jpg", exif=exif.tobytes(), quality=95)
    out = load_rgb(p)
    assert out.shape == (40, 20, 3)  # width and height swapped
    assert out[5, 10, 0] > 200 and out[5, 10, 2] < 50  # the left edge is now the top: red
    assert out[35, 10, 2] > 200 and out[35, 10, 0] < 50  # blue at the bottom


# ---------------------------------------------------------------------- rejections
def test_truncated_jpeg(tmp_path, noise):
    data = _save(Image.fromarray(noise), tmp_path / "a.jpg").read_bytes()
    (tmp_path / "t.jpg").write_bytes(data[: len(data) // 2])
    assert _rejected(tmp_path / "t.jpg").startswith("truncated JPEG")


def test_truncated_png(tmp_path, noise):
    data = _save(Image.fromarray(noise), tmp_path / "a.png").read_bytes()
    (tmp_path / "t.png").write_bytes(data[: len(data) // 2])
    assert _rejected(tmp_path / "t.png").startswith("truncated PNG")


def test_corrupt_png_data(tmp_path, noise):
    data = bytearray(_save(Image.fromarray(noise), tmp_path / "a.png").read_bytes())
    start = data.index(b"IDAT") + 8
    data[start : start + 200] = bytes(200)  # zeros over the compressed stream
    (tmp_path / "c.png").write_bytes(bytes(data))
    reason = _rejected(tmp_path / "c.png")
    assert reason.startswith(("corrupt PNG", "truncated PNG")), reason


def test_zero_byte_file(tmp_path):
    (tmp_path / "z.jpg").write_bytes(b"")
    assert _rejected(tmp_path / "z.jpg").startswith("zero-byte file")


def test_text_file(tmp_path):
    (tmp_path / "x.jpg").write_text("this is not an image at all\n" * 10)
    assert _rejected(tmp_path / "x.jpg").startswith("not an image")


def test_missing_file(tmp_path):
    assert _rejected(tmp_path / "nope.jpg").startswith("missing file")


def test_directory(tmp_path):
    assert _rejected(tmp_path).startswith("not a regular file")


def test_too_small(tmp_path):
    p = _save(Image.new("RGB", (5, 5), (200, 0, 0)), tmp_path / "tiny.png")
    assert _rejected(p) == "image too small (5x5 < 16 px)"
    assert load_rgb(p, min_side=5).shape == (5, 5, 3)


def test_too_many_pixels_checked_before_decoding(tmp_path, noise):
    p = _save(Image.fromarray(noise), tmp_path / "a.png")
    assert _rejected(p, max_pixels=1000) == "image too large (64x48 = 3072 px > 1000 px)"
    # the header alone decides: a truncated file that is too large is rejected for its size
    data = p.read_bytes()
    (tmp_path / "t.png").write_bytes(data[: len(data) // 2])
    assert _rejected(tmp_path / "t.png", max_pixels=1000).startswith("image too large")


def test_decompression_bomb_guard(tmp_path, noise, monkeypatch):
    p = _save(Image.fromarray(noise), tmp_path / "a.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL's own guard fires above 2x this
    assert "decompression-bomb" in _rejected(p)


def test_unsupported_mode(tmp_path, noise):
    p = _save(Image.fromarray(noise).convert("LAB"), tmp_path / "lab.tif")
    assert Image.open(p).mode == "LAB"
    assert _rejected(p) == "unsupported image mode 'LAB' (TIFF)"


# ---------------------------------------------------------------------- real material
def test_real_coco_jpegs(external):
    paths = sorted((external / "images").glob("*.jpg"))
    assert len(paths) == 27
    for p in paths:
        out = load_rgb(p)
        assert out.ndim == 3 and out.shape[2] == 3 and out.dtype == np.uint8, p.name
        assert min(out.shape[:2]) >= 16
