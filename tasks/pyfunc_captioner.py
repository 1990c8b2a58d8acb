"""The MLflow ``python_function`` model of a capflow captioner, logged as a *model from code*.

MLflow imports this file when it loads the model (``mlflow.pyfunc.load_model``, ``mlflow models serve``); it is
never pickled, and neither is anything it loads: the model's artifact ``model`` is a capflow model folder
(``model.pt`` read with ``torch.load(weights_only=True)``, ``vocab.json``, ``capflow.json``, ``detector/``) and
:class:`captioning.inference.ImageCaptioner` does the work, exactly as for ``capflow caption``. The ``captioning``
library comes with the model (its ``code/`` folder, MLflow's ``code_paths``), so only the third-party stack pinned
in the model's ``requirements.txt`` (and detectron2: docs/pipeline.md, "The registered model in MLflow") has to be
installed.

Input: a table with one column ``image`` of image file bytes (base64 in a JSON request, ``dataframe_split`` or
``dataframe_records``). Output: a table with one column ``caption``, one row per input row. Params: ``beam``
(beam width, 1 = greedy) and ``max_words``. An input that is not a usable image (not an image, truncated, too
small or too large, too few regions) is refused as a whole with the row and the reason - an MLflow
``INVALID_PARAMETER_VALUE`` error, which the scoring server answers with HTTP 400.

Environment: ``CAPFLOW_DEVICE`` (default ``auto``) and ``CAPFLOW_BATCH_SIZE`` (default 8) when the model loads.

Cost bounds: an image's decoded size is read from its header before any pixel is decoded and must stay within
``CAPFLOW_MAX_DECODED_BYTES`` (default 320 MiB; its mode's bytes per pixel count: a float image costs four times a
grey one), a request's images together within ``CAPFLOW_MAX_REQUEST_DECODED_BYTES`` (default 1 GiB); images are
decoded in the request's own thread before the model is taken, so one request's decoding never holds up another's
captioning.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

IMAGE_COLUMN = "image"
CAPTION_COLUMN = "caption"
MAX_IMAGE_BYTES = 20 * 2**20  # per image, before decoding (decoded size: features.extractor.max_image_pixels)
MAX_DECODED_BYTES = 320 * 2**20  # per image once decoded, its mode counted (an RGB image of 1e8 pixels fits)
MAX_REQUEST_DECODED_BYTES = 1024 * 2**20  # all images of one request once decoded
MAX_IMAGES = 64  # per request
MAX_BEAM = 16


def _invalid(message: str) -> MlflowException:
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def _as_bytes(value: Any, row: int) -> bytes:
    """One cell of the ``image`` column as bytes (base64 text is decoded: a caller without a signature)."""
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if isinstance(value, str):
        try:
            value = base64.b64decode(value, validate=False)
        except (binascii.Error, ValueError) as e:
            raise _invalid(f"row {row}: '{IMAGE_COLUMN}' is not base64-encoded image bytes ({e})") from None
    if not isinstance(value, bytes):
        raise _invalid(f"row {row}: '{IMAGE_COLUMN}' must be image file bytes, got {type(value).__name__}")
    if not value:
        raise _invalid(f"row {row}: '{IMAGE_COLUMN}' is empty")
    if len(value) > MAX_IMAGE_BYTES:
        raise _invalid(f"row {row}: the image has {len(value):,} bytes, more than the {MAX_IMAGE_BYTES:,} accepted")
    return value


def _images(model_input: Any) -> list[bytes]:
    import pandas as pd

    if isinstance(model_input, dict):
        model_input = pd.DataFrame(model_input)
    if not isinstance(model_input, pd.DataFrame):
        raise _invalid(f"expected a table with an '{IMAGE_COLUMN}' column, got {type(model_input).__name__}")
    if IMAGE_COLUMN not in model_input.columns:
        raise _invalid(f"no '{IMAGE_COLUMN}' column (got {', '.join(map(str, model_input.columns)) or 'none'}): "
                       f"send image file bytes, base64-encoded, in the column '{IMAGE_COLUMN}'")
    if len(model_input) > MAX_IMAGES:
        raise _invalid(f"{len(model_input)} images in one request; at most {MAX_IMAGES}")
    return [_as_bytes(v, i) for i, v in enumerate(model_input[IMAGE_COLUMN].tolist())]


def _int_param(params: dict[str, Any], name: str, default: int, high: int) -> int:
    value = params.get(name, default)
    if value is None:
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise _invalid(f"param {name} must be an integer, got {value!r}") from None
    if not 1 <= n <= high:
        raise _invalid(f"param {name} must lie in 1..{high}, got {n}")
    return n


class CaptionerModel(PythonModel):
    """Image bytes -> captions with the model folder in the artifact ``model``."""

    def load_context(self, context) -> None:
        from captioning.inference import ImageCaptioner
        from captioning.training.recipe import max_tokens

        self._max_tokens = max_tokens
        self.captioner = ImageCaptioner(context.artifacts["model"], device=os.environ.get("CAPFLOW_DEVICE", "auto"),
                                        batch_size=int(os.environ.get("CAPFLOW_BATCH_SIZE", "8")), progress=False)
        self.lock = threading.Lock()  # beam / max_words are set on the shared captioner for one call
        self.max_decoded = int(os.environ.get("CAPFLOW_MAX_DECODED_BYTES", MAX_DECODED_BYTES))
        self.max_request_decoded = int(os.environ.get("CAPFLOW_MAX_REQUEST_DECODED_BYTES", MAX_REQUEST_DECODED_BYTES))

    def predict(self, context, model_input, params=None):
        import pandas as pd

        cap = self.captioner
        images = _images(model_input)
        params = dict(params or {})
        beam = _int_param(params, "beam", cap.beam, MAX_BEAM)
        max_words = _int_param(params, "max_words", int(cap.meta["max_words"]), 4 * int(cap.meta["max_words"]))
        if not images:
            return pd.DataFrame({CAPTION_COLUMN: pd.Series([], dtype=str)})
        with tempfile.TemporaryDirectory(prefix="capflow-pyfunc-") as tmp:
            files = []
            for i, data in enumerate(images):
                path = Path(tmp) / f"{i:03d}.img"
                path.write_bytes(data)
                files.append(path)
            decoded = self._decoded(files)  # outside the lock: other requests caption meanwhile
            with self.lock:
                saved = cap.beam, cap.max_tokens
                cap.beam, cap.max_tokens = beam, self._max_tokens(cap.model, max_words, cap.vocab.radix())
                try:
                    res = cap.caption(files, progress=False, decoded=decoded)
                finally:
                    cap.beam, cap.max_tokens = saved
        if res.rejected:
            names = {str(p): i for i, p in enumerate(files)}
            why = "; ".join(f"row {names[r['file']]}: {r['error'].replace(r['file'], 'the image')}"
                            .replace(Path(r["file"]).name, "the image") for r in res.rejected)
            raise _invalid(f"{len(res.rejected)} of {len(files)} images cannot be captioned: {why}")
        return pd.DataFrame({CAPTION_COLUMN: [c["caption"] for c in res.captions]})


    def _decoded(self, files: list[Path]) -> dict[int, Any]:
        """Each file decoded (or the reason it cannot be), after the budgets were checked on the headers."""
        from captioning.features.images import ImageRejected, decoded_bytes

        costs = []
        for i, f in enumerate(files):
            try:
                costs.append(decoded_bytes(f))
            except ImageRejected:
                costs.append(0)  # decoding names the problem
            if costs[-1] > self.max_decoded:
                raise _invalid(f"row {i}: the image decodes to {costs[-1]:,} bytes (its size and mode), more than the "
                               f"{self.max_decoded:,} accepted")
        if sum(costs) > self.max_request_decoded:
            raise _invalid(f"the request's images decode to {sum(costs):,} bytes, more than the "
                           f"{self.max_request_decoded:,} one request may take: send fewer per request")
        out: dict[int, Any] = {}
        for i, f in enumerate(files):
            try:
                out[i] = self.captioner.decode(f)
            except ImageRejected as e:
                out[i] = e.reason
        return out


set_model(CaptionerModel())
