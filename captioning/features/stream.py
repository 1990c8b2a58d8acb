"""The extractor's image stream: decoding ahead of the model, batching, and the device lanes.

:class:`ExtractionStream` runs one pass of an extractor's ``stream``
(:meth:`captioning.features.engine.ExtractorEngine.stream`; typed against the protocol
:class:`captioning.features.base.Extractor`) over ``(key, load)`` items. Three parts, each a few methods:

- **loading**: ``threads`` decode/resize threads run ahead of the model - or, with the extractor's
  ``decode_processes`` and picklable ``load`` callables, that many spawned processes (:func:`load_resized`), which
  do not contend for this interpreter's lock. A loader process that dies, or a result that cannot travel back,
  sends its image and every later one through the threads instead: the same numbers either way.
- **batching**: ready images wait in groups of the extractor's group key (same resized shape, or same padded
  shape) until a group holds ``batch_size``; more than ``window`` waiting images run the oldest group as it is.
- **device lanes**: on CUDA two threads, each with its own stream, alternate batches, so one batch's kernels run
  while the other thread waits on a synchronisation or selects its boxes on the host; on CPU one.

Results come out in completion order as ``(key, Regions)`` or ``(key, exception)``, one per item.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from captioning.features.base import Extractor, Prepared, Result, check_images, resized_rgb

log = logging.getLogger("captioning.features.extractor")

DEVICE_THREADS = 2  # batches in flight on one CUDA device (each thread its own stream)


def load_resized(load: Callable[[], np.ndarray], min_size: int, max_size: int):
    """A loader process's work for one image: ``load()`` then the resize. Returns (resized array, original
    (H, W)), or the exception raised on the way (returned, not raised: it is the image's result)."""
    try:
        image = load()
        check_images([image])
        return resized_rgb(image, min_size, max_size), (int(image.shape[0]), int(image.shape[1]))
    except Exception as e:
        try:
            pickle.dumps(e)
        except Exception:
            return RuntimeError(f"{type(e).__name__}: {e}")
        return e


def picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


class ExtractionStream:
    """One pass over a stream of images through ``extractor`` (see the module docstring)."""

    def __init__(self, extractor: Extractor, threads: int, window: int):
        self.ex = extractor
        self.threads = threads
        self.window = window
        self.remote = bool(threads) and extractor.decode_processes > 0
        self.checked = False  # a stream's callables are of one kind: checked for pickling once
        self.loaders = ThreadPoolExecutor(threads, thread_name_prefix="capflow-decode") if threads else None
        self.lookahead = window + 2 * max(threads, extractor.decode_processes if self.remote else 0, 1)
        self.lanes = DEVICE_THREADS if extractor.device.type == "cuda" else 1
        self.device = ThreadPoolExecutor(self.lanes, thread_name_prefix="capflow-device")
        self.streams: dict[int, Any] = {}  # device thread -> its CUDA stream
        self.finishing: deque = deque()  # batches on the device lanes, in launch order

    # ------------------------------------------------------------------ loading
    def _load(self, key: Any, fn: Callable[[], np.ndarray]) -> Prepared | tuple[Any, Exception]:
        try:
            return self.ex.prepare(fn(), key)
        except Exception as e:
            return (key, e)

    def _submit(self, key: Any, fn: Callable[[], np.ndarray]) -> tuple:
        ex = self.ex
        self.remote = self.remote and ex.decode_processes > 0  # off for good once a loader process failed
        if self.remote:
            if not self.checked and not picklable(fn):
                log.info("loader callables cannot be pickled (%s): decoding on loader threads", type(fn).__name__)
                self.remote = False
            else:
                self.checked = True
                try:
                    return key, fn, ex._process_pool().submit(load_resized, fn, ex.cfg.min_size, ex.cfg.max_size), True
                except Exception as e:  # a broken pool, or one that cannot start here
                    ex._drop_pool(e)
                    self.remote = False
        return key, fn, (self.loaders.submit(self._load, key, fn) if self.loaders else self._load(key, fn)), False

    def _resolve(self, entry: tuple) -> Prepared | tuple[Any, Exception]:
        key, fn, got, in_process = entry
        if not in_process:
            return got.result() if isinstance(got, Future) else got
        try:
            res = got.result()
        except Exception as e:  # the process died (BrokenProcessPool) or the result could not travel
            self.ex._drop_pool(e)
            return self._load(key, fn)
        if isinstance(res, BaseException):
            return (key, res)
        img, size = res
        return self.ex._prepared(key, img, size)

    # ------------------------------------------------------------------ device lanes
    def _run(self, batch: list[Prepared]) -> list[Result]:
        ex = self.ex
        if ex.device.type != "cuda":
            return [x for d in ex._detect_safe(batch) for x in ex._finished(d)]
        stream = self.streams.setdefault(threading.get_ident(), torch.cuda.Stream(ex.device))
        with torch.cuda.stream(stream):
            dets = ex._detect_safe(batch)
        return [x for d in dets for x in ex._finished(d)]

    def _launch(self, batch: list[Prepared]) -> None:
        self.finishing.append(self.device.submit(self._run, batch))

    def _drain(self, block: bool) -> Iterator[Result]:
        while self.finishing and (block or len(self.finishing) > self.lanes or self.finishing[0].done()):
            yield from self.finishing.popleft().result()

    # ------------------------------------------------------------------ the pass
    def run(self, items: Iterable[tuple[Any, Callable[[], np.ndarray]]]) -> Iterator[Result]:
        bs = self.ex.cfg.batch_size
        it = iter(items)
        ahead: deque = deque()
        groups: dict[tuple, list[Prepared]] = {}
        held = 0
        try:
            while True:
                while len(ahead) < self.lookahead:
                    try:
                        key, fn = next(it)
                    except StopIteration:
                        break
                    ahead.append(self._submit(key, fn))
                if not ahead:
                    break
                got = self._resolve(ahead.popleft())
                if isinstance(got, tuple):  # could not be loaded
                    yield got
                    continue
                g = groups.setdefault(self.ex._group_key(got), [])
                g.append(got)
                held += 1
                if len(g) == bs:
                    held -= len(g)
                    self._launch(groups.pop(self.ex._group_key(got)))
                elif held > self.window:  # too many images waiting for partners: run the oldest group as it is
                    oldest = next(iter(groups))
                    held -= len(groups[oldest])
                    self._launch(groups.pop(oldest))
                yield from self._drain(False)
            for g in list(groups.values()):
                self._launch(g)
            yield from self._drain(True)
        finally:
            for entry in ahead:  # a consumer that stopped early: loads not started yet are not needed
                if isinstance(entry[2], Future):
                    entry[2].cancel()
            if self.loaders:
                self.loaders.shutdown(wait=True, cancel_futures=True)
            self.device.shutdown(wait=True)
