"""The measurements behind a calibration (`calibration.calibrate`): the disk under a directory, the
store's reads through `KVStore`, the disk table's cost per hit, per miss and per updated row, the
host's memory bandwidth and, under torch.distributed, the all-to-all rate between ranks. Each is
short (a fraction of a second to two seconds) and removes the files it wrote."""
from __future__ import annotations

import mmap
import os
import shutil
import threading
import time
from typing import Dict, Optional

import torch

_PAGE = 4096
_SEQUENTIAL_BLOCK = 1 << 20


def _open_direct(path: str, flags: int) -> "tuple[int, bool]":
    """A descriptor of `path` with O_DIRECT where the file system takes it (a RAM disk does not:
    its reads are then the page cache's, which is what that disk is)."""
    direct = getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags | direct, 0o644), bool(direct)
    except OSError:
        return os.open(path, flags, 0o644), False


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs


def disk(directory: str, file_bytes: int = 256 << 20, seconds: float = 0.6, depth: int = 16) -> Dict[str, float]:
    """Sequential 1 MiB writes and reads of a `file_bytes` file, then 4 KiB random reads at queue
    depth 1 (latency) and `depth` (threads, each a pread at a time), direct I/O where the file
    system allows it. The file is removed after."""
    path = os.path.join(directory, "disk-probe.dat")
    block = _aligned(_SEQUENTIAL_BLOCK)
    block.write(os.urandom(4096) * (_SEQUENTIAL_BLOCK // 4096))
    try:
        fd, direct = _open_direct(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
        try:
            start = time.perf_counter()
            for offset in range(0, file_bytes, _SEQUENTIAL_BLOCK):
                os.pwrite(fd, block, offset)
            os.fsync(fd)
            write_s = time.perf_counter() - start
        finally:
            os.close(fd)
        fd, _ = _open_direct(path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            for offset in range(0, file_bytes, _SEQUENTIAL_BLOCK):
                os.preadv(fd, [block], offset)
            read_s = time.perf_counter() - start
            qd1 = _random_reads(fd, file_bytes, seconds, 1)
            deep = _random_reads(fd, file_bytes, seconds, depth)
        finally:
            os.close(fd)
    finally:
        block.close()
        if os.path.exists(path):
            os.remove(path)
    return {"direct_io": float(direct), "sequential_write_bytes_per_s": file_bytes / write_s,
            "sequential_read_bytes_per_s": file_bytes / read_s, "random_read_latency_s": 1.0 / qd1,
            "random_reads_per_s": deep, "random_read_depth": float(depth)}


def _random_reads(fd: int, file_bytes: int, seconds: float, depth: int) -> float:
    """4 KiB reads/s at random page offsets, `depth` threads each keeping one read in flight."""
    pages = file_bytes // _PAGE
    counts = [0] * depth
    stop = time.perf_counter() + seconds

    def reader(i: int) -> None:
        buffer = _aligned(_PAGE)
        offsets = torch.randint(0, pages, (1 << 14,), generator=torch.Generator().manual_seed(i)).tolist()
        n = 0
        while time.perf_counter() < stop:
            os.preadv(fd, [buffer], offsets[n % len(offsets)] * _PAGE)
            n += 1
        counts[i] = n
        buffer.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def store_reads(directory: str, rows: int = 1 << 18, dim: int = 64, batch: int = 4096,
                seconds: float = 1.0) -> Dict[str, float]:
    """Rows/s of KVStore gets of uniform random keys that miss its memory (a small budget, no
    promotion of hot reads), in batches of `batch`: the store's disk-bound read rate."""
    from ..store import KVStore

    path = os.path.join(directory, "store-probe")
    try:
        with KVStore(path, dim, memory_budget_bytes=1 << 20, expected_rows=rows, promote_hot_reads=False) as store:
            for first in range(0, rows, 1 << 15):
                keys = torch.arange(first, min(rows, first + (1 << 15)))
                store.put(keys, torch.zeros(keys.numel(), dim))
            store.checkpoint()
            generator = torch.Generator().manual_seed(0)
            out = torch.empty(batch, dim)
            read, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                store.get(torch.randint(0, rows, (batch,), generator=generator), out=out)
                read += batch
            elapsed = time.perf_counter() - start
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"store_reads_per_s": read / elapsed, "store_read_batch": float(batch)}


def table_costs(directory: str, dim: int, device: torch.device, lookups: int = 8192,
                steps: int = 6) -> Dict[str, float]:
    """Seconds a `DiskEmbeddingBag` (SGD, sum pooling) of `dim` spends: per lookup whose row is
    cached (forward), per updated row (backward: the fused optimizer and the write into the cache),
    and per lookup whose row is on disk and not cached (forward, beyond a hit's cost)."""
    from .. import optim
    from ..embedding import DiskEmbeddingBag

    generator = torch.Generator().manual_seed(0)
    bag = 8
    offsets = torch.arange(0, lookups, bag, device=device)
    hot_rows, cold_rows = 1 << 16, 1 << 18
    path = os.path.join(directory, f"table-probe-{dim}")
    try:
        table = DiskEmbeddingBag(hot_rows, dim, path=path + "-hot", optimizer=optim.SGD(lr=0.01), cache_rows=hot_rows,
                                 memory_budget_bytes=hot_rows * dim * 4 * 3 + (16 << 20), device=device, seed=0)
        with torch.no_grad():  # every row into the cache first
            for first in range(0, hot_rows, lookups):
                table(torch.arange(first, first + lookups, device=device), offsets)
        hit, update = _timed_steps(table, hot_rows, offsets, lookups, steps, generator, device)
        table.close()
        table = DiskEmbeddingBag(cold_rows, dim, path=path + "-cold", optimizer=optim.SGD(lr=0.01), cache_rows=256,
                                 memory_budget_bytes=8 << 20, device=device, seed=0)
        table.populate()
        missed, _ = _timed_steps(table, cold_rows, offsets, lookups, max(2, steps // 2), generator, device)
        table.close()
    finally:
        for suffix in ("-hot", "-cold"):
            shutil.rmtree(path + suffix, ignore_errors=True)
    return {"hit_s": hit, "update_s": update, "miss_s": max(0.0, missed - hit)}


def _timed_steps(table, rows: int, offsets: torch.Tensor, lookups: int, steps: int, generator: torch.Generator,
                 device: torch.device) -> "tuple[float, float]":
    """Seconds per lookup of the forwards and per unique row of the backwards of `steps` batches of
    uniform ids (the first batch, a warm-up, not counted)."""
    forward_s = backward_s = 0.0
    looked_up = updated = 0
    for step in range(steps + 1):
        ids = torch.randint(0, rows, (lookups,), generator=generator).to(device)
        start = time.perf_counter()
        out = table(ids, offsets)
        _synchronize(device)
        middle = time.perf_counter()
        out.sum().backward()
        table.synchronize()
        end = time.perf_counter()
        if step:
            forward_s += middle - start
            backward_s += end - middle
            looked_up += lookups
            updated += int(ids.unique().numel())
    return forward_s / looked_up, backward_s / updated


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> Dict[str, float]:
    """Bytes/s a host tensor copy moves (read and write counted), the best of `repeats`."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return {"memory_bytes_per_s": 2 * nbytes / best}


def all_to_all(group: Optional[object] = None, nbytes: int = 4 << 20, repeats: int = 5) -> Dict[str, float]:
    """Under torch.distributed: bytes/s each rank sends and receives in an all-to-all of `nbytes`
    a rank (the median of `repeats`, after one warm-up); empty outside it."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    from ..ranks import collective_device

    world = dist.get_world_size(group)
    elements = max(world, nbytes // 4 // world * world)
    send = torch.ones(elements, device=collective_device(group))
    receive = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_to_all_single(receive, send, group=group)
        _synchronize(send.device)
        if i:
            times.append(time.perf_counter() - start)
    moved = send.numel() * 4 * (world - 1) / world  # what leaves the rank
    return {"all_to_all_bytes_per_s": moved / sorted(times)[len(times) // 2], "all_to_all_world": float(world)}
