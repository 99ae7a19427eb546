"""DiskAwarePlanner: TorchRec's EmbeddingShardingPlanner with estimators that know the disk tier.

With `DiskEmbeddingBagCollectionSharder`, every table may take TorchRec's own
kernels or the disk kernel (``customized_kernel``). The stock estimators know
nothing of the disk kernel, so this planner's enumerator estimates it:

- storage: a disk shard takes its memory budget (``memory_fraction`` of its
  bytes: cache and store log) in host memory (DDR; on a GPU its cache is in
  HBM) and its bytes, times the log's space amplification, on disk (SSD);
- perf: TorchRec's estimate of the fused kernel on the same shard, plus the
  expected disk reads of its misses at the topology's SSD bandwidth.

The disk kernel is always slower, so the planner keeps a table in memory
when the memory caps allow it, and moves tables to disk when they do not.
`ParameterConstraints(compute_kernels=["customized_kernel"])` forces a table
to disk, ``["fused"]`` keeps it in memory. A plan that cannot fit raises
TorchRec's PlannerError, naming each table that fits neither in memory nor
on disk.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.types import (ParameterConstraints, Perf, PlannerError, ShardEstimator,
                                                ShardingOption, Storage, Topology)
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from .. import optim as optim_lib
from .fused_optimizer import planned_optimizer
from .job_budget import JobBudget as _JobBudget, explain_table_memory
from .kernel import DISK_KERNEL, DiskTableOptions, bucket_problem
from .memory_choice import TableMemory
from .sharded_tables import DiskSharder, planning_with_disk
from ..memory_budget import split_host_memory
from ..planning.calibration import Calibration
from ..planning.hit_rates import TableAccess
from ..row_layout import row_bytes

__all__ = ["DiskAwarePlanner", "DiskAwarePerfEstimator", "DiskAwareStorageEstimator"]

DISK_SPACE_AMPLIFICATION = 2.0
"""Disk bytes per live byte a store may hold: the log is compacted when half of a segment is garbage."""
_RECORD_HEADER_BYTES = 16
_DISK_PAGE_BYTES = 4096  # one random read per missed row


def _planned_optimizer(option: ShardingOption, fused_params: Dict[str, Any]) -> optim_lib.SparseOptimizer:
    """The optimizer the sharder will give this option's table (`planned_optimizer`)."""
    return planned_optimizer(option.tensor, fused_params, option.name)


def _table_config(option: ShardingOption) -> Any:
    """The TorchRec config of the table a disk sharding option places (the disk sharders shard
    EmbeddingBagCollection and EmbeddingCollection, which keep one per table)."""
    module = option.module[1]
    configs = module.embedding_bag_configs() if hasattr(module, "embedding_bag_configs") \
        else module.embedding_configs()
    for config in configs:
        if config.name == option.name:
            return config
    raise ValueError(f"table {option.name!r} is in no config of its module {type(module).__name__}")


class _DiskEstimatorBase(ShardEstimator):
    """Holds the disk options the planner found on the sharder."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]]) -> None:
        self._topology = topology
        self._constraints = constraints or {}
        self.options = DiskTableOptions(storage_dir="")

    @staticmethod
    def _split(options: List[ShardingOption]):
        return ([o for o in options if o.compute_kernel == DISK_KERNEL],
                [o for o in options if o.compute_kernel != DISK_KERNEL])


class DiskAwareStorageEstimator(_DiskEstimatorBase):
    """TorchRec's storage estimate for its kernels; for disk shards, memory budget and disk bytes."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 **kwargs: Any) -> None:
        super().__init__(topology, constraints)
        self._stock = EmbeddingStorageEstimator(topology, constraints, **kwargs)

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map: Any = None) -> None:
        disk, rest = self._split(sharding_options)
        self._stock.estimate(rest, sharder_data_map)
        for option in disk:
            fused = sharder_data_map[option.module_type_key].fused_params if sharder_data_map else {}
            optimizer = _planned_optimizer(option, fused)
            dtype = option.tensor.dtype
            config = _table_config(option)
            cap = self.options.virtual_cap(config)
            if option.sharding_type == "row_wise" and bucket_problem(config, self._topology.world_size):
                raise ValueError(bucket_problem(config, self._topology.world_size))
            for shard in option.shards:
                rows, cols = shard.size
                budget = self.options.shard_budget(config, rows, row_bytes(cols, dtype, optimizer),
                                                   option.cache_load_factor)
                held = self.options.live_rows(option.name, rows, option.tensor.shape[0], cap)
                on_disk = int(held * (row_bytes(cols, dtype, optimizer) + _RECORD_HEADER_BYTES)
                              * DISK_SPACE_AMPLIFICATION)
                if self._topology.compute_device == "cuda":  # the cache in device memory, the log on the host
                    shard.storage = Storage(hbm=budget, ddr=budget, ssd=on_disk)
                else:
                    shard.storage = Storage(hbm=0, ddr=budget, ssd=on_disk)


class DiskAwarePerfEstimator(_DiskEstimatorBase):
    """TorchRec's perf estimate for its kernels; for disk shards, the fused kernel's estimate plus
    the reads of the rows that miss memory: with `access` and `calibration`, the distinct rows a
    step is predicted to miss at this machine's measured cost of a missed lookup; without, the
    lookups' share `1 - memory_fraction` (or the user's cache statistics) as 4 KiB reads at the
    topology's SSD bandwidth."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 is_inference: bool = False, *, access: Optional[Mapping[str, TableAccess]] = None,
                 calibration: Optional[Calibration] = None) -> None:
        super().__init__(topology, constraints)
        self._stock = EmbeddingPerfEstimator(topology, constraints, is_inference)
        self._access = access if calibration is not None else None
        self._calibration = calibration

    def _miss_rate(self, option: ShardingOption) -> float:
        constraint = self._constraints.get(option.name)
        stats = constraint.cache_params.stats if constraint and constraint.cache_params else None
        if stats is not None:  # the user's measured access statistics for this table
            return float(stats.expected_miss_rate(option.cache_load_factor or self.options.memory_fraction))
        return 1.0 - (option.cache_load_factor or self.options.memory_fraction)  # no skew: the pessimistic bound

    def _read_ms(self, option: ShardingOption, shard: Any, sharder_data_map: Any) -> "tuple[float, float]":
        """Milliseconds a step of `shard` spends on disk in its forward and its backward."""
        table_rows = option.tensor.shape[0]
        access = self._access.get(option.name) if self._access else None
        if access is None:
            lookups = sum(length * option.batch_size for length in option.input_lengths) * self._topology.world_size
            # A shard reads the misses of the ids in its rows: a row shard its block's share (ids
            # spread over the table), a table or column shard every id's.
            read_ms = lookups * self._miss_rate(option) * _DISK_PAGE_BYTES / self._topology.ssd_mem_bw \
                * shard.size[0] / table_rows
            return read_ms, read_ms
        rows, cols = shard.size
        fused = sharder_data_map[option.module_type_key].fused_params if sharder_data_map else {}
        layout_bytes = row_bytes(cols, option.tensor.dtype, _planned_optimizer(option, fused))
        budget = self.options.shard_budget(_table_config(option), rows, layout_bytes, option.cache_load_factor)
        on_host = self._topology.compute_device != "cuda"
        cache_rows = split_host_memory(budget, 1, rows, layout_bytes, on_host).cache_rows
        share = rows / table_rows  # a row shard holds its block's share of every popularity rank
        step = access.scaled(self._topology.world_size)  # every rank's batch looks the table up
        misses = step.misses_per_batch(int(cache_rows / share)) * share
        # Measured in the forward: a miss's read and admission; its row's write-back is the writer's.
        return misses * self._calibration.table_cost("miss_s", cols) * 1e3, 0.0

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map: Any = None) -> None:
        disk, rest = self._split(sharding_options)
        self._stock.estimate(rest, sharder_data_map)
        if not disk:
            return
        for option in disk:  # TorchRec's estimate of the same shards in memory ...
            option.compute_kernel = EmbeddingComputeKernel.FUSED.value
        try:
            self._stock.estimate(disk, sharder_data_map)
        finally:
            for option in disk:
                option.compute_kernel = DISK_KERNEL
        for option in disk:  # ... plus the disk reads of its misses
            for shard in option.shards:
                forward_ms, backward_ms = self._read_ms(option, shard, sharder_data_map)
                perf = shard.perf
                shard.perf = Perf(fwd_compute=perf.fwd_compute + forward_ms, fwd_comms=perf.fwd_comms,
                                  bwd_compute=perf.bwd_compute + backward_ms, bwd_comms=perf.bwd_comms,
                                  input_dist_comms=perf.input_dist_comms, prefetch_compute=perf.prefetch_compute)


class DiskAwarePlanner(EmbeddingShardingPlanner):
    """EmbeddingShardingPlanner (same constructor, `plan`, `collective_plan`) whose default
    enumerator estimates the disk kernel of `DiskEmbeddingBagCollectionSharder`.

    Give the Topology ``ddr_cap`` (host memory per rank) and ``ssd_cap`` (disk per rank): tables
    that do not fit the memory caps go to disk.

    With `access` (each table's popularity, `planning.access_from_batches` over a sample of the
    training input) and `calibration` (`planning.calibration_for`), a disk shard's estimate is its
    predicted reads a step at this machine's measured cost; with `memory_budget_bytes` too (the
    whole job's host memory for its tables), the planner chooses which tables stay in memory and
    each disk table's share of its bytes in memory (``CacheParams.load_factor`` in the plan) to
    read the least from disk (`memory_choice`), and `explain()` shows the choice.
    """

    def __init__(self, topology: Optional[Topology] = None, batch_size: Optional[int] = None,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None, *,
                 access: Optional[Mapping[str, TableAccess]] = None, calibration: Optional[Calibration] = None,
                 memory_budget_bytes: Optional[int] = None, **kwargs: Any) -> None:
        if memory_budget_bytes is not None and (access is None or calibration is None):
            raise ValueError("memory_budget_bytes: the planner spends a job's budget by the tables' predicted reads, "
                             "so it needs access (planning.access_from_batches) and calibration "
                             "(planning.calibration_for) too")
        self._disk_estimators: List[_DiskEstimatorBase] = []
        # The planner's own constraints (the user's, copied): a job budget's choice writes each table's into it.
        self._user_constraints = dict(constraints or {})
        self._own_constraints: Dict[str, ParameterConstraints] = dict(self._user_constraints)
        self._job = _JobBudget(access, calibration, memory_budget_bytes,
                               topology.compute_device if topology is not None else "cpu")
        self.table_memory: Dict[str, TableMemory] = {}
        if topology is not None and kwargs.get("enumerator") is None:
            self._disk_estimators = [DiskAwarePerfEstimator(topology, self._own_constraints, access=access,
                                                            calibration=calibration),
                                     DiskAwareStorageEstimator(topology, self._own_constraints)]
            kwargs["enumerator"] = EmbeddingEnumerator(topology=topology, batch_size=batch_size or 512,
                                                       constraints=self._own_constraints,
                                                       estimator=self._disk_estimators)
        super().__init__(topology=topology, batch_size=batch_size, constraints=self._own_constraints, **kwargs)

    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        disk_sharders = [s for s in sharders if isinstance(s, DiskSharder)]
        for estimator in self._disk_estimators:
            estimator.options = disk_sharders[0].options if disk_sharders else DiskTableOptions(storage_dir="")
        with planning_with_disk():
            if self._job.memory_budget_bytes is not None:
                self._own_constraints.clear()  # from the user's each time: a second plan is not bound by the first
                self._own_constraints.update(self._user_constraints)
                self.table_memory = self._job.choose(module, disk_sharders, self._own_constraints,
                                                     self._topology.world_size)
            try:
                return super().plan(module, sharders)
            except PlannerError as e:
                raise PlannerError(self._what_does_not_fit(module, sharders) + str(e), e.error_type) from e

    def explain(self) -> str:
        """A line per table of the last plan's choice under the job's budget: in memory or on disk,
        its memory, predicted hit rate of a step's rows, reads a step and their share of the
        predicted read seconds."""
        if not self.table_memory:
            return "no job budget was planned (give memory_budget_bytes, access and calibration, then plan)"
        return explain_table_memory(self.table_memory)

    def _what_does_not_fit(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> str:
        """A line per table that fits no rank in memory and none on disk, in its smallest option."""
        device = self._topology.devices[0].storage
        smallest: Dict[str, Dict[str, Storage]] = {}
        for option in self._enumerator.enumerate(module, sharders):
            where = "disk" if option.compute_kernel == DISK_KERNEL else "memory"
            largest_shard = max((s.storage for s in option.shards if s.storage is not None),
                                key=lambda s: (s.hbm, s.ddr, s.ssd), default=None)
            if largest_shard is None:
                continue
            best = smallest.setdefault(option.name, {})
            if where not in best or (largest_shard.ddr + largest_shard.hbm) < (best[where].ddr + best[where].hbm):
                best[where] = largest_shard
        lines = []
        gib = 1 << 30
        for table, best in smallest.items():
            problems = []
            for where, need in sorted(best.items()):
                if not need.fits_in(device):
                    short = [f"{tier} {getattr(need, tier) / gib:.3f} GiB > {getattr(device, tier) / gib:.3f} GiB"
                             for tier in ("hbm", "ddr", "ssd") if getattr(need, tier) > getattr(device, tier)]
                    problems.append(f"{where}: its largest shard needs " + ", ".join(short))
            if len(problems) == len(best):
                lines.append(f"table {table!r} fits no rank ({'; '.join(problems)})")
        if not lines:
            return "every table fits a rank alone, but not all of them together within the caps; "
        return "; ".join(lines) + ". "
