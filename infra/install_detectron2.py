"""Install a patched, pure-Python detectron2 0.6 into a target interpreter.

detectron2 is not published on PyPI under its own name and GitHub cannot be
reached from the build machines.  PyPI does carry ``pb1-detectron2`` 0.6, an
sdist of upstream detectron2 v0.6 (Apache-2.0), but it cannot be installed as
is:

* pip refuses it (``Distributions from PyPI cannot declare direct URL
  dependencies``) because of the ``panopticapi @ https://...`` optional extra;
* it lacks the C++/CUDA sources (``detectron2/layers/csrc``) yet
  ``detectron2.layers`` imports ``detectron2._C`` at import time;
* ``model_zoo.get_config_file`` uses ``pkg_resources`` (gone from
  setuptools >= 81) and the model-zoo YAML files are not declared as package
  data;
* it uses ``Image.LINEAR`` (removed in Pillow 10) and ``np.bool``/``np.int``/
  ``np.float``/``np.str`` (removed in NumPy 1.24/2).

This script (standard library only, because it runs before the project is
installed) therefore:

1. exits at once if the target interpreter already imports detectron2 -- this
   script's own build at the current patch level, or any detectron2 that was
   not built by this script (e.g. upstream built from source) -- unless
   ``--force``; or if ``CAPFLOW_SKIP_DETECTRON2=1`` is set;
2. downloads the pinned sdist (or reuses a cached copy) and checks its sha256;
3. unpacks it into a temporary directory and applies the patches listed in
   ``PATCHES`` below (each patch asserts that it applied, so a different sdist
   fails loudly), adds a placeholder ``detectron2/_C.py`` that raises a clear
   error when a C++ op (rotated boxes, deformable conv, ...) is called;
4. runs ``<python> -m pip install --no-build-isolation --no-deps`` on the
   patched folder (no C++ extension is built); the distribution is named
   ``detectron2`` with version ``0.6+capflow.<PATCH_LEVEL>``;
5. checks the install by building a Faster R-CNN R101-C4 model on the CPU in
   the target interpreter.

Usage::

    python infra/install_detectron2.py [--python VENV_PYTHON] [--cache-dir DIR]
                                       [--sdist FILE] [--force]

torch, torchvision, pip, setuptools (and wheel if setuptools < 70.1), plus detectron2's runtime
dependencies (fvcore, iopath, yacs, termcolor, tabulate, cloudpickle,
omegaconf, hydra-core, pycocotools, matplotlib, Pillow, tqdm) must already be
installed in the target interpreter; they come from the project's own
requirements.  The package index is ``$PIP_INDEX_URL`` when that is set (a
PEP 503/691 "simple" URL), otherwise https://pypi.org/simple.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

# --------------------------------------------------------------------------
# Pinned source
# --------------------------------------------------------------------------
SDIST_PROJECT = "pb1-detectron2"
SDIST_VERSION = "0.6"
SDIST_FILENAME = "pb1-detectron2-0.6.tar.gz"
SDIST_SHA256 = "5d2e9e51e523ec72f6a31cca04b0a515492e9514b773a3d134cedc0677170b29"
SDIST_SIZE = 518_688
# Direct file URL as listed by https://pypi.org/simple/pb1-detectron2/ (used
# when the index lookup fails; the sha256 check applies either way).
SDIST_URL = (
    "https://files.pythonhosted.org/packages/60/26/"
    "48f5bbb7ee492696a21da23303daeecdfe3942c498a70d34108acf63b2bd/pb1-detectron2-0.6.tar.gz"
)
DEFAULT_INDEX_URL = "https://pypi.org/simple"

# Bump PATCH_LEVEL whenever PATCHES change: an install with an older marker
# is then replaced on the next run.
PATCH_LEVEL = "1"
DIST_NAME = "detectron2"
DIST_VERSION = f"{SDIST_VERSION}+capflow.{PATCH_LEVEL}"
MARKER_ATTR = "_capflow_patch"

SKIP_ENV = "CAPFLOW_SKIP_DETECTRON2"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "detectron2"
FALLBACK_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
HTTP_TIMEOUT_S = 120
VERIFY_CONFIG = "COCO-Detection/faster_rcnn_R_101_C4_3x.yaml"


class InstallError(RuntimeError):
    """A failure with a message meant for the user (printed without traceback)."""


class ChecksumError(InstallError):
    """The index or a download disagrees with the pinned sha256."""


def log(msg: str) -> None:
    print(f"[install_detectron2] {msg}", flush=True)


# --------------------------------------------------------------------------
# Target interpreter helpers
# --------------------------------------------------------------------------
def run_python(python: str, code: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -c code`` from an empty directory (so that no stray
    ``detectron2`` folder in the cwd is picked up)."""
    with tempfile.TemporaryDirectory(prefix="d2-probe-") as cwd:
        return subprocess.run(
            [python, "-c", code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


_PROBE_CODE = textwrap.dedent(
    f"""
    import importlib.util, json
    out = {{}}
    try:
        import detectron2
    except Exception as e:
        out["error"] = "%s: %s" % (type(e).__name__, e)
    else:
        out["file"] = getattr(detectron2, "__file__", None)
        out["version"] = getattr(detectron2, "__version__", None)
        out["marker"] = getattr(detectron2, "{MARKER_ATTR}", None)
        try:
            spec = importlib.util.find_spec("detectron2._C")
            out["c_origin"] = spec.origin if spec else None
        except Exception:
            out["c_origin"] = None
    print("D2PROBE" + json.dumps(out))
    """
)


def probe_installed(python: str) -> dict:
    """What ``import detectron2`` gives in the target interpreter."""
    try:
        proc = run_python(python, _PROBE_CODE, timeout=300)
    except OSError as exc:
        raise InstallError(f"cannot run the target interpreter {python}: {exc}") from None
    except subprocess.TimeoutExpired:
        return {"error": "timed out importing detectron2"}
    for line in proc.stdout.splitlines():
        if line.startswith("D2PROBE"):
            return json.loads(line[len("D2PROBE") :])
    return {"error": f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"}


def check_target(python: str) -> None:
    """Fail early, with a clear message, if the build prerequisites are missing."""
    code = textwrap.dedent(
        """
        import importlib, sys
        missing = []
        import importlib.util
        # setuptools first: importing pip before it trips setuptools' distutils hack
        for mod in ("setuptools", "torch", "torchvision"):
            try:
                importlib.import_module(mod)
            except Exception as e:
                missing.append("%s (%s: %s)" % (mod, type(e).__name__, e))
        if importlib.util.find_spec("pip") is None:
            missing.append("pip")
        try:  # setuptools >= 70.1 has bdist_wheel built in; older needs `wheel`
            importlib.import_module("setuptools.command.bdist_wheel")
        except Exception:
            try:
                importlib.import_module("wheel.bdist_wheel")
            except Exception:
                missing.append("wheel (needed with setuptools < 70.1)")
        print("D2MISSING" + ";".join(missing))
        """
    )
    try:
        proc = run_python(python, code, timeout=600)
    except FileNotFoundError:
        raise InstallError(f"target interpreter not found: {python}") from None
    except subprocess.TimeoutExpired:
        raise InstallError(f"target interpreter {python} timed out importing torch/torchvision") from None
    line = next((s for s in proc.stdout.splitlines() if s.startswith("D2MISSING")), None)
    if line is None:
        raise InstallError(f"cannot run target interpreter {python}: {proc.stderr.strip()[-2000:]}")
    missing = line[len("D2MISSING") :]
    if missing:
        raise InstallError(
            f"the target interpreter {python} lacks build prerequisites: {missing}. "
            "Install the project requirements (torch, torchvision, setuptools, wheel, ...) first."
        )


# --------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------
def _ca_bundle() -> str | None:
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        path = os.environ.get(var)
        if path and os.path.isfile(path):
            return path
    return next((p for p in FALLBACK_CA_BUNDLES if os.path.isfile(p)), None)


def _is_cert_error(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, ssl.SSLError) or isinstance(exc, ssl.SSLError)


def http_get(url: str, headers: dict | None = None) -> tuple[bytes, str]:
    """GET ``url``; returns (body, content type).  Retries HTTPS with the
    system/pip CA bundle if default certificate verification fails."""
    req = urllib.request.Request(url, headers={"User-Agent": "capflow-install-detectron2", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.URLError as exc:
        bundle = _ca_bundle()
        if not (url.startswith("https:") and _is_cert_error(exc) and bundle):
            raise
        log(f"default certificate verification failed ({exc.reason}); retrying with CA bundle {bundle}")
        ctx = ssl.create_default_context(cafile=bundle)
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S, context=ctx) as resp:
            return resp.read(), resp.headers.get("Content-Type", "")


# URLError/HTTPError/ssl errors are OSErrors; bad JSON is a ValueError; 'not listed' a LookupError.
_FETCH_ERRORS = (OSError, ValueError, LookupError, http.client.HTTPException)


def _index_url() -> str:
    url = (os.environ.get("PIP_INDEX_URL") or "").strip()
    if not url or "://" not in url:
        return DEFAULT_INDEX_URL
    return url.rstrip("/")


def find_sdist_url(index_url: str) -> str:
    """Look up SDIST_FILENAME on a PEP 691 (JSON) or PEP 503 (HTML) simple index."""
    page = f"{index_url}/{SDIST_PROJECT}/"
    fetch = page
    if page.startswith("file:"):  # local PEP 503 tree, as pip reads it
        local = urllib.request.url2pathname(urllib.parse.urlsplit(page).path)
        if os.path.isdir(local):
            fetch = page + "index.html"
    body, ctype = http_get(
        fetch,
        headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"},
    )
    if "json" in ctype:
        for entry in json.loads(body).get("files", []):
            if entry.get("filename") == SDIST_FILENAME:
                listed = (entry.get("hashes") or {}).get("sha256")
                if listed and listed != SDIST_SHA256:
                    raise ChecksumError(
                        f"the index {index_url} lists {SDIST_FILENAME} with sha256 {listed}, "
                        f"not the pinned {SDIST_SHA256}; refusing to continue"
                    )
                return urllib.parse.urljoin(page, entry["url"])
    else:
        for href in re.findall(r'href\s*=\s*["\']([^"\']+)["\']', body.decode("utf-8", "replace")):
            href = href.replace("&amp;", "&")
            name = urllib.parse.unquote(urllib.parse.urlsplit(href).path.rsplit("/", 1)[-1])
            if name == SDIST_FILENAME:
                return urllib.parse.urljoin(page, href.split("#", 1)[0])
    raise LookupError(f"{SDIST_FILENAME} is not listed on {page}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sdist(path: Path) -> None:
    digest = sha256_of(path)
    if digest != SDIST_SHA256:
        raise ChecksumError(
            f"sha256 mismatch for {path}: got {digest}, expected {SDIST_SHA256} "
            f"({SDIST_FILENAME}, {SDIST_SIZE} bytes). Refusing to install an unverified file; "
            "delete it and retry, or check what your index/proxy serves."
        )


def obtain_sdist(cache_dir: Path, local_sdist: Path | None) -> Path:
    """Return a verified copy of the sdist in ``cache_dir``."""
    if local_sdist is not None:
        if not local_sdist.is_file():
            raise InstallError(f"--sdist file not found: {local_sdist}")
        verify_sdist(local_sdist)
        log(f"using local sdist {local_sdist} (sha256 ok)")
        return local_sdist

    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / SDIST_FILENAME
    if target.is_file():
        if sha256_of(target) == SDIST_SHA256:
            log(f"using cached {target} (sha256 ok)")
            return target
        log(f"cached {target} has the wrong sha256; downloading again")
        target.unlink()

    index_url = _index_url()
    urls: list[str] = []
    try:
        urls.append(find_sdist_url(index_url))
    except ChecksumError:
        raise
    except _FETCH_ERRORS as exc:  # network/parse problems: fall back to the pinned URL
        log(f"index lookup on {index_url} failed ({type(exc).__name__}: {exc}); trying the pinned URL")
    if SDIST_URL not in urls:
        urls.append(SDIST_URL)

    errors = []
    for url in urls:
        log(f"downloading {url}")
        try:
            data, _ = http_get(url)
        except _FETCH_ERRORS as exc:
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != SDIST_SHA256:
            raise ChecksumError(
                f"sha256 mismatch for {url}: got {digest} ({len(data)} bytes), expected "
                f"{SDIST_SHA256} ({SDIST_SIZE} bytes). Refusing to install an unverified file."
            )
        tmp = target.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        log(f"saved {target} ({len(data)} bytes, sha256 ok)")
        return target
    raise InstallError(
        f"could not download {SDIST_FILENAME}:\n  "
        + "\n  ".join(errors)
        + f"\nDownload it by other means and pass --sdist FILE (sha256 {SDIST_SHA256}), "
        f"or put it into {cache_dir}."
    )


def unpack(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without PEP 706 backports
            for member in tar.getmembers():
                p = (dest / member.name).resolve()
                if not str(p).startswith(str(dest.resolve())) or member.issym() or member.islnk():
                    raise InstallError(f"unsafe member in {sdist}: {member.name}")
            tar.extractall(dest)
    root = dest / f"{SDIST_PROJECT}-{SDIST_VERSION}"
    if not (root / "setup.py").is_file():
        raise InstallError(f"unexpected sdist layout: {root}/setup.py not found")
    return root


# --------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------
# (file, old, new, expected number of occurrences of `old`)
PATCHES: list[tuple[str, str, str, int]] = [
    # --- setup.py -------------------------------------------------------
    # Distribution name: `pip show detectron2` works and an upstream install
    # later replaces this one cleanly.
    ("setup.py", 'name="pb1-detectron2",', f'name="{DIST_NAME}",', 1),
    # No torch import at build time: there is no C++ extension to build.
    (
        "setup.py",
        (
            "import torch\nfrom torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension\n\n"
            'torch_ver = [int(x) for x in torch.__version__.split(".")[:2]]\n'
            'assert torch_ver >= [1, 8], "Requires PyTorch >= 1.8"\n'
        ),
        "# capflow: no torch import, no C++ extension (the sdist lacks detectron2/layers/csrc).\n",
        1,
    ),
    ("setup.py", "    ext_modules=get_extensions(),\n", "    ext_modules=[],\n", 1),
    ("setup.py", '    cmdclass={"build_ext": torch.utils.cpp_extension.BuildExtension},\n', "", 1),
    # Only ship detectron2 (the sdist also has a top-level `tools` package).
    (
        "setup.py",
        'packages=find_packages(exclude=("configs", "tests*"))',
        'packages=find_packages(include=("detectron2", "detectron2.*"))',
        1,
    ),
    # Model-zoo configs live in detectron2/model_zoo/configs in this sdist;
    # declare them relative to the package instead of a top-level configs/.
    (
        "setup.py",
        'package_data={"detectron2.model_zoo": get_model_zoo_configs()},',
        'package_data={"detectron2.model_zoo": _capflow_model_zoo_configs()},',
        1,
    ),
    (
        "setup.py",
        "# For projects that are relative small",
        textwrap.dedent(
            '''\
            def _capflow_model_zoo_configs() -> List[str]:
                """capflow: config files relative to the detectron2.model_zoo package."""
                pkg = path.join(path.dirname(path.realpath(__file__)), "detectron2", "model_zoo")
                found = []
                for dirpath, _, files in os.walk(path.join(pkg, "configs")):
                    for name in files:
                        if name.endswith((".yaml", ".py")):
                            found.append(path.relpath(path.join(dirpath, name), pkg))
                assert found, "capflow: no model-zoo configs found"
                return sorted(found)


            # For projects that are relative small'''
        ),
        1,
    ),
    # pip rejects direct URL dependencies of PyPI distributions.
    ("setup.py", '            "panopticapi @ https://github.com/cocodataset/panopticapi/archive/master.zip",\n', "", 1),
    # Build/dev-only or unneeded requirements that the project does not
    # install (detectron2 is installed with --no-deps; keeping them would only
    # make `pip check` fail).
    ("setup.py", '        "tensorboard",\n', "", 1),
    ("setup.py", '        "future",  # used by caffe2\n', "", 1),
    ("setup.py", '        "pydot",  # used to save caffe2 SVGs\n', "", 1),
    ("setup.py", "        \"dataclasses; python_version<'3.7'\",\n", "", 1),
    ("setup.py", '        "black==21.4b2",\n', "", 1),
    # --- package marker ----------------------------------------------------
    (
        "detectron2/__init__.py",
        "setup_environment()\n",
        (
            "setup_environment()\n\n"
            "# Installed by capflow's infra/install_detectron2.py (pure Python, no C++ ops).\n"
            f'{MARKER_ATTR} = "{PATCH_LEVEL}"\n'
        ),
        1,
    ),
    # --- pkg_resources (removed from setuptools >= 81) ----------------------
    ("detectron2/model_zoo/model_zoo.py", "import pkg_resources\n", "", 1),
    (
        "detectron2/model_zoo/model_zoo.py",
        (
            "cfg_file = pkg_resources.resource_filename(\n"
            '        "detectron2.model_zoo", os.path.join("configs", config_path)\n    )'
        ),
        'cfg_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", config_path)',
        1,
    ),
    # --- Pillow >= 10 -------------------------------------------------------
    ("detectron2/data/transforms/transform.py", "interp=Image.LINEAR", "interp=Image.BILINEAR", 1),
    # --- black is optional (only LazyConfig.to_py pretty-prints with it) ----
    (
        "detectron2/config/lazy.py",
        "        import black\n",
        (
            "        try:\n            import black\n"
            "        except ImportError:  # capflow: black is optional\n"
            "            black = None\n"
        ),
        1,
    ),
    (
        "detectron2/config/lazy.py",
        "        py_str = _to_str(cfg, prefix=[prefix])\n        try:\n",
        (
            "        py_str = _to_str(cfg, prefix=[prefix])\n"
            "        if black is None:\n            return py_str\n        try:\n"
        ),
        1,
    ),
    # --- caffe2 is not shipped with torch 2.x: keep detectron2.export
    # (TracingAdapter, scripting) and detectron2.utils.analysis importable;
    # only Caffe2Tracer & co. are unavailable.
    (
        "detectron2/export/__init__.py",
        "from .api import *\n",
        (
            "try:\n    from .api import *\nexcept ModuleNotFoundError as _e:  # capflow: no caffe2 in torch 2.x\n"
            '    if not (_e.name or "").startswith("caffe2"):\n        raise\n'
        ),
        1,
    ),
    # --- rotated NMS: give the placeholder's clear error, not a missing torch.ops op
    (
        "detectron2/layers/nms.py",
        "    return torch.ops.detectron2.nms_rotated(boxes, scores, iou_threshold)\n",
        (
            "    from detectron2 import _C  # capflow: pure-Python placeholder, raises a clear error\n\n"
            "    return _C.nms_rotated(boxes, scores, iou_threshold)\n"
        ),
        1,
    ),
]

# NumPy aliases removed in NumPy 1.24 / 2.0 -> builtin types.
NUMPY_ALIAS_RE = re.compile(r"\bnp\.(bool|int|float|str|object|long)\b")
NUMPY_ALIAS_FILES = {
    "detectron2/evaluation/pascal_voc_evaluation.py": 2,
    "detectron2/evaluation/sem_seg_evaluation.py": 7,
    "detectron2/structures/masks.py": 3,
    "detectron2/data/datasets/pascal_voc.py": 1,
    "detectron2/data/build.py": 2,
    "detectron2/utils/visualizer.py": 3,
    "detectron2/utils/video_visualizer.py": 1,
}
NUMPY_ALIAS_TARGET = {"bool": "bool", "int": "int", "float": "float", "str": "str", "object": "object", "long": "int"}

PLACEHOLDER_C = '''\
"""Placeholder for detectron2's compiled extension ``detectron2._C``.

Written by capflow's infra/install_detectron2.py: the PyPI sdist this build
comes from lacks the C++/CUDA sources, so no extension is compiled.  Importing
this module works (``detectron2.layers`` imports it at import time); calling
any C++ op raises ``CppOpsUnavailableError`` with an explanation.  Faster /
Mask R-CNN with axis-aligned boxes only use torchvision's ops and work.
"""

CAPFLOW_PLACEHOLDER = True


class CppOpsUnavailableError(RuntimeError):
    """A detectron2 C++/CUDA op was called but the extension was not built."""


_MESSAGE = (
    "detectron2 C++ op '{name}' is unavailable: this detectron2 was installed by capflow's "
    "infra/install_detectron2.py without its C++/CUDA extension (the PyPI sdist lacks "
    "detectron2/layers/csrc). C++ ops back rotated boxes (pairwise_iou_rotated, nms_rotated, "
    "ROIAlignRotated), deformable convolution (DeformConv, ModulatedDeformConv) and "
    "COCOEvaluator(use_fast_impl=True) -- use COCOEvaluator(..., use_fast_impl=False), or install "
    "detectron2 built from source (run the installer with CAPFLOW_SKIP_DETECTRON2=1)."
)


def _unavailable(name):
    def op(*args, **kwargs):
        raise CppOpsUnavailableError(_MESSAGE.format(name=name))

    op.__name__ = op.__qualname__ = name
    return op


def get_compiler_version():
    return "none (capflow placeholder: detectron2 C++ extension not built)"


def get_cuda_version():
    return "none (capflow placeholder: detectron2 C++ extension not built)"


def has_cuda():
    return False


def __getattr__(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
'''


def _replace(root: Path, rel: str, old: str, new: str, expected: int) -> None:
    path = root / rel
    text = path.read_text(encoding="utf-8")
    found = text.count(old)
    if found != expected:
        raise InstallError(
            f"patch did not apply to {rel}: expected {expected} occurrence(s) of {old.strip()[:80]!r}, "
            f"found {found}. The sdist content differs from the pinned {SDIST_FILENAME}."
        )
    path.write_text(text.replace(old, new), encoding="utf-8")


def apply_patches(root: Path) -> list[str]:
    """Patch the unpacked sdist in place; returns a short description list."""
    applied = []
    for rel, old, new, expected in PATCHES:
        _replace(root, rel, old, new, expected)
        applied.append(f"{rel}: {old.strip().splitlines()[0][:70]}")

    for rel, expected in NUMPY_ALIAS_FILES.items():
        path = root / rel
        text = path.read_text(encoding="utf-8")
        new_text, n = NUMPY_ALIAS_RE.subn(lambda m: NUMPY_ALIAS_TARGET[m.group(1)], text)
        if n != expected:
            raise InstallError(
                f"patch did not apply to {rel}: expected {expected} NumPy alias use(s), found {n}. "
                f"The sdist content differs from the pinned {SDIST_FILENAME}."
            )
        path.write_text(new_text, encoding="utf-8")
        applied.append(f"{rel}: {n} removed NumPy alias(es)")
    leftovers = [
        f"{p.relative_to(root)}:{i}"
        for p in sorted((root / "detectron2").rglob("*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if NUMPY_ALIAS_RE.search(line)
    ]
    if leftovers:
        raise InstallError(f"unpatched NumPy aliases remain: {', '.join(leftovers)}")

    c_module = root / "detectron2" / "_C.py"
    if c_module.exists() or list((root / "detectron2").glob("_C*.so")):
        raise InstallError("the sdist unexpectedly ships detectron2._C; refusing to overwrite it")
    c_module.write_text(PLACEHOLDER_C, encoding="utf-8")
    applied.append("detectron2/_C.py: pure-Python placeholder")

    zoo_cfg = root / "detectron2" / "model_zoo" / "configs"
    if not (zoo_cfg / VERIFY_CONFIG).is_file():
        top_cfg = root / "configs"
        if not (top_cfg / VERIFY_CONFIG).is_file():
            raise InstallError(f"model-zoo config {VERIFY_CONFIG} not found in the sdist")
        shutil.rmtree(zoo_cfg, ignore_errors=True)
        shutil.copytree(top_cfg, zoo_cfg)
        applied.append("copied configs/ into detectron2/model_zoo/configs")

    # Stale metadata of the original distribution name.
    shutil.rmtree(root / "pb1_detectron2.egg-info", ignore_errors=True)
    return applied


# --------------------------------------------------------------------------
# Build, install, verify
# --------------------------------------------------------------------------
def pip_install(python: str, src: Path) -> None:
    env = dict(os.environ)
    env["D2_VERSION_SUFFIX"] = f"+capflow.{PATCH_LEVEL}"  # read by detectron2's setup.py
    env.pop("BUILD_NIGHTLY", None)
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--force-reinstall",
        str(src),
    ]
    log("running: " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise InstallError(
            f"pip install failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    tail = [s for s in proc.stdout.splitlines() if s.startswith("Successfully")]
    log(tail[-1] if tail else "pip install finished")


VERIFY_CODE = textwrap.dedent(
    f"""
    import detectron2
    from detectron2.config import get_cfg
    from detectron2 import model_zoo
    import detectron2.checkpoint
    cfg = get_cfg()
    cfg.merge_from_file(model_zoo.get_config_file({VERIFY_CONFIG!r}))
    from detectron2.modeling import build_model
    cfg.MODEL.DEVICE = "cpu"
    m = build_model(cfg)
    assert type(m).__name__ == "GeneralizedRCNN", type(m)
    print("D2VERIFY %s (patch level %s) at %s, build_model OK" % (
        detectron2.__version__, getattr(detectron2, {MARKER_ATTR!r}, None), detectron2.__path__[0]))
    """
)


def verify(python: str) -> str:
    try:
        proc = run_python(python, VERIFY_CODE, timeout=900)
    except subprocess.TimeoutExpired:
        raise InstallError("verification timed out (building the R101-C4 model took > 15 min)") from None
    line = next((s for s in proc.stdout.splitlines() if s.startswith("D2VERIFY")), None)
    if proc.returncode != 0 or line is None:
        raise InstallError(
            "detectron2 was installed but the verification import/build_model failed:\n" + proc.stderr.strip()[-4000:]
        )
    return line[len("D2VERIFY ") :]


def describe(info: dict) -> str:
    if info.get("marker") is not None:
        kind = f"capflow pure-Python build, patch level {info['marker']}"
    elif info.get("c_origin") and not str(info["c_origin"]).endswith(".py"):
        kind = "with compiled C++ extension"
    else:
        kind = "not installed by this script"
    return f"version {info.get('version')}, {kind}, at {os.path.dirname(info.get('file') or '?')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Install a patched pure-Python detectron2 0.6 (from the pb1-detectron2 sdist).",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter to install into (default: the one running this script)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"download cache (default: {DEFAULT_CACHE_DIR})"
    )
    parser.add_argument(
        "--sdist", type=Path, default=None, help=f"use this local copy of {SDIST_FILENAME} instead of downloading"
    )
    parser.add_argument("--force", action="store_true", help="reinstall even if detectron2 imports")
    args = parser.parse_args(argv)

    if os.environ.get(SKIP_ENV, "").strip() == "1":
        log(
            f"{SKIP_ENV}=1: skipping; install upstream detectron2 yourself "
            "(e.g. built from https://github.com/facebookresearch/detectron2)."
        )
        return 0

    python = args.python
    if os.sep in python or (os.altsep and os.altsep in python):
        python = os.path.abspath(python)
    started = time.monotonic()
    try:
        if not args.force:
            info = probe_installed(python)
            if "error" not in info and info.get("marker") in (None, PATCH_LEVEL):
                print(
                    f"detectron2 already installed ({describe(info)}); nothing to do (use --force to reinstall).",
                    flush=True,
                )
                return 0
            if "error" in info:
                log(f"detectron2 not importable yet ({(info['error'].strip().splitlines() or ['?'])[-1][:200]})")
            else:
                log(f"replacing detectron2 with patch level {info.get('marker')} by patch level {PATCH_LEVEL}")

        check_target(python)
        sdist = obtain_sdist(args.cache_dir.resolve(), args.sdist.resolve() if args.sdist else None)
        with tempfile.TemporaryDirectory(prefix="d2-build-") as tmp:
            root = unpack(sdist, Path(tmp))
            applied = apply_patches(root)
            log(f"applied {len(applied)} patches")
            pip_install(python, root)
        log("verifying (build_model on CPU for " + VERIFY_CONFIG + ") ...")
        result = verify(python)
        log(f"OK: detectron2 {result} ({time.monotonic() - started:.0f} s)")
        return 0
    except InstallError as exc:
        print(f"[install_detectron2] ERROR: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
