"""Opening tables: the one route from a set of tables to their open table batches. Tables are
grouped by row layout and pooling (one batch each), the memory budget is planned for the batches
(`memory_budget.plan_host_memory`), each batch is opened, and the cut the tables reopen at is
reconciled with the one their directory records. DiskEmbeddingBag, DiskEmbeddingBagCollection and
the sharded disk kernel all open their tables here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import optim as optim_lib
from .checks import is_int
from .cut import check_cut, read_cut, write_cut
from .disk_table import DiskTable
from ._C import IdActivity
from .memory_budget import LayoutDemand, MemoryBudgetError, plan_host_memory, stores_min_bytes
from .row_layout import RowLayout
from .table_batch import MODES, DiskTableBatch, TableBatchSpec, resolve_device
from .table_settings import BatchSettings
from .virtual_tables import activity_bytes

__all__ = ["TableSpec", "OpenTables", "open_tables", "open_table_batch"]


@dataclass(frozen=True)
class TableSpec:
    """One table to open: where it lives and how its rows start (`table`), its row layout and
    pooling (tables that share both share a batch), and its traffic (lookups per sample), which
    shares the memory budget between batches."""

    table: DiskTable
    layout: RowLayout
    mode: str = "sum"
    lookups_per_sample: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


class OpenTables(NamedTuple):
    """Tables opened by `open_tables`."""
    batches: List[DiskTableBatch]
    places: List[Tuple[int, int]]  # table i is table places[i][1] of batches[places[i][0]]
    cut: Optional[Dict[str, Any]]  # the cut they reopened at (None: a fresh start, or no cut recorded)


def open_tables(tables: Sequence[TableSpec], *, memory_budget_bytes: int, cache_rows: Optional[int] = None,
                staging_bytes: Optional[int] = None, settings: BatchSettings = BatchSettings(),
                device: Optional[Union[str, torch.device]] = None, reopen: bool = False,
                cut: Optional[Dict[str, Any]] = None, cut_dir: Optional[str] = None,
                read_ahead_into_slots: Optional[bool] = None, transfer_delay_us: int = 0) -> OpenTables:
    """Opens `tables` as one DiskTableBatch per row layout and pooling, in the order the layouts
    first appear.

    Args:
        tables: the tables (`TableSpec`).
        memory_budget_bytes: host memory for all of them (`memory_budget.plan_host_memory`), after
            what virtual tables keep of their ids (`virtual_tables.activity_bytes`).
        cache_rows: rows of hot cache for all of them (default: what the budget holds).
        staging_bytes: bytes of rows for the staging areas (default: an eighth of the budget).
        settings: staleness, cache policy and store, shared by every batch.
        device: where the caches, the pooling and the outputs live.
        reopen: continue from the rows the tables' directories hold (FileExistsError without it).
        cut: reopen at this cut (a record `checkpoint` returned). Without it, a reopen goes to the
            cut `cut_dir` records, if any.
        cut_dir: where the tables' owner records its cuts; a cut given here that differs from the
            one recorded there is recorded (the newer cut the stores went back from is gone).
        read_ahead_into_slots, transfer_delay_us: as DiskTableBatch's.
    """
    for name, value in (("memory_budget_bytes", memory_budget_bytes),):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("cache_rows", cache_rows), ("staging_bytes", staging_bytes)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    device = resolve_device(device)
    if cut is not None:
        check_cut(cut, "cut")
    elif reopen and cut_dir is not None:
        cut = read_cut(cut_dir)
    # Virtual tables' counts and ages of their ids grow with the ids they keep: their share comes first.
    activity = {spec.table.name: activity_bytes(spec.table.id_policy) for spec in tables}
    if sum(activity.values()) >= memory_budget_bytes:
        raise MemoryBudgetError(
            f"memory_budget_bytes {memory_budget_bytes:,} cannot hold the counts and ages of the ids the virtual "
            f"tables keep ({', '.join(f'{n!r}: {b:,} bytes' for n, b in activity.items() if b)}; "
            f"{IdActivity.bytes_per_id} bytes an id, up to each one's eviction trigger); give it more than "
            f"{sum(activity.values()):,} bytes, or lower the triggers")
    memory_budget_bytes -= sum(activity.values())
    groups: Dict[Tuple[RowLayout, str], List[int]] = {}
    for i, spec in enumerate(tables):
        groups.setdefault((spec.layout, spec.mode), []).append(i)
    demands = [LayoutDemand(len(members), sum(tables[i].table.num_embeddings for i in members), layout.row_bytes,
                            stores_min_bytes([tables[i].table.path for i in members], settings.backend),
                            sum(tables[i].lookups_per_sample for i in members))
               for (layout, _), members in groups.items()]
    plans = plan_host_memory(memory_budget_bytes, demands, device.type == "cpu", cache_rows, staging_bytes)
    batches: List[DiskTableBatch] = []
    places: List[Tuple[int, int]] = [(0, 0)] * len(tables)
    try:
        for ((layout, mode), members), (share, plan) in zip(groups.items(), plans):
            spec = TableBatchSpec(tuple(tables[i].table for i in members), layout, mode, share, plan, settings)
            for k, i in enumerate(members):
                places[i] = (len(batches), k)
            batches.append(DiskTableBatch(spec, device=device, reopen=reopen or cut is not None, cut=cut,
                                          read_ahead_into_slots=read_ahead_into_slots,
                                          transfer_delay_us=transfer_delay_us))
    except BaseException:
        for batch in batches:
            batch.close()
        raise
    if cut_dir is not None and cut is not None and cut != read_cut(cut_dir):
        write_cut(cut_dir, cut)
    return OpenTables(batches, places, cut)


def open_table_batch(tables: Sequence[DiskTable], embedding_dim: int, *, mode: str = "sum",
                     optimizer: Optional[optim_lib.SparseOptimizer] = None, cache_rows: Optional[int] = None,
                     memory_budget_bytes: int = 64 << 20, staleness: int = 0, dtype: torch.dtype = torch.float32,
                     device: Optional[Union[str, torch.device]] = None, cache_policy: str = "lfu",
                     staging_bytes: Optional[int] = None, backend: str = "mlkv", reopen: bool = False,
                     cut: Optional[Dict[str, Any]] = None, read_ahead_into_slots: Optional[bool] = None,
                     transfer_delay_us: int = 0) -> DiskTableBatch:
    """Opens `tables`, all of one row layout and pooling, as one DiskTableBatch (`open_tables`):
    the whole budget is theirs. The arguments are DiskEmbeddingBag's."""
    optimizer = optimizer if optimizer is not None else optim_lib.SGD()
    layout = RowLayout(embedding_dim, dtype, optimizer)
    opened = open_tables([TableSpec(t, layout, mode) for t in tables], memory_budget_bytes=memory_budget_bytes,
                         cache_rows=cache_rows, staging_bytes=staging_bytes,
                         settings=BatchSettings(staleness, cache_policy, backend), device=device, reopen=reopen,
                         cut=cut, read_ahead_into_slots=read_ahead_into_slots, transfer_delay_us=transfer_delay_us)
    return opened.batches[0]
