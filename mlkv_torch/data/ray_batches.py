"""Batches prepared on a Ray cluster (``data.engine: ray``): the preprocessing tier beside the trainers.

A rank keeps asking for its batches by number, as the in-process loader does (BatchLoader's
threads now wait on Ray instead of decoding), and a pool of Ray actors, each holding a batch
maker (a ParquetBatches with its decoded row groups), makes them in their own processes, on
whichever nodes the cluster has. A batch is a function of its number, so the batches, the losses
and an exact resume are those of the in-process loader. Actors restart when their process dies
and Ray runs their unfinished calls again (``max_restarts``, ``max_task_retries``): a killed
worker costs time, never a batch, and since the rank takes one result per number, none comes
twice.

Unshuffled, a row group feeds a run of consecutive batches, which go to one actor (`chunk`), so it
decodes the row group once; meanwhile the next chunks' row groups are decoded on the other actors,
so all of them work at once and none decodes every row group.

A batch that has not come within `batch_timeout_s` is asked for again, of the next actor, and the
actor it was asked of is restarted (a result lost between Ray's nodes, or an actor stuck, then
costs that long once, not the run, nor once a batch); after `_ASKS` asks the run fails, naming
the batch.

Decided: an actor pool rather than a Ray Data stream (``streaming_split``) feeds the ranks. A
stream's order depends on the cluster's timing; batches by number keep training reproducible and
resumable, and the ranks independent of one another.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable, Dict, List

__all__ = ["RayBatches", "connect_ray"]

_ASKS = 3  # times a batch is asked for before the run fails


def connect_ray(address: str, cpus: int) -> bool:
    """Joins the Ray cluster whose head is at `address` ("host:port"), or, when it is empty, starts
    a local Ray of `cpus` CPUs for this process; does nothing when Ray is already connected.
    Returns whether it started a local Ray (which the caller shuts down). ConnectionError names an
    address where no Ray head answers (Ray itself would wait there for minutes)."""
    import ray

    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"the Ray address {address!r} is not host:port")
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise ConnectionError(f"no Ray head answers at {address!r}: {e}") from e
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return False
    # A small object store: a few batches in flight per actor, not the default 30% of memory. A new
    # Ray ("local"), not the last one `ray start` made here, which Ray would join (or fail to, if it is gone).
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=256 << 20,
             logging_level="WARNING", log_to_driver=False)
    return True


class _BatchMaker:
    """A Ray actor's state: the batch maker `make()` built in the actor's process."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._batches = make()

    def arrays(self, number: int) -> Any:
        return self._batches.arrays(number)

    def decode_row_groups(self, number: int) -> None:
        self._batches.decode_row_groups(number)

    def pid(self) -> int:
        return os.getpid()


class RayBatches:
    """Batch `number` -> ``assemble(maker.arrays(number))``, the arrays made by one of `actors` Ray
    actors, each holding the batch maker ``make()`` (see the module's docstring).

    Args:
        make: builds the batch maker in each actor (picklable, e.g. a functools.partial of
            ParquetBatches); its ``arrays(number)`` makes a batch's arrays and
            ``decode_row_groups(number)`` decodes the row groups that batch reads, making no batch.
        assemble: the batch of those arrays, built in this process.
        actors: actors in the pool (a CPU each).
        stride: between the numbers this process asks for (the world size): consecutive requests
            go to consecutive actors.
        chunk: consecutive requests that go to one actor (batches that share row groups); above 1,
            the next chunks' row groups are decoded on their actors while this one's batches are made.
        start_timeout_s: how long the actors may take to start, or to start again (RuntimeError after).
        batch_timeout_s: how long a batch may take before its actor is restarted and the batch is
            asked for again of the next actor.
    """

    def __init__(self, make: Callable[[], Any], assemble: Callable[[Any], Any], actors: int, stride: int = 1,
                 chunk: int = 1, start_timeout_s: float = 300.0, batch_timeout_s: float = 120.0) -> None:
        import ray

        if actors < 1:
            raise ValueError(f"actors must be positive, got {actors}")
        maker = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=-1)(_BatchMaker)
        self._actors = [maker.remote(make) for _ in range(actors)]
        # An actor the cluster has no CPU for would wait forever, and the first batch with it.
        ready, _ = ray.wait([actor.pid.remote() for actor in self._actors], num_returns=actors,
                            timeout=start_timeout_s)
        if len(ready) < actors:
            self.close()
            free, cpus = ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0)
            raise RuntimeError(f"Ray started {len(ready)} of {actors} batch makers (a CPU each) in "
                               f"{start_timeout_s:.0f} s: the cluster has {free:.0f} CPUs free of {cpus:.0f}; "
                               f"ask for fewer (data.ray.actors)")
        try:
            ray.get(ready)  # an actor whose maker failed to start raises its error here
        except ray.exceptions.RayError as e:  # the others go too: their CPUs back to the cluster
            self.close()
            raise RuntimeError(f"a Ray batch maker failed to start (is the transform's module importable and "
                               f"are the files at the same path on every node?): {e}") from e
        self._assemble, self._stride, self._chunk = assemble, stride, chunk
        self._start_timeout_s, self._batch_timeout_s = start_timeout_s, batch_timeout_s
        self._lock = threading.Lock()  # the loader's threads call in together
        self._decoding_to = -1  # the last chunk whose row groups were sent to be decoded
        self._restarting: Dict[int, Any] = {}  # actor index -> its pid call, done once it runs again
        self.asked_again = 0  # batches asked for again after a timeout
        self.restarts = 0  # actors restarted after a batch timed out on them

    def __call__(self, number: int) -> Any:
        import ray

        chunk = number // self._stride // self._chunk
        if self._chunk > 1:
            self._decode_ahead(number, chunk)
        for ask in range(_ASKS):
            index = (chunk + ask) % len(self._actors)
            if not self._started(index):
                continue
            try:
                return self._assemble(ray.get(self._actors[index].arrays.remote(number),
                                              timeout=self._batch_timeout_s))
            except ray.exceptions.GetTimeoutError:
                self.asked_again += 1
                self._restart(index)
                print(f"[data] batch {number} did not come from its Ray batch maker within "
                      f"{self._batch_timeout_s:g} s (data.ray.batch_timeout_s); restarting that maker and asking "
                      f"again", file=sys.stderr, flush=True)
        raise RuntimeError(f"batch {number} did not come from Ray within {self._batch_timeout_s:g} s, asked "
                           f"{_ASKS} times (data.ray.batch_timeout_s): are the batch makers alive?")

    def _decode_ahead(self, number: int, chunk: int) -> None:
        """Sends the row groups of the chunks after `chunk` to be decoded on their actors, one chunk
        an actor, so every actor works while one makes this chunk's batches."""
        with self._lock:
            first, last = max(chunk + 1, self._decoding_to + 1), chunk + len(self._actors) - 1
            self._decoding_to = max(self._decoding_to, last)
        for ahead in range(first, last + 1):
            actor = self._actors[ahead % len(self._actors)]
            actor.decode_row_groups.remote(ahead * self._chunk * self._stride + number % self._stride)

    def _restart(self, index: int) -> None:
        """Restarts actor `index` (a new process; Ray runs its unfinished calls again there), unless
        it is starting again already: a stuck actor would cost every later batch sent to it a timeout."""
        import ray

        with self._lock:
            if index in self._restarting:
                return
            actor = self._actors[index]
            ray.kill(actor, no_restart=False)
            self._restarting[index] = actor.pid.remote()
            self.restarts += 1

    def _started(self, index: int) -> bool:
        """Whether actor `index` runs (waiting up to start_timeout_s for it when it is starting again)."""
        import ray

        with self._lock:
            starting = self._restarting.get(index)
        if starting is None:
            return True
        try:
            ray.get(starting, timeout=self._start_timeout_s)
        except ray.exceptions.RayError:  # not back in time, or not at all: the next actor is asked
            return False
        with self._lock:
            if self._restarting.get(index) is starting:
                del self._restarting[index]
        return True

    def worker_pids(self) -> List[int]:
        """The process id of each actor."""
        import ray

        return ray.get([actor.pid.remote() for actor in self._actors])

    def close(self) -> None:
        """Ends the actors."""
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
