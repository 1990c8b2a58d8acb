"""Data-parallel training: N processes, one process group (gloo on CPU, NCCL on CUDA).

:func:`launch` spawns the processes on this machine and runs ``fn(rank, world_size, *args)`` in each, inside an
initialised default process group; under an outside launcher (``torchrun``, several nodes) each process joins the
group it describes with :func:`init_from_env` instead (``captioning.training.torchrun``).
:func:`captioning.training.loop.train` called there trains data-parallel by itself (every rank reads the same
global batches and trains on its own contiguous slice, see :func:`shard`).

Everything stays on the loopback interface: the rendezvous store is served by the calling process on a socket
bound to 127.0.0.1 (so no free-port race), and gloo/NCCL are told to use the loopback interface.
"""

from __future__ import annotations

import os
import pickle
import signal
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

from captioning import stopping
from captioning.data.loader import Batch
from captioning.errors import CapflowError
from captioning.util import usable_cpus

HOST = "127.0.0.1"

_RANK_DEVICE: torch.device | None = None  # set by launch() in each spawned process


class RankFailed(CapflowError, RuntimeError):
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
        threads = max(1, usable_cpus() // nproc)
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
            ctx = mp.start_processes(_run_rank, args=(spec,), nprocs=nproc, join=False, start_method="spawn")
            try:
                while not ctx.join(timeout=0.5):
                    stopping.check("data-parallel training")  # SIGTERM to capflow: the ranks stop too
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                _terminate(ctx.processes)
                stopping.check("data-parallel training")  # a rank that stopped on SIGTERM is no failure
                _reraise(Path(tmp), e)
            except BaseException:  # stopped or interrupted here: no rank may outlive it
                _terminate(ctx.processes)
                raise
            # pickle is safe here: the folder is this call's own mkdtemp (mode 0700) and only the ranks spawned
            # above, this process's children, write into it; nothing from another user or machine is read
            with open(Path(tmp) / "result.pkl", "rb") as f:
                return pickle.load(f)
    finally:
        del store  # stop serving


def init_from_env(device: str | torch.device = "cpu", backend: str | None = None, threads: int | None = None,
                  timeout: timedelta = timedelta(minutes=60)) -> tuple[int, int]:
    """Join the process group that an outside launcher describes in the environment - ``torchrun`` (torch elastic),
    ``srun`` wrappers, Kubernetes operators: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` - as :func:`launch`'s ranks join theirs: ``cuda:LOCAL_RANK`` (NCCL) for a CUDA
    ``device``, else the CPU (gloo); ``threads`` torch threads (default: CPUs // processes on this node). Returns
    (rank, world size); :func:`rank_device` names this rank's device afterwards. The caller destroys the group."""
    global _RANK_DEVICE
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"no launcher's process group in the environment ({', '.join(missing)} unset): start "
                           "this under torchrun (or set the variables), or use capflow's own launcher (--nproc)")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    dev_type = torch.device(device).type
    backend = backend or ("nccl" if dev_type == "cuda" else "gloo")
    if threads is None:
        threads = max(1, usable_cpus() // local_world)
    torch.set_num_threads(threads)
    if dev_type == "cuda":
        torch.cuda.set_device(local_rank)
        _RANK_DEVICE = torch.device("cuda", local_rank)
    else:
        _RANK_DEVICE = torch.device("cpu")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size


def _terminate(processes: list, timeout: float = 5.0) -> None:
    """SIGTERM the ranks still running (each unwinds: a checkpoint being written is not left half-made), then
    SIGKILL those that did not exit within ``timeout`` (a rank blocked in a collective)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    stopping.request(signum)
    raise stopping.Stopped(signum, "data-parallel rank")


def _run_rank(rank: int, spec: tuple) -> None:
    global _RANK_DEVICE
    fn, args, nproc, backend, dev_type, port, threads, timeout, tmp = spec
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
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
