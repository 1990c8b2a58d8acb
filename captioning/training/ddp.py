"""Data-parallel training on one machine: N processes, one process group (gloo on CPU, NCCL on CUDA).

:func:`launch` spawns the processes and runs ``fn(rank, world_size, *args)`` in each, inside an initialised
default process group; :func:`captioning.training.loop.train` called there trains data-parallel by itself (every
rank reads the same global batches and trains on its own contiguous slice, see :func:`shard`).

Everything stays on the loopback interface: the rendezvous store is served by the calling process on a socket
bound to 127.0.0.1 (so no free-port race), and gloo/NCCL are told to use the loopback interface.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from captioning.data.loader import Batch

HOST = "127.0.0.1"

_RANK_DEVICE: torch.device | None = None  # set by launch() in each spawned process


class RankFailed(RuntimeError):
    """A rank of :func:`launch` failed with an exception that could not be re-raised as itself."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


# ---------------------------------------------------------------------- state of this process
def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return world()[1] > 1


def rank_device() -> torch.device:
    """The device :func:`launch` gave this rank (``cuda:rank`` or ``cpu``); ``cpu`` outside launch."""
    return _RANK_DEVICE if _RANK_DEVICE is not None else torch.device("cpu")


# ---------------------------------------------------------------------- batch slicing
def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of n items; sizes differ by at most one (lower ranks get more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Images ``start:stop`` of a batch (views; the region and token padding of the whole batch is kept)."""
    return Batch(*(getattr(batch, f.name)[start:stop] for f in fields(Batch)))


def shard(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous slice of a global batch (possibly empty when the batch has fewer images than ranks)."""
    return slice_batch(batch, *shard_bounds(len(batch), rank, world_size))


# ---------------------------------------------------------------------- launching
def launch(fn: Callable[..., Any], nproc: int, *args: Any, backend: str | None = None,
           device: str | torch.device = "cpu", threads: int | None = None,
           timeout: timedelta = timedelta(minutes=60)) -> Any:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` spawned processes joined in one process group.

    ``backend`` defaults to ``nccl`` for a CUDA ``device`` (rank r uses ``cuda:r``, see :func:`rank_device`) and
    ``gloo`` otherwise. Each process uses ``threads`` torch threads (default: CPUs // nproc, at least 1).
    ``timeout`` bounds every collective (rank 0 validates while the others wait in one).

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Returns rank 0's return value (it must
    be picklable). If a rank raises, the first exception raised is re-raised here with the rank's traceback as a
    note (or :class:`RankFailed` when it cannot be transported); the other ranks are terminated.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, not {nproc}")
    dev_type = torch.device(device).type
    if dev_type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"{nproc} processes need {nproc} CUDA devices, {torch.cuda.device_count()} visible")
    backend = backend or ("nccl" if dev_type == "cuda" else "gloo")
    if threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cpus // nproc)
    # the rendezvous store lives here, on a socket bound to the loopback address (the store owns and closes it)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        sock.listen(max(128, 2 * nproc))
        port = sock.getsockname()[1]
        fd = sock.detach()
    try:
        store = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    try:
        with tempfile.TemporaryDirectory(prefix="capflow-ddp-") as tmp:
            spec = (fn, args, nproc, backend, dev_type, port, threads, timeout, tmp)
            try:
                mp.start_processes(_run_rank, args=(spec,), nprocs=nproc, join=True, start_method="spawn")
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                _reraise(Path(tmp), e)
            # pickle is safe here: the folder is this call's own mkdtemp (mode 0700) and only the ranks spawned
            # above, this process's children, write into it; nothing from another user or machine is read
            with open(Path(tmp) / "result.pkl", "rb") as f:
                return pickle.load(f)
    finally:
        del store  # stop serving


def _run_rank(rank: int, spec: tuple) -> None:
    global _RANK_DEVICE
    fn, args, nproc, backend, dev_type, port, threads, timeout, tmp = spec
    try:
        torch.set_num_threads(threads)
        os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        lo = _loopback_interface()
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
        if dev_type == "cuda":
            torch.cuda.set_device(rank)
            _RANK_DEVICE = torch.device("cuda", rank)
        else:
            _RANK_DEVICE = torch.device("cpu")
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=timeout)
        try:
            out = fn(rank, nproc, *args)
        except BaseException as e:
            # recorded before the group goes: its end is what makes the other ranks fail (later) in collectives
            _record_failure(Path(tmp), rank, e)
            raise
        finally:
            dist.destroy_process_group()
        if rank == 0:
            part = Path(tmp) / "result.pkl.part"
            with open(part, "wb") as f:
                pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(part, Path(tmp) / "result.pkl")
    except BaseException as e:
        if not (Path(tmp) / f"error-{rank}.pkl").exists():
            _record_failure(Path(tmp), rank, e)
        raise


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _record_failure(tmp: Path, rank: int, exc: BaseException) -> None:
    info: dict[str, Any] = {"time": time.time(), "rank": rank, "type": type(exc).__name__, "message": str(exc),
                            "traceback": "".join(traceback.format_exception(exc)), "exception": None}
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
        info["exception"] = blob
    except Exception:
        pass
    try:
        with open(tmp / f"error-{rank}.pkl", "wb") as f:
            pickle.dump(info, f)
    except Exception:  # pragma: no cover - nothing more we can do; spawn still reports the failure
        pass


def _reraise(tmp: Path, spawn_error: Exception) -> None:
    # the error records come from this run's own ranks, in its private temporary folder (see launch)
    records = []
    for p in tmp.glob("error-*.pkl"):
        try:
            with open(p, "rb") as f:
                records.append(pickle.load(f))
        except Exception:  # a rank killed while writing
            continue
    if not records:  # a rank died without a Python exception (signal, os._exit)
        raise RankFailed(f"a rank of the process group died: {spawn_error}") from spawn_error
    first = min(records, key=lambda r: r["time"])  # the others are usually broken collectives that followed
    note = f"raised in rank {first['rank']} of the process group:\n{first['traceback']}"
    exc = pickle.loads(first["exception"]) if first["exception"] is not None else None
    if exc is None:
        raise RankFailed(f"rank {first['rank']} failed: {first['type']}: {first['message']}\n{note}",
                         rank=first["rank"])
    exc.add_note(note)
    raise exc from None
