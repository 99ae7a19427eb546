"""What the sharded disk collections (of EmbeddingBagCollection and of EmbeddingCollection) and
their sharders share: the disk kernels of a rank, their look-ahead, state dicts, cuts and
statistics (`DiskShardedTables`), and a sharder that offers the disk kernel to the planner that
estimates it (`DiskSharder`)."""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import warnings
from collections import defaultdict
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import Awaitable, ParameterSharding, ShardingEnv
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..cut import PendingCut
from ..disk_modules import DiskTableModule
from ..table_settings import DiskTableSettings
from .fused_optimizer import fused_params_of
from .kernel import DISK_KERNEL, DiskEmbeddingKernel, DiskTableOptions, on_host
from .shardings.lookup import DiskGroupLookahead
from .state_dicts import disk_tables_in_state_dict
from .tables import DATA_TYPES, table_seed

# Set while DiskAwarePlanner plans: only then does the sharder offer its disk kernel.
_planning_with_disk: contextvars.ContextVar[bool] = contextvars.ContextVar("mlkv_planning_with_disk", default=False)


@contextlib.contextmanager
def planning_with_disk() -> Iterator[None]:
    """The planner that estimates the disk kernel (DiskAwarePlanner) plans inside this."""
    token = _planning_with_disk.set(True)
    try:
        yield
    finally:
        _planning_with_disk.reset(token)


def unwrapped_lookups(sharded: nn.Module) -> Iterator[nn.Module]:
    """A sharded collection's lookups, one per sharding type (in `_sharding_types`' order), without
    the DistributedDataParallel some are wrapped in."""
    for lookup in sharded._lookups:
        while isinstance(lookup, nn.parallel.DistributedDataParallel):
            lookup = lookup.module
        yield lookup




def refuse_unfit_disk_shardings(sharding_infos: List[EmbeddingShardingInfo], sharding_type: str,
                                supported: Sequence[str]) -> None:
    """Refuses, on every rank (each knows the plan), disk tables sharded a way the disk kernel does
    not take, or by rows over more ranks than they have rows."""
    on_disk = [i for i in sharding_infos if i.param_sharding.compute_kernel == DISK_KERNEL]
    if on_disk and sharding_type not in supported:
        raise ValueError(f"disk tables {[i.embedding_config.name for i in on_disk]} are sharded {sharding_type}; "
                         f"disk tables support {list(supported)}")
    for info in on_disk:
        shards = info.param_sharding.sharding_spec.shards if info.param_sharding.sharding_spec else []
        if any(int(m.shard_sizes[0]) == 0 for m in shards):
            raise ValueError(f"table {info.embedding_config.name!r} has {info.embedding_config.num_embeddings} "
                             f"rows, fewer than the {len(shards)} ranks it is sharded {sharding_type} over, so a "
                             f"rank would hold none of them: shard it table-wise "
                             f"(ParameterConstraints(sharding_types=['table_wise'])) or over fewer ranks")


class DiskShardedTables(DiskTableModule):
    """The disk side of a TorchRec sharded collection whose ``customized_kernel`` tables live on disk.

    Mixed in before TorchRec's sharded module; `tables_attribute` names where that module keeps
    its tables (``embedding_bags``, ``embeddings``: the state dict keys). `_init_disk_tables` runs
    before TorchRec's __init__, `_register_disk_state_dict_hooks` after it."""

    tables_attribute: str
    _device: Optional[torch.device]  # TorchRec's sharded module's
    _env: ShardingEnv
    _lookups: List[nn.Module]
    _table_name_to_config: Dict[str, Any]
    module_sharding_plan: Dict[str, ParameterSharding]

    def _init_disk_tables(self, plan: Dict[str, ParameterSharding], options: DiskTableOptions,
                          configs: Sequence[Any]) -> None:
        # Read by the sharding's creation, which TorchRec's __init__ calls; the user's configs carry
        # what TorchRec's shardings do not hand every kernel (a virtual table's eviction policy).
        self._disk_options = replace(options, table_configs={c.name: c for c in configs})
        self._disk_table_names = [name for name, ps in plan.items() if ps.compute_kernel == DISK_KERNEL]
        self._input_keys: Optional[List[str]] = None  # of the first input distribution (see input_dist)

    def _register_disk_state_dict_hooks(self) -> None:
        self._register_state_dict_hook(DiskShardedTables._disk_tables_to_state_dict)  # type: ignore[attr-defined]
        self._register_load_state_dict_pre_hook(self._disk_tables_from_state_dict,  # type: ignore[attr-defined]
                                                with_module=True)

    def reset_parameters(self) -> None:
        # Disk tables start from their stores (initial rows or the rows already there); TorchRec's
        # init_fn must not touch them, and ranks without a shard still need the `weight` attribute.
        for name in self._disk_table_names:
            module = getattr(self, self.tables_attribute)[name]
            if "weight" not in module._parameters:
                module.register_parameter("weight", nn.Parameter(torch.empty(0)))
                module.weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        super().reset_parameters()

    @property
    def disk_table_names(self) -> List[str]:
        """The tables the plan put on disk (on every rank alike, whether it holds a shard or not)."""
        return list(self._disk_table_names)

    def _unwrapped_lookups(self) -> Iterator[nn.Module]:
        return unwrapped_lookups(self)

    def disk_kernels(self) -> Iterator[DiskEmbeddingKernel]:
        """The kernels of this rank's disk tables."""
        for lookup in self._unwrapped_lookups():
            for module in getattr(lookup, "_emb_modules", []):
                if isinstance(module, DiskEmbeddingKernel):
                    yield module

    @property
    def lookahead_process_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that must call `lookahead` together, batch for batch in the same order (it runs
        the input distribution); None when the plan has no disk table, and `lookahead` does nothing."""
        return self._env.process_group if self._disk_table_names else None

    def lookahead(self, features: KeyedJaggedTensor) -> Optional[int]:
        """Starts reading, on the ranks that hold them, the disk rows a future batch will look up;
        returns the read-ahead's token (`read_ahead_next`; None: no disk table).

        A collective over `lookahead_process_group`: it runs TorchRec's input distribution of
        `features` (an all-to-all of the ids, which the batch's forward runs again) and waits for
        it; the reads themselves run in the background. Every rank calls it with its part of the
        same future batch, the KeyedJaggedTensor the module's forward will receive.

        Args:
            features: this rank's sparse features of the future batch.
        """
        if not self._disk_table_names:  # the same on every rank: the plan is global
            return None
        token = self._read_ahead_token = getattr(self, "_read_ahead_token", 0) + 1
        dist_input = self.input_dist(self.create_context(), features).wait().wait()
        for lookup, sharding_features in zip(self._unwrapped_lookups(), dist_input):
            if isinstance(lookup, DiskGroupLookahead):
                lookup.lookahead(sharding_features, token)
        return token

    def read_ahead_next(self, token: Optional[int]) -> None:
        """The next training forward is the batch read ahead as `token` (None: one not read ahead):
        each disk kernel then pools from its read-ahead, which the input distribution of that
        forward routes the same ids to."""
        for kernel in self.disk_kernels():
            kernel.read_ahead_next(token)

    def input_dist(self, ctx: Any, features: Union[KeyedJaggedTensor, TensorDict]
                   ) -> Awaitable[Awaitable[KJTList]]:
        # TorchRec fixes the feature permutation on the first call: a lookahead with other keys than
        # the forward's would route ids to the wrong tables.
        if isinstance(features, KeyedJaggedTensor):
            keys = features.keys()
            if self._input_keys is None:
                self._input_keys = list(keys)
            elif keys != self._input_keys:
                raise ValueError(f"the sparse features' keys {keys} differ from those of the first input "
                                 f"distribution {self._input_keys}: lookahead must get the KeyedJaggedTensor "
                                 f"the module's forward gets")
        return super().input_dist(ctx, features)

    def _global_metadata(self, table: str) -> ShardedTensorMetadata:
        config = self._table_name_to_config[table]
        spec = self.module_sharding_plan[table].sharding_spec
        metadata = spec.build_metadata(tensor_sizes=torch.Size([config.num_embeddings, config.embedding_dim]),
                                       tensor_properties=TensorProperties(dtype=DATA_TYPES[config.data_type]))
        metadata.shards_metadata = [on_host(m, self._device) for m in metadata.shards_metadata]
        return metadata

    @staticmethod
    def _disk_tables_to_state_dict(module: "DiskShardedTables", destination: Dict[str, Any],
                                   prefix: str, local_metadata: Dict[str, Any]) -> None:
        if not disk_tables_in_state_dict():  # nor what the base module put under their names
            for table in module._disk_table_names:
                destination.pop(f"{prefix}{module.tables_attribute}.{table}.weight", None)
            return
        raw = sorted(set(module._disk_table_names) & set(module._disk_options.live_ids or {}))
        if raw:  # a dense tensor of their id space (2**40 rows) would never be written, nor read back
            raise RuntimeError(
                f"tables {raw} hold raw ids (the sharder's live_ids), as many rows as their id space: a state dict "
                f"cannot hold them dense. Save the model within mlkv_torch.torchrec.disk_tables_left_out() and "
                f"keep the tables' rows in cuts (the sharded collection's checkpoint()), as the runner does")
        local: Dict[str, List[Shard]] = defaultdict(list)
        for kernel in module.disk_kernels():
            for table in kernel.table_names:
                local[table].extend(kernel.local_weight_shards(table))
        for table in module._disk_table_names:
            destination[f"{prefix}{module.tables_attribute}.{table}.weight"] = \
                ShardedTensor._init_from_local_shards_and_global_metadata(
                    local[table], module._global_metadata(table), process_group=module._env.process_group)

    @staticmethod
    def _disk_tables_from_state_dict(module: "DiskShardedTables", state_dict: Dict[str, Any],
                                     prefix: str, *args: Any) -> None:
        kernels = {table: kernel for kernel in module.disk_kernels() for table in kernel.table_names}
        for table in module._disk_table_names:
            key = f"{prefix}{module.tables_attribute}.{table}.weight"
            if not disk_tables_in_state_dict():  # the tables reopened at their cut
                module._skip_missing_weight_key.append(key)
                continue
            if key not in state_dict:
                continue  # load_state_dict reports it missing
            weight = state_dict.pop(key)
            if table in kernels:
                kernels[table].load_weights(table, weight)
            module._skip_missing_weight_key.append(key)

    def flush(self) -> None:
        """Applies the queued updates of this rank's disk tables and writes their changed rows to
        the stores (as DiskEmbeddingBagCollection.flush)."""
        for kernel in self.disk_kernels():
            kernel.flush()

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """DiskEmbeddingBag.stats() of each disk shard on this rank, by ``<table>_rows<r0>_cols<c0>``."""
        return {name: stats for kernel in self.disk_kernels() for name, stats in kernel.stats().items()}

    def local_disk_shards(self) -> List[Tuple[str, int, int, Any]]:
        return [shard for kernel in self.disk_kernels() if not kernel.on_meta for shard in kernel.local_shards()]

    def populate(self) -> int:
        """Writes every row of this rank's disk shards to their stores (`DiskEmbeddingBag.populate`),
        so reads come from disk as in tables trained for a while, then takes a cut of them
        (`checkpoint`), so the rows are durable and the first cut of training writes only what
        training changed; returns the rows."""
        rows = sum(kernel.populate() for kernel in self.disk_kernels())
        self.checkpoint()
        return rows

    def begin_checkpoint(self, label: Optional[int] = None) -> Optional[PendingCut]:
        """Begins a cut of this rank's disk tables at this step boundary (as
        `DiskEmbeddingBagCollection.begin_checkpoint`); ``wait()`` commits it in the rank's directory
        (``<storage_dir>/rank<r>/CUT.json``) and returns its record. None on a rank without disk
        tables. Every rank takes its own; a training checkpoint records them together."""
        kernels = [kernel for kernel in self.disk_kernels() if not kernel.on_meta]
        if not kernels:
            return None
        return PendingCut(kernels[0].rank_dir, label,
                          [part for kernel in kernels for part in kernel.begin_checkpoint()])

    def checkpoint(self, label: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """A cut of this rank's disk tables (`begin_checkpoint`), committed before this returns; its
        record (None without disk tables). After a crash, the sharder's ``reopen=True`` reopens each
        rank's tables at the cut its directory records, or at ``cuts={rank: record}``."""
        pending = self.begin_checkpoint(label)
        return None if pending is None else pending.wait()

    def close(self) -> None:
        """Takes a last cut of this rank's disk tables (`checkpoint`), then closes them."""
        try:
            if not any(kernel.closed for kernel in self.disk_kernels()):
                self.checkpoint()
        finally:
            for kernel in self.disk_kernels():
                kernel.close()


class DiskSharder:
    """The disk side of a TorchRec sharder (mixed in before it): the disk tables' options, and the
    disk kernel offered, for `disk_sharding_types`, to the planner that estimates it
    (DiskAwarePlanner); the arguments are DiskEmbeddingBagCollectionSharder's."""

    disk_sharding_types: Sequence[str]

    def __init__(self, storage_dir: Union[str, os.PathLike], *, memory_fraction: float = 0.1,
                 cuts: Optional[Dict[int, Any]] = None, live_ids: Optional[Dict[str, int]] = None,
                 settings: Optional[DiskTableSettings] = None, fused_params: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        ours, torchrec_kwargs = DiskTableSettings.split_keywords(kwargs)
        takes = inspect.signature(super().__init__).parameters  # type: ignore[misc]
        unknown = sorted(set(torchrec_kwargs) - set(takes))
        if unknown and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in takes.values()):
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments {unknown}; the disk tables' "
                            f"settings are {list(DiskTableSettings.keywords())} (DiskTableSettings), TorchRec's "
                            f"sharder takes {sorted(takes)}")
        settings = DiskTableSettings.of(settings, ours, type(self).__name__).with_seed()
        self._told_planner = False
        self._modules_sharded = 0
        self.options = DiskTableOptions(os.fspath(storage_dir), settings, memory_fraction, cuts=cuts,
                                        live_ids=live_ids)
        if settings.optimizer is not None:
            fused_params = {**fused_params_of(settings.optimizer), **(fused_params or {})}
        super().__init__(fused_params=fused_params, **torchrec_kwargs)  # type: ignore[call-arg]

    def next_module_options(self, device: Optional[torch.device] = None) -> DiskTableOptions:
        """The options of the next module this sharder shards (`shard` calls it once a module). The
        first keeps `options`; the k-th after it (a second collection of a model, or a second model)
        keeps its tables in ``storage_dir/module<k>`` and, with a drawn seed, starts from other rows,
        as a second TorchRec collection would (torch's generator has moved on). A module sharded
        on the meta device opens nothing and takes no place. ``cuts`` name one module's cuts:
        a second module is refused with them (give each module its own sharder)."""
        if device is not None and device.type == "meta":
            return self.options
        k, self._modules_sharded = self._modules_sharded, self._modules_sharded + 1
        if k == 0:
            return self.options
        if self.options.cuts is not None:
            raise ValueError(f"{type(self).__name__}(cuts=...) names the cuts of one module's tables, and this is "
                             f"the {k + 1}th module it shards: give each module its own sharder (and storage_dir)")
        settings = self.options.settings
        if settings.seed_drawn:
            settings = replace(settings, seed=table_seed(settings.seed, f"module{k}"))
        return replace(self.options, storage_dir=os.path.join(self.options.storage_dir, f"module{k}"),
                       settings=settings)

    def sharded_module_arguments(self) -> Dict[str, Any]:
        """The arguments of TorchRec's sharded module that only this kind of collection takes."""
        return {}

    def shard(self, module: nn.Module, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None) -> nn.Module:
        """The sharded module (the sharder's `sharded_module_type`) of `module` under the plan
        `params`, its disk tables in the next module's directory (`next_module_options`)."""
        return self.sharded_module_type(  # type: ignore[attr-defined]
            module, params, env, self.next_module_options(device), fused_params=self.fused_params,  # type: ignore
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry,  # type: ignore[attr-defined]
            module_fqn=module_fqn, **self.sharded_module_arguments())

    def sharding_types(self, compute_device_type: str) -> List[str]:
        # TorchRec offers row-wise only on CUDA; disk tables take it on every device.
        types = super().sharding_types(compute_device_type)
        if _planning_with_disk.get():
            types += [t for t in self.disk_sharding_types if t not in types]
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        if sharding_type not in super().sharding_types(compute_device_type):
            kernels = []  # TorchRec's own kernels do not take this sharding here: disk tables only
        if sharding_type not in self.disk_sharding_types:
            return kernels
        if _planning_with_disk.get():
            return kernels + [DISK_KERNEL]
        # Another planner (DistributedModelParallel's default, say) cannot estimate the disk kernel:
        # it plans every table in memory, and says how to put tables on disk.
        if not self._told_planner:
            self._told_planner = True
            warnings.warn(f"{type(self).__name__}: this plan comes from a planner that does not know the "
                          f"disk kernel (DistributedModelParallel's default when no plan= is passed): every table "
                          "stays in memory. To put tables on disk, plan with mlkv_torch.torchrec.DiskAwarePlanner("
                          "topology=Topology(world_size, compute_device, ddr_cap=<host memory per rank>), ...) "
                          "and pass "
                          "plan=planner.collective_plan(model, [sharder]) to DistributedModelParallel", stacklevel=2)
        return kernels
