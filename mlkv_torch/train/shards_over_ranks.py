"""A checkpoint's stored shards that a rank cannot read, because they lie on another node's own disk
(each node keeping its tables under a `storage.path` of its own), received over the process group
from a rank that can: of each such shard, the rows this rank's tables hold under the new plan (not
the log's older versions, nor the rows other ranks hold), written into a store of its own beside
the shard's table record and its ids' activity, so the fill reads it as any stored shard. The
checkpoint's own files are only read."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..disk_table import TABLE_RECORD
from ..ranks import all_gather_objects
from ..read_ahead import read_ahead
from ..row_layout import RowLayout
from ..store import KVStore
from ..stored_shards import StoredShard, open_shard, same_columns, stored_shards
from ..virtual_tables import activity_file
from .checkpoint_tables import WrittenCheckpoint, row_layout_of
from .placement import runner_group

__all__ = ["ShardsOnRanks", "rows_held", "receive_unseen_shards"]

_CHUNK_ROWS = 1 << 16
_STORE_BUDGET = 16 << 20  # log pages a received shard's store holds in memory while it is written

# Row ranges [start, stop) of each table, by table.
RowRanges = Dict[str, List[Tuple[int, int]]]


@dataclass(frozen=True)
class ShardsOnRanks:
    """What `receive_unseen_shards` did on this rank: the checkpoint as this rank reads it (the
    shards it could not see replaced by the ones received), the rows this rank received and the
    seconds it took, and whether this rank is the first to see some of the checkpoint's tables
    (one rank on each disk that holds them: it removes them once the new checkpoint is committed).
    This rank's sends may still go on: the caller fills its tables meanwhile, then `finish`es."""

    checkpoint: WrittenCheckpoint
    rows_received: int
    receiving_seconds: float
    keeps_tables: bool
    sent: Callable[[], None]  # waits for this rank's sends; raises what they raised

    def finish(self) -> Tuple[int, float]:
        """Called by every rank together: waits until this rank has sent what the others take from
        it; returns the rows all ranks received and the longest a rank took to receive its own."""
        self.sent()
        everyone = all_gather_objects((self.rows_received, self.receiving_seconds))
        return sum(rows for rows, _ in everyone), max(seconds for _, seconds in everyone)


@dataclass(frozen=True)
class _Transfer:
    """A stored shard some ranks cannot see: its table, its index among the table's shards, the
    rank that reads and sends it, the ranks that take its files (every rank that holds rows of its
    table) and, of those, the ranks that hold rows inside it."""

    table: str
    index: int
    reader: int
    takers: List[int]
    row_takers: List[int]


def rows_held(manifest: Dict[str, Dict[str, Any]], rank: int) -> RowRanges:
    """The rows of each table `rank` holds under a run's plan (`Experiment.table_manifest`'s shard
    layouts; a replicated table whole), tables it holds nothing of left out."""
    held: RowRanges = {}
    for table, entry in manifest.items():
        for shard in entry["shards"] or []:
            if shard[0] == rank:
                held.setdefault(table, []).append((shard[1], shard[1] + shard[3]) if len(shard) > 1
                                                  else (0, entry["rows"]))
    return held


def receive_unseen_shards(checkpoint: WrittenCheckpoint, held: RowRanges, received_dir: str,
                          disk_shards: Sequence[Tuple[str, int, int, Any]] = ()) -> ShardsOnRanks:
    """Called by every rank together. Each stored shard of `checkpoint` that some rank cannot see
    and holds rows of (`held`: this rank's, `rows_held`) is scanned once by the first rank that sees
    it, which sends each of those ranks its rows; they write them under `received_dir` (the
    caller removes it after the fill), or straight into this rank's disk shards of the table
    (`disk_shards`: (table, first row, first column, DiskEmbeddingBag)) where the fill would copy
    them as they are (the columns split alike), leaving an empty store there. Returns once this
    rank has received its rows; its own sends may go on (`ShardsOnRanks.finish`). ConfigError
    names a rank's tables that no rank sees."""
    rank, began = dist.get_rank(), time.perf_counter()
    seen = {r: sorted(os.listdir(_rank_dir(checkpoint, r))) for r, cut in checkpoint.cuts.items()
            if cut is not None and _sees(checkpoint, r, cut)}
    everyone = all_gather_objects((seen, held))
    readers = _readers(checkpoint, [s for s, _ in everyone])
    keeps_tables = rank in readers.values()
    if all(set(readers) <= set(s) for s, _ in everyone):  # every rank sees every stored shard
        return ShardsOnRanks(checkpoint, 0, 0.0, keeps_tables, lambda: None)
    listed = {r: everyone[q][0][r] for r, q in readers.items()}
    shards = stored_shards(checkpoint.tables_dir, checkpoint.cuts,
                           {n: (e["rows"], e["dim"]) for n, e in checkpoint.tables.items()}, listed=listed)
    owner = {os.path.join(_rank_dir(checkpoint, r), name): r for r, names in listed.items() for name in names}
    transfers = _transfers(shards, owner, readers, everyone)
    layouts = {(t.table, t.index): row_layout_of(checkpoint.tables[t.table], shards[t.table][t.index].columns)
               for t in transfers}

    def send() -> None:
        # Every transfer's files first, then the rows: a rank that takes no rows of a shard (it
        # needs its files) never holds up the rows another takes of another rank's shard.
        mine = [t for t in transfers if t.reader == rank]
        for t in mine:
            _send_files(shards[t.table][t.index], t.takers)
        for t in mine:
            if t.row_takers:
                _send_rows(shards[t.table][t.index], layouts[(t.table, t.index)],
                           {q: everyone[q][1][t.table] for q in t.row_takers})

    # Sends in a thread of their own, receives here, each in that order: the first transfer not
    # done has its reader and its takers at it, and transfers between other ranks go on meanwhile.
    sent = _started(send, "mlkv-send-shards")
    taken = [t for t in transfers if rank in t.takers]
    files = [_received_objects(t.reader)[0] for t in taken]
    received = 0
    for t, shard_files in zip(taken, files):
        shard = shards[t.table][t.index]
        mine = [(first_row, first_column, bag) for name, first_row, first_column, bag in disk_shards
                if name == t.table]
        # Where the fill reads the table's rows whole instead, they go to the received store.
        copied_as_stored = all(same_columns(shards[t.table], first_row, bag.num_embeddings, first_column,
                                            bag.embedding_dim) for first_row, first_column, bag in mine)
        targets = [(first_row, bag) for first_row, _, bag in mine] if copied_as_stored else []
        shards[t.table][t.index], rows = _receive_shard(
            shard, layouts[(t.table, t.index)], t.reader if rank in t.row_takers else None, shard_files,
            os.path.join(received_dir, _whose(owner[shard.path])), targets)
        received += rows
    return ShardsOnRanks(dataclasses.replace(checkpoint, shards=shards), received, time.perf_counter() - began,
                         keeps_tables, sent)


def _transfers(shards: Dict[str, List[StoredShard]], owner: Dict[str, int], readers: Dict[int, int],
               everyone: Sequence[Tuple[Dict[int, List[str]], RowRanges]]) -> List[_Transfer]:
    """The stored shards some rank holding rows of their table cannot see, in an order every rank
    follows."""
    transfers = []
    for table in sorted(shards):
        for index, shard in enumerate(shards[table]):
            old_rank = owner[shard.path]
            takers = [q for q, (s, h) in enumerate(everyone) if old_rank not in s and table in h]
            row_takers = [q for q in takers if any(start < shard.first_row + shard.rows and shard.first_row < stop
                                                   for start, stop in everyone[q][1][table])]
            if takers:
                transfers.append(_Transfer(table, index, readers[old_rank], takers, row_takers))
    return transfers


def _started(work: Callable[[], None], name: str) -> Callable[[], None]:
    """`work` started in a thread; returns a join that raises what it raised."""
    raised: List[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()

    def join() -> None:
        thread.join()
        if raised:
            raise raised[0]
    return join


def _rank_dir(checkpoint: WrittenCheckpoint, rank: Optional[int]) -> str:
    """Where the checkpoint's process `rank` (None: one process) kept its tables."""
    return checkpoint.tables_dir if rank is None else os.path.join(checkpoint.tables_dir, f"rank{rank}")


def _whose(rank: Optional[int]) -> str:
    return "one-process" if rank is None else f"rank{rank}"


def _sees(checkpoint: WrittenCheckpoint, rank: Optional[int], cut: Dict[str, Any]) -> bool:
    """Whether this process sees the tables the checkpoint's process `rank` kept (one process's
    lie in the tables directory itself, which every node has)."""
    if rank is not None:
        return os.path.isdir(_rank_dir(checkpoint, rank))
    return all(os.path.isfile(os.path.join(checkpoint.tables_dir, table, TABLE_RECORD)) for table in cut["tables"])


def _readers(checkpoint: WrittenCheckpoint, seen: Sequence[Dict[int, List[str]]]) -> Dict[int, int]:
    """The first new rank that sees each old rank's tables directory, by old rank."""
    readers = {}
    for old_rank, cut in checkpoint.cuts.items():
        if cut is None:
            continue
        seers = [q for q, s in enumerate(seen) if old_rank in s]
        if not seers:
            where = _rank_dir(checkpoint, old_rank)
            raise ConfigError(f"{checkpoint.description}: {_whose(old_rank)}'s tables ({where}) are on no rank's "
                              f"storage.path in this job: a node that kept them on its own disk is not in it. Start "
                              f"the job with that node (its storage.path), or resume from a copy of its tables where "
                              f"a node of this job sees them")
        readers[old_rank] = seers[0]
    return readers


def _scanned(shard: StoredShard, layout: RowLayout) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """The shard's rows as stored: (global ids, rows of the store's words), its base run's first,
    in id order (the taker loads them straight into its store's base), then its log's."""
    with open_shard(shard, layout) as store:
        for part in ("base", "log"):
            for keys, rows in store.scan(_CHUNK_ROWS, part):
                yield keys + shard.first_row, rows


def _send_files(shard: StoredShard, takers: Sequence[int]) -> None:
    """Sends each taker the shard's table record and ids' activity files ({name: bytes})."""
    files = {}
    for name in (TABLE_RECORD, os.path.basename(activity_file(shard.path, shard.step))):
        path = os.path.join(shard.path, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    for taker in takers:
        dist.send_object_list([files], dst=taker, group=runner_group())


def _send_rows(shard: StoredShard, layout: RowLayout, takers: Dict[int, List[Tuple[int, int]]]) -> None:
    """Sends each taker, chunk by chunk, the shard's rows inside its ranges (a count, the keys,
    the rows), then a count of -1."""
    for ids, rows in read_ahead(_scanned(shard, layout), depth=2, name="mlkv-send-shard"):
        for taker, ranges in takers.items():
            inside = torch.zeros_like(ids, dtype=torch.bool)
            for start, stop in ranges:
                inside |= (ids >= start) & (ids < stop)
            count = int(inside.sum())
            if count:
                dist.send(torch.tensor([count]), dst=taker, group=runner_group())
                dist.send(ids[inside] - shard.first_row, dst=taker, group=runner_group())
                dist.send(rows[inside].contiguous(), dst=taker, group=runner_group())
    for taker in takers:
        dist.send(torch.tensor([-1]), dst=taker, group=runner_group())


def _receive_shard(shard: StoredShard, layout: RowLayout, reader: Optional[int], files: Dict[str, bytes],
                   directory: str, targets: Sequence[Tuple[int, Any]]) -> Tuple[StoredShard, int]:
    """The rows `reader` sends of `shard` (`_send_rows`; None: it sends this rank none), written
    into a store under `directory` beside the shard's `files`, or into the DiskEmbeddingBags
    `targets` ((first row, bag) each; the store left empty); returns the stored shard of that
    store and the rows' number."""
    path = os.path.join(directory, os.path.basename(shard.path))
    shutil.rmtree(path, ignore_errors=True)
    words, received = layout.weight_words + layout.state_dim, 0
    with KVStore(path, words, torch.float32, _STORE_BUDGET, cut_checkpoints=True, key_limit=shard.rows) as store:
        if reader is not None:
            with contextlib.ExitStack() as fills:
                # Each written as `fill_shard` writes: rows in id order loaded into an empty store.
                writers = [(first_row, bag, fills.enter_context(bag.filling())) for first_row, bag in targets] \
                    if targets else [(shard.first_row, None, fills.enter_context(store.filling(shard.rows)))]
                # Written while the next chunk comes; received in a thread, which lets go of the GIL as it waits.
                for keys, rows in read_ahead(_received_rows(reader, words), depth=2, name="mlkv-receive-shard"):
                    _write_rows(keys + shard.first_row, rows, layout, writers)
                    received += keys.numel()
        sequence = store.checkpoint()
        store.commit_checkpoint(sequence)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return dataclasses.replace(shard, path=path, checkpoint=sequence), received


def _received_rows(reader: int, words: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, rows) chunks `reader` sends (`_send_shard`), to its count of -1."""
    count = torch.empty(1, dtype=torch.int64)
    while True:
        dist.recv(count, src=reader, group=runner_group())
        if int(count) < 0:
            return
        keys, rows = torch.empty(int(count), dtype=torch.int64), torch.empty(int(count), words)
        dist.recv(keys, src=reader, group=runner_group())
        dist.recv(rows, src=reader, group=runner_group())
        yield keys, rows


def _write_rows(ids: torch.Tensor, rows: torch.Tensor, layout: RowLayout,
                writers: Sequence[Tuple[int, Any, Callable[..., None]]]) -> None:
    """Received rows of global `ids` into the writers: (first row, DiskEmbeddingBag, its
    `filling` writer) each, or one (the shard's first row, None, its received store's)."""
    for first_row, bag, write in writers:
        if bag is None:
            write(ids - first_row, rows)
            continue
        inside = (ids >= first_row) & (ids < first_row + bag.num_embeddings)
        if bool(inside.any()):
            mine = rows[inside]
            write(ids[inside] - first_row, layout.weights_of(mine[:, :layout.weight_words]),
                  mine[:, layout.weight_words:] if layout.state_dim else None)


def _received_objects(source: int) -> List[Any]:
    objects: List[Optional[Any]] = [None]
    dist.recv_object_list(objects, src=source, group=runner_group())
    return objects
