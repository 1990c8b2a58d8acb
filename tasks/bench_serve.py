"""``capflow bench serve``: a bounded load check of a capflow model behind MLflow's scoring server.

The real server (``mlflow models serve --env-manager local`` on 127.0.0.1, :mod:`tasks.model_server`) is started
for the model; each client sends ``requests`` single-image requests (real image files, base64) at concurrency 1,
4, 16 ...; per level: requests/s, p50/p95/max latency, errors. Every answer is checked against the caption the
first sequential request of that image gave (a server that answers fast but wrong is not faster). The anchor is
concurrency 1 measured in the same run: ``throughput_cN`` = requests/s at N over requests/s at 1.

The server runs the model's own ``code/`` (MLflow imports it): before starting it, the model is downloaded and its
code compared with the installed capflow library; a model whose code differs is refused unless ``trust_code``
(``--trust-model-code``).
"""

from __future__ import annotations

import base64
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from captioning.bench.machine import machine_info
from tasks.mlflow_models import check_model_code, local_model
from tasks.model_server import mlflow_model_server


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run(model_uri: str, images: Sequence[Path], *, concurrency: Sequence[int] = (1, 4, 16), requests: int = 32,
        beam: int | None = None, workers: int = 1, workdir: str | None = None,
        env: dict[str, str] | None = None, trust_code: bool = False) -> dict[str, Any]:
    if not images:
        raise ValueError("bench serve needs image files (--images-dir)")
    if requests < 1 or min(concurrency) < 1:
        raise ValueError("--requests and every --concurrency level must be >= 1")
    payloads = [base64.b64encode(Path(p).read_bytes()).decode() for p in images]
    params = {"beam": beam} if beam else {}
    with tempfile.TemporaryDirectory(prefix="capflow-bench-serve-", dir=workdir) as tmp:
        root = local_model(model_uri, Path(tmp) / "model", (env or {}).get("MLFLOW_TRACKING_URI"))
        code = None if trust_code else check_model_code(root)
        t0 = time.perf_counter()
        with mlflow_model_server(str(root), Path(tmp) / "serve.log", env=env, workers=workers) as server:
            startup = time.perf_counter() - t0

            def call(i: int) -> tuple[float, int, str | None]:
                body = {"dataframe_split": {"columns": ["image"], "data": [[payloads[i % len(payloads)]]]},
                        **({"params": params} if params else {})}
                s = time.perf_counter()
                status, answer = server.post(body)
                caption = answer["predictions"][0]["caption"] if status == 200 else None
                return time.perf_counter() - s, status, caption

            # the expected caption of every image (and the warm-up: first calls load lazily initialised parts)
            expected = {i: call(i)[2] for i in range(len(payloads))}
            rows = []
            for c in concurrency:
                t = time.perf_counter()
                with ThreadPoolExecutor(max_workers=c) as pool:
                    results = list(pool.map(call, range(requests)))
                wall = time.perf_counter() - t
                lat = [r[0] for r in results if r[1] == 200]
                wrong = sum(1 for i, r in enumerate(results) if r[1] == 200 and r[2] != expected[i % len(payloads)])
                rows.append({"concurrency": c, "requests": requests, "ok": len(lat),
                             "errors": sum(1 for r in results if r[1] != 200), "wrong_captions": wrong,
                             "seconds": wall, "requests_per_s": len(lat) / wall if wall > 0 else float("nan"),
                             "p50_ms": 1000 * _percentile(lat, 50), "p95_ms": 1000 * _percentile(lat, 95),
                             "max_ms": 1000 * max(lat) if lat else float("nan")})
    anchor = rows[0]["requests_per_s"]
    return {"bench": "serve", "model": model_uri, "images": len(payloads), "startup_s": startup,
            "params": {"concurrency": list(concurrency), "requests": requests, "beam": beam, "workers": workers},
            "model_code": {"sha256": code, "checked": not trust_code},
            "anchor": f"concurrency {concurrency[0]}", "rows": rows,
            "ratios": {f"throughput_c{r['concurrency']}": r["requests_per_s"] / anchor for r in rows[1:]},
            "machine": machine_info(device=(env or {}).get("CAPFLOW_DEVICE")
                                    or os.environ.get("CAPFLOW_DEVICE", "auto"))}
