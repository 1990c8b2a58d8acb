"""What every region extractor shares, whatever its flavour: the results, the error, the protocol, the resize.

- :class:`Regions`: one image's kept regions; :class:`Prepared`: one decoded image waiting for the device;
  :class:`ExtractionError`: the detector's numbers for an image were unusable.
- :class:`Extractor`: what an extractor offers its callers (``prepare``, ``stream``, ``__call__``,
  ``extract_given``, ``describe``) and the hooks :class:`captioning.features.stream.ExtractionStream` drives.
  The flavours (:mod:`captioning.features.stock`, :mod:`captioning.features.bottom_up_extractor`) implement it on
  :class:`captioning.features.engine.ExtractorEngine`; what names a flavour's store and which extra per-region
  arrays it holds are the flavour's record in :mod:`captioning.features.registry` (no model needed to name a store).
- :func:`resized_rgb` / :func:`check_images`: the input checks and detectron2's resize, shared by the extractors
  and the loader processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from captioning.errors import CapflowError

if TYPE_CHECKING:
    import torch

    from captioning.config import ExtractorConfig

# Known, harmless warnings from detectron2 0.6 on torch 2.13, printed by every worker otherwise.
warnings.filterwarnings("ignore", message=r"torch\.meshgrid: in an upcoming release", category=UserWarning)
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)

PRE_NMS_FLOOR = 6000  # detectron2's default RPN.PRE_NMS_TOPK_TEST for C4 models


class ExtractionError(CapflowError, RuntimeError):
    """The detector produced unusable numbers (NaN/inf) for an image; ``index`` is its position in the call."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


@dataclass
class Regions:
    """Regions of one image, sorted by score (descending) unless they were given."""

    features: np.ndarray  # (n, D) float32, mean-pooled res5 features
    boxes: np.ndarray  # (n, 4) float32, x1, y1, x2, y2 divided by the original width/height, in [0, 1]
    scores: np.ndarray  # (n,) float32, best class confidence
    image_size: tuple[int, int]  # (height, width) of the original image
    # bottom-up flavours: per kept box, the box in original-image pixels, the object class (foreground index,
    # 0-based) and its probability, the attribute class (0-based, "no attribute" excluded) and its probability
    extras: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.features.shape[0])


@dataclass
class Prepared:
    """One decoded image, resized and in the model's channel order, waiting for the device."""

    key: Any
    tensor: torch.Tensor  # (3, h, w) uint8 (pinned when the model is on CUDA)
    shape: tuple[int, int]  # resized (h, w)
    image_size: tuple[int, int]  # original (H, W)


Result = tuple[Any, Regions | Exception]  # an item's key and its regions, or what replaced them


class Extractor(Protocol):
    """A region extractor: a detector built once, called on lists or streams of RGB images ``(H, W, 3) uint8``."""

    cfg: ExtractorConfig  # the settings, automatic ones resolved (captioning.features.settings.effective_config)
    device: torch.device
    decode_threads: int
    decode_processes: int
    warnings: list[str]
    random_init: bool

    def prepare(self, image: np.ndarray, key: Any = None) -> Prepared:
        """The image resized for the model, still on the CPU (thread-safe)."""
        ...

    def stream(self, items: Iterable[tuple[Any, Callable[[], np.ndarray]]], *, threads: int | None = None,
               window: int | None = None) -> Iterator[Result]:
        """``(key, Regions)`` or ``(key, exception)`` for every ``(key, load)`` item, in completion order."""
        ...

    def __call__(self, images: list[np.ndarray]) -> list[Regions]:
        """Regions of each image (same order)."""
        ...

    def extract_given(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Regions]:
        """Features and best class scores of the given boxes, in their order."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-able description (for store attributes): settings, weights identity, device, versions."""
        ...

    # the hooks of ExtractionStream
    def _group_key(self, p: Prepared) -> tuple[int, int]: ...

    def _prepared(self, key: Any, img: np.ndarray, image_size: tuple[int, int]) -> Prepared: ...

    def _process_pool(self) -> ProcessPoolExecutor: ...

    def _drop_pool(self, why: BaseException) -> None: ...

    def _detect_safe(self, batch: list[Prepared]) -> list[Any]: ...

    def _finished(self, d: Any) -> list[Result]: ...


def check_images(images: list[np.ndarray]) -> None:
    """Every image an ``(H, W, 3) uint8`` array with pixels, else ValueError naming the first that is not."""
    for i, im in enumerate(images):
        if not (isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.ndim == 3 and im.shape[2] == 3):
            desc = f"{im.dtype} {im.shape}" if isinstance(im, np.ndarray) else type(im).__name__
            raise ValueError(f"image {i}: expected an (H, W, 3) uint8 RGB array, got {desc}")
        if min(im.shape[:2]) < 1:
            raise ValueError(f"image {i}: empty image {im.shape}")


def resized_rgb(image: np.ndarray, min_size: int, max_size: int) -> np.ndarray:
    """``image`` ((H, W, 3) uint8 RGB) resized as detectron2's ``ResizeShortestEdge`` at inference (PIL bilinear):
    a C-contiguous uint8 array of the resized shape (the image itself when no resize is needed)."""
    from detectron2.data.transforms import ResizeShortestEdge, ResizeTransform

    h, w = image.shape[:2]
    shape = ResizeShortestEdge.get_output_shape(h, w, min_size, max_size)
    img = np.ascontiguousarray(image)
    if (h, w) != shape:
        img = ResizeTransform(h, w, shape[0], shape[1], Image.BILINEAR).apply_image(img)
    return np.ascontiguousarray(img)
