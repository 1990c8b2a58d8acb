"""Shared fixtures: the real external material, a small synthetic dataset, a quiet environment."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Set before anything imports matplotlib / Prefect / MLflow: no writes to the user's home, no telemetry.
_ENV_TMP = tempfile.mkdtemp(prefix="capflow-tests-env-")
atexit.register(shutil.rmtree, _ENV_TMP, ignore_errors=True)
os.environ["MPLCONFIGDIR"] = str(Path(_ENV_TMP) / "matplotlib")
os.environ["PREFECT_HOME"] = str(Path(_ENV_TMP) / "prefect")
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("DO_NOT_TRACK", "1")

# Parameters of the session's small synthetic dataset (seed 3 gives jpg + png files and every Karpathy split).
SYNTHETIC_IMAGES = 24
SYNTHETIC_SEED = 3


@pytest.fixture(scope="session")
def external() -> Path:
    """The read-only real COCO material (see its README.md); skips the test when it is not available."""
    candidates = [Path(__file__).resolve().parents[2] / "shared" / "external"]
    if os.environ.get("CAPFLOW_EXTERNAL"):
        candidates.append(Path(os.environ["CAPFLOW_EXTERNAL"]))
    for c in candidates:
        if (c / "README.md").is_file():
            return c
    pytest.skip("external COCO material not found (set CAPFLOW_EXTERNAL)")


@pytest.fixture(scope="session")
def synthetic_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder with ``dataset.json`` and ``images/`` of a 24-image synthetic dataset, generated once.

    Treat it as read-only: copy it (``shutil.copytree``) before planting faults.
    """
    from captioning.data.synthetic import generate_synthetic

    out = tmp_path_factory.mktemp("synthetic_small")
    generate_synthetic(out, SYNTHETIC_IMAGES, SYNTHETIC_SEED, min_size=64, max_size=112)
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a whole module (CPU extraction is bit-exact per thread count; steadier timings on a
    shared 2-core machine), restored afterwards. Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests run only where CUDA is present; elsewhere they are skipped with the reason."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no CUDA either
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
