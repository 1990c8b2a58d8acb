"""Writing the synthetic dataset: per image its split and file format, the drawn image file and its captions,
then the annotations in the Karpathy ``dataset_coco.json`` layout."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from captioning.data.synthetic.captions import captions_for
from captioning.data.synthetic.render import render_scene
from captioning.data.synthetic.scene import (
    STREAM_CAPTIONS,
    STREAM_META,
    STREAM_RENDER,
    Scene,
    image_rng,
    scene_for,
)
from captioning.data.text import tokenize
from captioning.progress import bar as progress_bar

__all__ = ["COCOID_OFFSET", "IMAGE_SUBDIR", "JPEG_QUALITY", "RESTVAL_FRACTION", "generate_synthetic", "main"]

logger = logging.getLogger("captioning.data.synthetic")

IMAGE_SUBDIR = "shapes"
RESTVAL_FRACTION = 0.05
COCOID_OFFSET = 100000
JPEG_QUALITY = 90


def _split_and_format(
    seed: int, index: int, png_fraction: float, val_fraction: float, test_fraction: float
) -> tuple[str, str]:
    rng = image_rng(seed, index, STREAM_META)
    u = float(rng.random())
    if u < test_fraction:
        split = "test"
    elif u < test_fraction + val_fraction:
        split = "val"
    else:
        split = "train"
    restval = rng.random() < RESTVAL_FRACTION
    if split == "train" and restval:
        split = "restval"
    ext = "png" if rng.random() < png_fraction else "jpg"
    return split, ext


def _save(image: Image.Image, path: Path, ext: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if ext == "png":
        image.save(tmp, format="PNG", optimize=False, compress_level=6)
    else:
        image.save(tmp, format="JPEG", quality=JPEG_QUALITY, optimize=False, subsampling=0)
    os.replace(tmp, path)


def _check_arguments(
    num_images: int, captions_per_image: int, png_fraction: float, val_fraction: float, test_fraction: float
) -> None:
    if num_images < 0:
        raise ValueError(f"num_images must be >= 0, got {num_images}")
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be >= 1, got {captions_per_image}")
    fractions = {"png_fraction": png_fraction, "val_fraction": val_fraction, "test_fraction": test_fraction}
    for name, value in fractions.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if val_fraction + test_fraction > 1.0:
        raise ValueError("val_fraction + test_fraction must be <= 1")


def _image_entry(index: int, scene: Scene, split: str, filename: str, sentences: list[dict]) -> dict:
    """Image ``index``'s annotation entry (Karpathy layout, plus its objects and canvas size)."""
    return {
        "filepath": IMAGE_SUBDIR,
        "filename": filename,
        "imgid": index,
        "split": split,
        "cocoid": COCOID_OFFSET + index,
        "sentids": [s["sentid"] for s in sentences],
        "sentences": sentences,
        "objects": [
            {
                "shape": o.shape,
                "colour": o.colour,
                "size": o.size_word,
                "bbox": [round(v, 6) for v in scene.normalised_bbox(o)],
            }
            for o in scene.objects
        ],
        "width": scene.width,
        "height": scene.height,
    }


def generate_synthetic(
    out_dir: str | Path,
    num_images: int,
    seed: int = 0,
    *,
    min_size: int = 96,
    max_size: int = 192,
    max_objects: int = 4,
    png_fraction: float = 0.3,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    captions_per_image: int = 5,
    progress: bool = False,
) -> Path:
    """Writes out_dir/images/<split-agnostic subfolder>/<name>.{jpg,png} and out_dir/dataset.json.

    Returns the JSON path. Image ``i`` depends only on ``(seed, i)`` and the drawing parameters, never on
    ``num_images``; the same arguments always produce byte-identical files.
    """
    _check_arguments(num_images, captions_per_image, png_fraction, val_fraction, test_fraction)
    out = Path(out_dir)
    image_dir = out / "images" / IMAGE_SUBDIR
    image_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    entries: list[dict] = []
    sentid = 0
    for i in progress_bar(range(num_images), desc="synthetic images", enabled=progress, unit="img"):
        scene = scene_for(i, seed, min_size=min_size, max_size=max_size, max_objects=max_objects)
        split, ext = _split_and_format(seed, i, png_fraction, val_fraction, test_fraction)
        filename = f"synthetic_{i:06d}.{ext}"
        _save(render_scene(scene, image_rng(seed, i, STREAM_RENDER)), image_dir / filename, ext)
        raws = captions_for(scene, image_rng(seed, i, STREAM_CAPTIONS), captions_per_image)
        sentences = []
        for raw in raws:
            sentences.append({"tokens": tokenize(raw), "raw": raw, "imgid": i, "sentid": sentid})
            sentid += 1
        entries.append(_image_entry(i, scene, split, filename, sentences))
    json_path = out / "dataset.json"
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps({"dataset": "synthetic", "images": entries}, indent=None), encoding="utf-8")
    os.replace(tmp, json_path)
    logger.info(
        "wrote %d synthetic images (%d captions) to %s in %.1fs",
        num_images,
        sentid,
        out,
        time.perf_counter() - started,
    )
    return json_path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate the synthetic shapes captioning dataset.")
    parser.add_argument("out_dir")
    parser.add_argument("num_images", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(generate_synthetic(args.out_dir, args.num_images, args.seed, progress=True))
