"""A job's memory budget turned into the planner's constraints: for each table of the model, in
memory (TorchRec's fused kernel) or on disk with ``CacheParams.load_factor`` its share of its bytes
in memory, as `memory_choice.choose_table_memory` decides; and the choice shown as a table."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import CacheParams

from ..planning.calibration import Calibration
from ..planning.hit_rates import TableAccess
from ..row_layout import row_bytes
from ..virtual_tables import activity_bytes
from .fused_optimizer import planned_optimizer
from .kernel import DISK_KERNEL, DiskTableOptions
from .memory_choice import TableMemory, TableShape, choose_table_memory

__all__ = ["JobBudget", "explain_table_memory"]


def _tables_of(module: nn.Module) -> List[Any]:
    """(config, weight) of every table of the model's embedding collections."""
    found = []
    for sub in module.modules():
        configs = sub.embedding_bag_configs() if hasattr(sub, "embedding_bag_configs") else \
            sub.embedding_configs() if hasattr(sub, "embedding_configs") else None
        if configs is None:
            continue
        holders = getattr(sub, "embedding_bags", None) or getattr(sub, "embeddings", {})
        found.extend((config, holders[config.name].weight) for config in configs)
    return found


@dataclasses.dataclass
class JobBudget:
    """The inputs of the choice: each table's popularity (one rank's batch), the calibration and
    the whole job's budget in bytes (None: no choice, the sharder's memory_fraction)."""
    access: Optional[Mapping[str, TableAccess]]
    calibration: Optional[Calibration]
    memory_budget_bytes: Optional[int]
    compute_device: str = "cpu"

    def choose(self, module: nn.Module, disk_sharders: List[Any], constraints: Dict[str, ParameterConstraints],
               world_size: int) -> Dict[str, TableMemory]:
        """Decides each table's memory and writes it into `constraints` (the planner's own); called
        while the planner plans with the disk kernel (`planning_with_disk`), which the sharder then offers."""
        if not disk_sharders:
            raise ValueError("memory_budget_bytes: plan with a disk sharder (DiskEmbeddingBagCollectionSharder), "
                             "whose tables the budget may put on disk")
        options: DiskTableOptions = disk_sharders[0].options
        fused = disk_sharders[0].fused_params
        shapes, tables = [], _tables_of(module)
        for config, weight in tables:
            kernels = (constraints.get(config.name) or ParameterConstraints()).compute_kernels
            rows = options.live_rows(config.name, config.num_embeddings, config.num_embeddings,
                                     options.virtual_cap(config))
            layout = row_bytes(config.embedding_dim, weight.dtype, planned_optimizer(weight, fused, config.name))
            # A table sized by the ids it will hold rather than its rows (raw ids, a virtual table)
            # has no in-memory form: TorchRec's kernels would hold every row of its id space.
            sized_by_ids = rows < config.num_embeddings or options.id_policy(config) is not None
            shapes.append(TableShape(config.name, rows, config.embedding_dim, layout,
                                     may_stay_in_memory=not sized_by_ids and (
                                         kernels is None or any(k != DISK_KERNEL for k in kernels)),
                                     may_go_to_disk=kernels is None or DISK_KERNEL in kernels))
        step = {name: a.scaled(world_size) for name, a in (self.access or {}).items()}  # all ranks' batches a step
        # What a virtual table keeps of its ids comes beside its share (each shard's: at most one a rank).
        ids_bytes = sum(activity_bytes(options.id_policy(config)) for config, _ in tables) * world_size
        chosen = choose_table_memory(shapes, step, self.calibration, self.memory_budget_bytes - ids_bytes)
        sharder, device = disk_sharders[0], self.compute_device
        kernels_of = {t: sharder.compute_kernels(t, device) for t in sharder.sharding_types(device)}
        for name, memory in chosen.items():
            constraints[name] = _constrained(constraints.get(name), memory, kernels_of)
        return chosen


def _constrained(constraint: Optional[ParameterConstraints], memory: TableMemory,
                 kernels_of: Dict[str, List[str]]) -> ParameterConstraints:
    """The user's constraint of a table (or none) with the choice's kernels (in memory: TorchRec's,
    on disk: ours) and load factor, in the shardings the sharder offers those kernels in."""
    constraint = constraint or ParameterConstraints()
    wanted = (lambda k: k != DISK_KERNEL) if memory.in_memory else (lambda k: k == DISK_KERNEL)
    kernels = [k for k in (constraint.compute_kernels or [k.value for k in EmbeddingComputeKernel] + [DISK_KERNEL])
               if wanted(k)]
    shardings = [t for t in (constraint.sharding_types or list(kernels_of))
                 if any(k in kernels for k in kernels_of.get(t, []))]
    if memory.in_memory:
        return dataclasses.replace(constraint, compute_kernels=kernels, sharding_types=shardings)
    cache = dataclasses.replace(constraint.cache_params or CacheParams(), load_factor=memory.load_factor)
    return dataclasses.replace(constraint, compute_kernels=kernels, cache_params=cache, sharding_types=shardings)


def explain_table_memory(chosen: Mapping[str, TableMemory]) -> str:
    """The choice as a table a person reads: a line per table, the predicted reads' shares."""
    total_read = sum(m.read_seconds_per_step for m in chosen.values()) or 1.0
    lines = [f"{'table':<20} {'where':<7} {'memory MiB':>10} {'load factor':>11} {'row hit rate':>12} "
             f"{'reads/step':>10} {'read ms/step':>12} {'read share':>10}"]
    for m in chosen.values():
        factor = "-" if m.load_factor is None else f"{m.load_factor:.4f}"
        lines.append(f"{m.name:<20} {'memory' if m.in_memory else 'disk':<7} {m.memory_bytes / 2**20:>10.1f} "
                     f"{factor:>11} {m.row_hit_rate:>12.3f} {m.reads_per_step:>10.0f} "
                     f"{m.read_seconds_per_step * 1e3:>12.2f} {m.read_seconds_per_step / total_read:>10.1%}")
    lines.append(f"{'total':<20} {'':<7} {sum(m.memory_bytes for m in chosen.values()) / 2**20:>10.1f} {'':>11} "
                 f"{'':>12} {sum(m.reads_per_step for m in chosen.values()):>10.0f} "
                 f"{sum(m.read_seconds_per_step for m in chosen.values()) * 1e3:>12.2f}")
    return "\n".join(lines)
