"""Failures of the environment, told in one line: which service or file failed, and what to do.

``capflow`` prints ``capflow COMMAND: error: ...`` and exits with :data:`INFRA_EXIT` (3) when a command failed
because something around it did - the disk is full, the S3 endpoint or the MLflow tracking server does not
answer, Prefect's API is gone, the workdir is busy - as opposed to exit 2 for input it refuses. Finished work
(stages, chunks, epoch checkpoints) is kept, so the same command resumes once the cause is fixed. ``capflow -v``
also prints the traceback.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from captioning.redact import redact

#: exit status of a failure of the environment rather than of the input
INFRA_EXIT = 3
# exception types (by name: their packages are imported lazily) of an S3 endpoint that does not answer
_S3_DOWN = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
            "ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}
_S3_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3")


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes/contexts, outermost first (each once)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _one_line(text: Any, limit: int = 300) -> str:
    s = " ".join(redact(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _s3_endpoint(e: BaseException) -> str:
    """The endpoint capflow was configured with, else the scheme and host of the URL the error names."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        kw = getattr(e, "kwargs", None) or {}
        named = urlparse(str(kw.get("endpoint_url", "")) if isinstance(kw, dict) else "")
        url = f"{named.scheme}://{named.netloc}" if named.netloc else "(the AWS default endpoint)"
    return redact(url)


def describe(exc: BaseException, command: str = "", where: str = "") -> str | None:
    """The one-line account of an infrastructure failure anywhere in ``exc``'s chain, None for other errors.
    ``where`` names what the command was writing (a workdir, a store) for errors that do not name a file."""
    from captioning.errors import InfrastructureError
    from captioning.locks import WorkdirBusy
    from captioning.util import DiskFull, disk_full_message

    for e in chain(exc):
        if isinstance(e, WorkdirBusy | DiskFull):
            return str(e)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            target = e.filename or where
            return disk_full_message(target) if target else "no space left on device: free some space and run again"
        name, module = type(e).__name__, type(e).__module__.split(".")[0]
        if name in _S3_DOWN and module in _S3_MODULES:
            return (f"the S3 endpoint {_s3_endpoint(e)} does not answer ({name}: {_one_line(e, 160)}): start it "
                    "(capflow stack up) or fix AWS_ENDPOINT_URL, then run the same command again - finished chunks "
                    "are kept")
        if isinstance(e, InfrastructureError):  # the tracking server, Prefect, a Dask scheduler, a model server
            return _one_line(e, 1000)
    for e in chain(exc):  # MLflow calls that failed after capflow's retries (tasks.tracking.retry)
        if isinstance(e, RuntimeError) and str(e).startswith("MLflow ") and " failed: " in str(e):
            uri = redact(os.environ.get("MLFLOW_TRACKING_URI", "")) or "the tracking store"
            return (f"the MLflow tracking server {uri} stopped answering: {_one_line(e)}; finished stages are kept "
                    "(their runs are ended KILLED by the next run): bring it back and run the same command again")
    return None
