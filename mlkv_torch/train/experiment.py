"""One run's model, tables, data and optimizers (`Experiment`), in one process or as a rank of
torchrun, with its two checkpoint protocols: a cut of the tables in one process, each rank's copy
of its shards under torchrun."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import optim as optim_lib
from ..config import CommsConfig, ConfigError, ExperimentConfig, StorageConfig
from ..cut import PendingCut, read_json_record, write_json_record
from ..disk_modules import DiskTableModule
from ..exported_tables import read_export, read_export_on_ranks
from ..memory_budget import MemoryBudgetError
from ..ranks import all_gather_objects
from ..table_settings import DiskTableSettings
from . import checkpoints, reshard
from .auc import binary_auc
from .checkpoint_tables import WrittenCheckpoint, read_pointer, written_checkpoint
from .placement import runner_group, this_process_placement
from .sources import BatchSource, batch_source, input_cpu_budget, loader_tuner

_OPTIMIZERS = {rule.name: rule for rule in (optim_lib.SGD, optim_lib.Adagrad, optim_lib.RowWiseAdagrad, optim_lib.Adam)}
_BACKENDS = {"disk": "mlkv", "rocksdb": "rocksdb"}  # storage kind -> DiskEmbeddingBag backend
_PLANNER_RESERVED = 0.15  # DiskAwarePlanner's default storage reservation
_PLANNING_SAMPLE_BATCHES = 8  # the input's first batches, whose ids predict the tables' hit rates
_PLANNER_HEADROOM = 8 << 20  # what it reserves per rank for the dense model and input buffers
_NOT_COMMITTED = "not-committed.json"  # in a torchrun checkpoint's directory: rank 0 gave it up


def _virtual_table_fields(config: ExperimentConfig) -> Dict[str, Any]:
    """TorchRec's virtual-table fields of every table's config (storage.virtual_tables)."""
    from torchrec.modules.embedding_configs import (CountBasedEvictionPolicy, CountTimestampMixedEvictionPolicy,
                                                    NoEvictionPolicy, TimestampBasedEvictionPolicy)

    virtual = config.storage.virtual_tables
    if not virtual.enabled:
        return {}
    trigger = dict(training_id_eviction_trigger_count=virtual.trigger_ids)
    count = dict(eviction_threshold=virtual.count_threshold, decay_rate=virtual.decay_rate)
    policy = {"none": lambda: NoEvictionPolicy(),
              "count": lambda: CountBasedEvictionPolicy(**trigger, **count),
              "timestamp": lambda: TimestampBasedEvictionPolicy(**trigger, eviction_ttl_mins=virtual.ttl_minutes),
              "count_and_timestamp": lambda: CountTimestampMixedEvictionPolicy(
                  **trigger, **count, eviction_ttl_mins=virtual.ttl_minutes)}[virtual.eviction]()
    return dict(use_virtual_table=True, total_num_buckets=virtual.total_num_buckets,
                virtual_table_eviction_policy=policy)


def _virtual_table_options(config: ExperimentConfig) -> Optional[Any]:
    from ..virtual_tables import VirtualTableOptions

    virtual = config.storage.virtual_tables
    return VirtualTableOptions(virtual.admit_after, virtual.minute_steps, virtual.keep_fraction) \
        if virtual.enabled else None


class Experiment:
    """The model, data and optimizers of one run; `resume` reopens the tables an earlier run left,
    `imported` (an export's path) fills fresh tables from an export."""

    def __init__(self, config: ExperimentConfig, resume: bool = False, imported: Optional[str] = None) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        self.config = config
        self.distributed = dist.is_available() and dist.is_initialized()
        cpu_budget = input_cpu_budget(config, torch_threads(config))
        self.source: BatchSource = batch_source(config, cpu_budget, self.world_size)
        tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=config.model.embedding_dim, num_embeddings=n,
                                     feature_names=features, **_virtual_table_fields(config))
                  for name, n, features in self.source.tables]
        self.table_configs = tables
        self.virtual_tables = _virtual_table_options(config)
        torch.manual_seed(config.train.seed)
        self.rule = _OPTIMIZERS[config.train.optimizer](lr=config.train.lr)
        self.resume = resume
        # A checkpoint of another world, or of another plan (`_build_sharded` compares), is
        # resharded into tables of their own (a generation of the tables path); resuming one's own
        # world and plan reopens the generation its checkpoint names. An export fills the tables of
        # a new run.
        self.resharding: Optional[reshard.TableSource] = None
        if imported:
            self.resharding = read_export_on_ranks(imported) if self.distributed else read_export(imported)
        self._written = written_checkpoint(config.output_dir, config.tables_path) if resume else None
        self.generation = self._written.generation if self._written is not None else ""
        # (step, batches trained by then over all ranks) of the checkpoint or export loaded: the data
        # goes on from the next batch whatever world trained those (`batches_at`).
        self._batches_origin = (0, 0)
        self.tables_path = os.path.join(config.tables_path, self.generation) if self.generation else config.tables_path
        if self._written is not None and (self._written.one_process, self._written.processes) != (
                not self.distributed, self.world_size):
            self._reshard_from(self._written)
        self.device = this_process_placement(config.device, self.distributed).device
        self._saving: Optional[threading.Thread] = None  # the checkpoint being written
        # The training loop marks each boundary; the checkpoint's work follows them.
        self.boundaries = checkpoints.StepBoundaries()
        self._save_error: Optional[BaseException] = None
        # One process resumes from a cut: the checkpoint names the one its tables reopen at.
        self._resumed: Optional[Dict[str, Any]] = None
        if resume and self.resharding is None and not self.distributed and os.path.exists(self.checkpoint_path()):
            self._resumed = checkpoints.load_checkpoint(self.checkpoint_path())
            if "cut" not in self._resumed:
                raise ConfigError(f"{self.checkpoint_path()} was written by an earlier mlkv_torch (it holds every "
                                  f"row, not a cut of the tables); resume it with that version")
        self.collection: DiskTableModule  # the model's disk tables: one process's, or this rank's sharded ones
        self.replicas: Optional[Any] = None  # HotRowReplicas under torchrun with storage.replicas.fraction > 0
        if config.storage.replicas.fraction > 0 and self.world_size < 2:
            raise ConfigError("storage.replicas.fraction: replicas need several ranks (run under torchrun); with one "
                              "every row is local: set it to 0")
        try:
            if self.distributed:
                self._build_sharded(tables)
            else:
                self._build_local(tables)
        except MemoryBudgetError as e:
            raise ConfigError(f"storage.memory_budget_bytes: {e}") from e

    def _reshard_from(self, written: WrittenCheckpoint) -> None:
        """Fills this run's tables from `written` (`load`): opens them anew in a generation of their
        own, where what a reshard killed before left is removed first."""
        from ..torchrec.kernel import rank_storage_dir

        written.check_tables_recorded()
        self.resharding = written
        self.generation = reshard.generation(self.world_size, not self.distributed, written.step, written.generation)
        self.tables_path = os.path.join(self.config.tables_path, self.generation)
        shutil.rmtree(rank_storage_dir(self.tables_path, self.rank) if self.distributed else self.tables_path,
                      ignore_errors=True)

    def _dlrm(self, collection: torch.nn.Module) -> torch.nn.Module:
        """DLRM over `collection`; its dense layers start from the seed's CPU values on every device, so
        a run on CUDA starts where the same run on the CPU does (on the meta device, an
        EmbeddingBagCollection for DistributedModelParallel, which moves the model itself)."""
        from torchrec.models.dlrm import DLRM, DLRMTrain

        model = self.config.model
        dlrm = DLRMTrain(DLRM(embedding_bag_collection=collection, dense_in_features=self.source.num_dense,
                              dense_arch_layer_sizes=model.dense_arch, over_arch_layer_sizes=model.over_arch,
                              dense_device=torch.device("cpu")))
        on_meta = any(p.is_meta for p in collection.parameters())
        return dlrm.to(self.device) if self.device.type != "cpu" and not on_meta else dlrm

    def _table_settings(self) -> DiskTableSettings:
        """How the run's disk tables train and are stored, one process or sharded."""
        storage = self.config.storage
        # Rows read ahead into cache slots on every device: each batch's lookup then pools from the
        # read-ahead the pipeline names (on CUDA no host synchronisation; on the CPU no second
        # deduplication, docs/benchmarks.md). Virtual tables keep the device's default: their ids
        # are admitted and counted by their lookups, not by read-aheads.
        return DiskTableSettings(optimizer=self.rule, staleness=storage.staleness, cache_policy=storage.cache_policy,
                                 backend=_BACKENDS.get(storage.kind, "mlkv"),  # memory: nothing on disk
                                 seed=self.config.train.seed, reopen=self.resume and self.resharding is None,
                                 virtual_tables=self.virtual_tables,
                                 read_ahead_into_slots=None if self.virtual_tables else True)

    def _sharder(self, tables: List[Any]) -> Any:
        """The sharder of this run's tables: under its tables path, reopening a checkpoint's cuts
        when it resumes its own world and plan."""
        from ..torchrec import DiskEmbeddingBagCollectionSharder

        storage = self.config.storage
        reopening = self.resume and self.resharding is None and os.path.exists(self.checkpoint_path())
        return DiskEmbeddingBagCollectionSharder(
            self.tables_path, memory_fraction=storage.memory_fraction if storage.memory_fraction != "auto" else 0.1,
            cuts=self._latest_sharded()[1] if reopening else None, live_ids=self._live_ids(tables),
            settings=self._table_settings(), qcomm_codecs_registry=_comms_codecs(storage.comms))

    def _build_local(self, tables) -> None:
        """One process, disk storage: DiskEmbeddingBagCollection (so the pipeline can look ahead)."""
        from ..torchrec import DiskEmbeddingBagCollection

        config, storage = self.config, self.config.storage
        self.collection = DiskEmbeddingBagCollection(
            tables, device=self.device, path=self.tables_path, memory_budget_bytes=storage.memory_budget_bytes,
            cache_rows=storage.cache_rows, cut=self._resumed["cut"] if self._resumed else None,
            settings=self._table_settings())
        self.model = self._dlrm(self.collection)
        parameters = dict(self.model.named_parameters())
        dense = [parameters[name] for name in self.dense_parameter_names()]
        self.optimizer = torch.optim.Adagrad(dense, lr=config.train.dense_lr or config.train.lr)

    def _build_sharded(self, tables) -> None:
        """Under torchrun: DistributedModelParallel; DiskAwarePlanner puts on disk the tables that do not
        fit `memory_budget_bytes` per rank (storage kind memory: none)."""
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner.types import (KernelConfig, ParameterConstraints, PlannerError,
                                                       TopologyFactory, TrainerConfig)
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from ..torchrec import DiskAwarePlanner
        from ..torchrec.replicas import ReplicaSettings, replica_memory_bytes, replicate_hot_rows
        from ..virtual_tables import rows_held

        config, storage = self.config, self.config.storage
        # The replicas' memory comes out of the budget first (every table's share: an upper bound,
        # the plan decides which tables are sharded; a virtual table's rows at most its cap a rank).
        replica_bytes = sum(replica_memory_bytes(
            min(t.num_embeddings, rows_held(t, [t.num_embeddings] * self.world_size)), t.embedding_dim,
            storage.replicas.fraction) for t in tables)
        if storage.kind != "memory" and replica_bytes >= storage.memory_budget_bytes:
            raise ConfigError(f"storage.replicas.fraction: {storage.replicas.fraction} of the rows takes "
                              f"{replica_bytes:,} bytes a rank, more than storage.memory_budget_bytes "
                              f"({storage.memory_budget_bytes:,})")
        model = self._dlrm(EmbeddingBagCollection(tables, device=torch.device("meta")))
        sharder = self._sharder(tables)
        # The planner's cap also covers what it reserves for the dense model and inputs.
        ddr_cap = (storage.memory_budget_bytes - replica_bytes + _PLANNER_HEADROOM) / (1 - _PLANNER_RESERVED) \
            if storage.kind != "memory" else 1 << 40
        topology = TopologyFactory.create_topology(  # TorchRec's way: it warns about a Topology made directly
            TrainerConfig(world_size=dist.get_world_size(), ddr_cap_bytes=int(ddr_cap), ssd_cap_bytes=1 << 42),
            kernel_config=KernelConfig(compute_device=self.device.type))
        if storage.kind == "memory":
            _check_in_memory_sharding(storage.sharding_types)
        constraints = {t.name: ParameterConstraints(sharding_types=list(storage.sharding_types),
                                                    compute_kernels=_kernels(storage, self.device)) for t in tables}
        planner = DiskAwarePlanner(topology=topology, batch_size=config.train.batch_size, constraints=constraints,
                                   debug=False, **self._job_budget(tables, replica_bytes))
        try:
            plan = planner.collective_plan(model, [sharder])
            if planner.table_memory and self.is_main:
                lines = planner.explain().splitlines()
                print("[train] the tables' memory, chosen from the input's first batches and this machine's "
                      "calibration:\n" + "\n".join(f"[train]   {line}" for line in lines), file=sys.stderr, flush=True)
        except PlannerError as e:
            if not replica_bytes:
                raise
            raise ConfigError(f"storage.memory_budget_bytes: once the replicas (storage.replicas.fraction "
                              f"{storage.replicas.fraction}) take {replica_bytes:,} bytes of it a rank, the tables "
                              f"do not fit in the rest; raise it by that much. The planner: {e}") from e
        if self.resharding is None and self._written is not None and reshard.plan_differs(self._written.tables, plan):
            self._reshard_from(self._written)  # the storage settings changed the plan: its tables move
            sharder = self._sharder(tables)
        self.model = DistributedModelParallel(model, device=self.device, plan=plan, sharders=[sharder])
        self.collection = self.model.module.model.sparse_arch.embedding_bag_collection
        if storage.replicas.fraction > 0:
            try:
                self.replicas = replicate_hot_rows(self.collection, ReplicaSettings(**storage.replicas.model_dump()))
            except ValueError as e:
                raise ConfigError(f"storage.replicas: {e}") from e
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(self.model.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params,
                                                                         lr=config.train.dense_lr or config.train.lr))
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense])

    def _job_budget(self, tables: List[Any], replica_bytes: int) -> Dict[str, Any]:
        """With storage.memory_fraction auto, what DiskAwarePlanner needs to spend the job's budget
        (every rank's memory_budget_bytes, less the replicas') by the tables' predicted reads: each
        table's popularity over the input's first `_PLANNING_SAMPLE_BATCHES` batches (every rank
        samples the same ones) and this machine's calibration under the tables' path."""
        storage = self.config.storage
        if storage.memory_fraction != "auto" or storage.kind == "memory":
            return {}
        from ..planning.calibration import calibration_for
        from ..planning.hit_rates import access_from_batches

        features = {t.name: list(t.feature_names) for t in tables}

        def table_ids(batch: Any) -> Dict[str, torch.Tensor]:
            sparse = batch.sparse_features.to_dict()
            return {name: torch.cat([sparse[f].values() for f in names]) for name, names in features.items()}

        sample = (table_ids(self.source.make_batch(number)) for number in range(_PLANNING_SAMPLE_BATCHES))
        access = access_from_batches(sample, {t.name: t.num_embeddings for t in tables})
        calibration = calibration_for(self.tables_path, self.device, group=runner_group(),
                                      needs_wire=self.world_size > 1)
        return dict(access=access, calibration=calibration,
                    memory_budget_bytes=(storage.memory_budget_bytes - replica_bytes) * self.world_size)

    def populate(self) -> int:
        """Writes every row of this rank's disk tables to their stores (storage.populate); returns the rows."""
        return self.collection.populate()

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    @property
    def is_main(self) -> bool:
        return not self.distributed or dist.get_rank() == 0

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    def batches_at(self, step: int) -> int:
        """The batches the job has trained by `step` over all its ranks: each step trains one batch
        a rank, from the batches a loaded checkpoint or export had trained (in whatever world)."""
        step0, batches0 = self._batches_origin
        return batches0 + (step - step0) * self.world_size

    def loader(self, first_step: int, steps: int) -> Any:
        """A BatchLoader of this rank's batches of steps [first_step, first_step + steps): step s
        trains batch number batches_at(s) + rank on each rank (from the rank's share of the files)."""
        from ..data.loader import BatchLoader

        world = self.world_size
        return BatchLoader(self.source.make_batch, first=self.batches_at(first_step) + self.rank, count=steps,
                           stride=world,
                           tuner=loader_tuner(self.config, torch_threads(self.config), self.source.remote_workers))

    def store_reads(self) -> int:
        """Rows this rank's disk tables have read from their stores since they were opened."""
        return sum(s["store_reads"] for s in self.collection.stats().values())

    def cache_misses(self) -> int:
        """Distinct rows this rank's disk tables' batches have missed in their caches at their lookup
        since opened (a row the pipeline read ahead into the cache is a hit)."""
        return sum(s["cache_misses"] for s in self.collection.stats().values())

    def _live_ids(self, tables: List[Any]) -> Optional[Dict[str, int]]:
        """With raw ids, the ids each table is expected to hold by the end of the run, by name (the
        planner and the shards' budgets count them, not the id space)."""
        batches = (self.config.train.steps + self.config.eval.batches) * self.world_size
        live = self.source.live_ids(batches)
        return None if live is None else {t.name: n for t, n in zip(tables, live)}

    def live_ids(self) -> Optional[int]:
        """Rows this rank's disk tables hold in their stores: after a flush, every id they were
        trained on (a table of raw ids holds those alone, however large its id space). None where
        a store does not count its rows (RocksDB)."""
        stats = self.collection.stats().values()
        return sum(s["rows"] for s in stats) if all("rows" in s for s in stats) else None

    def eviction(self) -> Optional[Tuple[int, int]]:
        """Ids this rank's virtual tables evicted (storage.virtual_tables), and the most ids one of its
        tables held after a batch; None without eviction."""
        stats = [s for s in self.collection.stats().values() if "evicted_ids" in s]
        return (sum(s["evicted_ids"] for s in stats), max(s["peak_live_ids"] for s in stats)) if stats else None

    def hit_rate(self) -> Optional[float]:
        stats = self.collection.stats().values()
        hits = sum(s["cache_hits"] for s in stats)
        looked_up = hits + sum(s["cache_misses"] for s in stats)
        return hits / looked_up if looked_up else None

    def evaluate(self, step: int = 0) -> Dict[str, float]:
        """AUC and log loss on held-out batches and, for synthetic data, the AUC of the planted
        model's true probabilities on the same batches (what a perfect model would reach there);
        after `step` training steps (data whose ids change draws them from where training is)."""
        scores: List[torch.Tensor] = []
        truths: List[torch.Tensor] = []
        oracle: List[torch.Tensor] = []
        loss_sum, count = 0.0, 0
        self.model.eval()
        with torch.no_grad():
            for batch, probabilities in self.source.eval(self.config.eval.batches, self.rank, self.world_size,
                                                         self.batches_at(step)):
                loss, (_, logits, labels) = self.model(batch.to(self.device))
                logits, labels = logits.cpu(), labels.cpu()  # the metrics and the planted probabilities' device
                scores.append(torch.sigmoid(logits).reshape(-1))
                truths.append(labels.reshape(-1))
                if probabilities is not None:
                    oracle.append(probabilities.reshape(-1))
                loss_sum += float(loss) * labels.numel()
                count += labels.numel()
        self.model.train()
        mine = [_joined(scores), _joined(truths), _joined(oracle), loss_sum, float(count)]
        everyone = all_gather_objects(mine) if self.distributed else [mine]  # the AUC is over every rank's batches
        total_loss, total_count = sum(r[3] for r in everyone), sum(r[4] for r in everyone)
        if total_count == 0:
            return {}
        every = [torch.cat([r[i] for r in everyone]) for i in range(3)]
        result = {"auc": binary_auc(every[0], every[1]), "logloss": total_loss / total_count}
        if every[2].numel():  # synthetic data: the planted model's probabilities
            result["oracle_auc"] = binary_auc(every[2], every[1])
        return result

    def checkpoint_path(self) -> str:
        """A file in one process; under torchrun, the pointer to the latest checkpoint directory."""
        return os.path.join(self.config.output_dir, checkpoints.SHARDED_CHECKPOINT_POINTER if self.distributed
                            else checkpoints.ONE_PROCESS_CHECKPOINT)

    def save(self, step: int) -> None:
        """Checkpoints at this step boundary: one cut of the tables (their stores keep the previous
        one until the checkpoint names the new), the dense model's and its optimizer's, and the
        data position (the step), committed at once by one rename. The tables' cut is written in
        the background while training goes on (`finish_save` waits for it); a checkpoint begun
        while one is being written waits for it first. Under torchrun, every rank cuts its own
        tables and writes the rest of its state (`_save_sharded`)."""
        self.finish_save()
        commit = self._save_sharded(step) if self.distributed else self._save_local(step)

        def commit_or_keep_error() -> None:
            try:
                commit()
            except BaseException as e:  # raised on the training thread by finish_save
                self._save_error = e
        self._saving = threading.Thread(target=commit_or_keep_error, name="mlkv-checkpoint", daemon=True)
        self._saving.start()

    def _save_local(self, step: int) -> Callable[[], None]:
        """One process: begins the cut, takes the dense state; returns what commits both."""
        # Its stores are told it is committed once checkpoint.pt names it (`commit` below).
        pending = self.collection.begin_checkpoint(label=step).defer_commit()
        # A copy: later steps change the optimizer's state in place.
        state = {"step": step, "dense": self._dense_state(),
                 "dense_optimizer": checkpoints.local_copy(self.optimizer.state_dict()),
                 checkpoints.TABLES_KEY: self.table_manifest(), checkpoints.GENERATION_KEY: self.generation,
                 checkpoints.BATCHES_KEY: self.batches_at(step)}

        def commit() -> None:
            # The previous checkpoint stays whole until this one is.
            self._write_over_steps(pending, state, "cut", self.checkpoint_path())
            # Only now may the stores let the previous cut go (a close after a failed step, before
            # this file was written, keeps the cut the previous file names).
            pending.commit()
        return commit

    def _write_over_steps(self, pending: Optional[PendingCut], state: Dict[str, Any], cut_key: Optional[str],
                          path: str) -> Optional[Dict[str, Any]]:
        """A checkpoint's background work, one piece a step: the cut's rows go to the stores in the
        step after the boundary, their syncs (`pending.wait`) follow the next boundary, and `state`
        (with the cut's record under `cut_key`, when given) goes to `path` after the one after that;
        no step pays for two of them. Returns the cut's record (None without disk tables)."""
        self.boundaries.wait_next()
        cut = pending.wait() if pending is not None else None
        if cut_key is not None:
            state[cut_key] = cut
        self.boundaries.wait_next()
        checkpoints.save_whole(state, path)
        return cut

    @property
    def saving(self) -> bool:
        """A checkpoint begun by `save` is still being written."""
        return self._saving is not None and self._saving.is_alive()

    def finish_save(self) -> None:
        """Waits for the checkpoint being written (`save`); raises what failed writing it."""
        saving, self._saving = self._saving, None
        if saving is None:
            return
        with self.boundaries.released():  # it need not wait for steps any more
            saving.join()
        error, self._save_error = self._save_error, None
        if error is not None:
            raise error

    def _dense_state(self) -> Dict[str, torch.Tensor]:
        """The model's parameters and buffers outside the disk tables (theirs are in the cut)."""
        tables, state = self._tables_prefix(), {}
        for module_name, module in self.model.named_modules():
            prefix = module_name + "." if module_name else ""
            if prefix.startswith(tables):
                continue
            for name, tensor in itertools.chain(module.named_parameters(recurse=False), (
                    (n, b) for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set)):
                state[prefix + name] = tensor.detach().clone()
        return state

    def _tables_prefix(self) -> str:
        return next(name for name, module in self.model.named_modules() if module is self.collection) + "."

    def _save_sharded(self, step: int) -> Callable[[], None]:
        """Under torchrun: every rank begins a cut of its disk tables (no row copied) and copies the
        rest of its state (dense model, its shards of in-memory tables, optimizers). Returns what
        commits them, in the background: each rank writes its state to checkpoint-<step>/rank<r>.pt
        and, once its cut is written, records it there (cut-rank<r>.json); rank 0, once every rank
        has, renames the pointer, which names the directory and every rank's cut. Like the cuts of
        the disk tables, a rank's file belongs to its place in the plan; another world reads them
        all (`reshard`)."""
        from ..torchrec import disk_tables_left_out

        # The checkpoint a reshard reads keeps its directory until the new one is committed.
        names = [f"checkpoint-{step}"]
        if isinstance(self.resharding, WrittenCheckpoint) and step == self.resharding.step:
            read = read_pointer(self.checkpoint_path())[0] if os.path.exists(self.checkpoint_path()) else None
            names = [n for n in (f"checkpoint-{step}-world{self.world_size}", f"checkpoint-{step}") if n != read]
        directory = os.path.join(self.config.output_dir, names[0])
        # Storage kind memory has no disk tables: every row goes to the directory.
        pending = self.collection.begin_checkpoint(label=step)
        if pending is not None:
            pending.defer_commit()  # committed once the rank's own record names it (`commit` below)
        with disk_tables_left_out():  # copied now, written in the background
            state = checkpoints.local_copy({"model": self.model.state_dict(),
                                            "optim": self._optimizer_state_without_disk_tables(),
                                            "step": step, "world_size": self.world_size})
        if self.replicas is not None:  # the step before pushed every gradient they owed (the loop's doing)
            state["replicas"] = self.replicas.state_dict()
        rank, world, main = self.rank, self.world_size, self.is_main
        tables, generation, batches = self.table_manifest(), self.generation, self.batches_at(step)

        def commit() -> None:
            import shutil

            # Files, not collectives: this runs beside training, which uses the process group.
            os.makedirs(directory, exist_ok=True)
            record = os.path.join(directory, f"cut-rank{rank}.json")
            try:  # a failure of the cut or of the file is recorded for rank 0
                cut = self._write_over_steps(pending, state, None, os.path.join(directory, f"rank{rank}.pt"))
            except BaseException as e:  # rank 0 must not wait for it
                write_json_record(record, {"error": f"{type(e).__name__}: {e}"})
                raise
            write_json_record(record, {"cut": cut})
            if not main:
                # The stores let the previous cut go only once the pointer names this one: a job
                # killed before (rank 0 or another rank) resumes from the previous cut.
                if self._wait_for_pointer(directory) and pending is not None:
                    pending.commit()
                return
            records = [os.path.join(directory, f"cut-rank{r}.json") for r in range(world)]
            while not all(os.path.exists(r) for r in records):
                time.sleep(0.01)
            written = [read_json_record(path, f"rank {r}'s cut") for r, path in enumerate(records)]
            failed = [f"rank {r}: {w['error']}" for r, w in enumerate(written) if "error" in w]
            if failed:
                write_json_record(os.path.join(directory, _NOT_COMMITTED), {"failed": failed})
                raise OSError(f"checkpoint {directory} is not committed: {'; '.join(failed)}")
            cuts = {str(r): w["cut"] for r, w in enumerate(written)}
            previous = self._latest_sharded()[0] if os.path.exists(self.checkpoint_path()) else None
            write_json_record(self.checkpoint_path(), {"directory": os.path.basename(directory), "cuts": cuts,
                                                       checkpoints.TABLES_KEY: tables,
                                                       checkpoints.GENERATION_KEY: generation,
                                                       checkpoints.BATCHES_KEY: batches})
            if pending is not None:
                pending.commit()
            if previous and previous != directory:
                shutil.rmtree(previous, ignore_errors=True)
        return commit

    def table_manifest(self) -> Dict[str, Dict[str, Any]]:
        """What a checkpoint records of each table, whatever the world (`checkpoints.TABLES_KEY`): its
        rows, columns, weight type and optimizer, and where the plan put it (placement "disk", or
        "memory" with TorchRec's sharding type: "data_parallel" tables are trained by the dense
        optimizer; under torchrun its shards, `reshard.shard_layout`)."""
        plan = getattr(self.collection, "module_sharding_plan", None)  # None in one process: every table on disk
        disk = set(self.collection.disk_table_names) if plan is not None else {t.name for t in self.table_configs}
        return {t.name: {"rows": t.num_embeddings, "dim": t.embedding_dim, "dtype": "float32",
                         "optimizer": self.config.train.optimizer,
                         "placement": "disk" if t.name in disk else "memory",
                         "sharding": plan[t.name].sharding_type if plan is not None else None,
                         "shards": reshard.shard_layout(plan[t.name]) if plan is not None else None}
                for t in self.table_configs}

    def _wait_for_pointer(self, directory: str) -> bool:
        """Waits until rank 0 has named `directory` in the pointer (True) or given it up (False)."""
        while True:
            if os.path.exists(os.path.join(directory, _NOT_COMMITTED)):
                return False
            try:
                with open(self.checkpoint_path()) as f:
                    if json.load(f).get("directory") == os.path.basename(directory):
                        return True
            except (OSError, ValueError, AttributeError):
                pass  # no pointer yet
            time.sleep(0.01)

    def _load_resharded(self, source: reshard.TableSource) -> int:
        """`load` of a checkpoint of another world or of an export (`reshard.load_resharded`); under
        torchrun, the stored shards a rank cannot see come over the process group first."""
        from ..torchrec.kernel import rank_storage_dir
        from .shards_over_ranks import receive_unseen_shards, rows_held

        began = time.perf_counter()
        received, keeps_tables, receiving = 0, self.is_main, 0.0
        received_dir = os.path.join(rank_storage_dir(self.tables_path, self.rank), "received")
        try:
            if self.distributed and isinstance(source, WrittenCheckpoint):
                on_ranks = receive_unseen_shards(source, rows_held(self.table_manifest(), self.rank), received_dir,
                                                 list(self.collection.local_disk_shards()))
                source, keeps_tables = on_ranks.checkpoint, on_ranks.keeps_tables
                step = reshard.load_resharded(self, source)  # while this rank's sends go on
                received, receiving = on_ranks.finish()
            else:
                step = reshard.load_resharded(self, source)
        finally:
            shutil.rmtree(received_dir, ignore_errors=True)
        filled = time.perf_counter()
        self.save(step)
        self.finish_save()
        if self.distributed:
            dist.barrier(group=runner_group())  # every rank has let go of the old tables
        if isinstance(source, WrittenCheckpoint):
            if self.is_main:
                _remove_read_checkpoint(self.config, self.distributed)
            if keeps_tables:  # one rank on each disk that holds them
                _remove_tables_but(self.config, self.generation)
        if self.is_main:
            readers = "one process" if not self.distributed else f"{self.world_size} ranks"
            took = (f"in {time.perf_counter() - began:.2f} s ({filled - began:.2f} s filling this rank's tables, the "
                    f"rest checkpointing them)")
            moved = (f"; {received:,} rows came over the process group from other nodes' disks in the first "
                     f"{receiving:.2f} s") if received else ""
            if isinstance(source, WrittenCheckpoint):
                writers = "one process" if source.one_process else f"{source.processes} ranks"
                how = f"for {readers}" if writers != readers else "for this run's plan (its storage settings differ)"
                print(f"[train] --resume: the checkpoint at step {step} was written by {writers}; its tables were "
                      f"resharded {how} {took}{moved}", file=sys.stderr, flush=True)
            else:
                print(f"[train] --import: step {step}'s tables from {source.path} were filled for {readers} {took}",
                      file=sys.stderr, flush=True)
        return step

    def dense_parameter_names(self) -> List[str]:
        """The model's parameters outside the embedding tables, in the order the one-process dense
        optimizer holds them."""
        return [name for name, _ in self.model.named_parameters() if "embedding_bag" not in name]

    def _optimizer_state_without_disk_tables(self) -> Dict[str, Any]:
        """The optimizers' state_dict without the disk tables' entries (their state is in the cuts;
        what would stand for them differs from rank to rank, which torch.distributed.checkpoint
        cannot match up on load)."""
        state = self.optimizer.state_dict()
        on_disk = tuple(f"embedding_bags.{t}.weight" for t in self.collection.disk_table_names)
        state["state"] = {k: v for k, v in state["state"].items() if not (on_disk and k.endswith(on_disk))}
        return state

    def _latest_sharded(self) -> Tuple[str, Dict[int, Any]]:
        """The directory the latest checkpoint under torchrun wrote, and each rank's cut of its tables."""
        directory, _, cuts, _ = read_pointer(self.checkpoint_path())
        return os.path.join(self.config.output_dir, directory), {r: cut for r, cut in cuts.items() if cut is not None}

    def load(self) -> int:
        """Loads the checkpoint `resume` found, or the export `imported` names; returns its step. A
        checkpoint of another world, or an export, is resharded into this run's plan and
        checkpointed at once for this world (then the checkpoint read is removed)."""
        loaded = self.resharding if self.resharding is not None else self._written
        if loaded is not None:
            self._batches_origin = (loaded.step, loaded.batches)
        if self.resharding is not None:
            return self._load_resharded(self.resharding)
        if self.is_main and self.generation:
            _remove_read_checkpoint(self.config, self.distributed)
            _remove_tables_but(self.config, self.generation)
        if self.distributed:
            from ..torchrec import disk_tables_left_out

            saved = checkpoints.load_checkpoint(os.path.join(self._latest_sharded()[0], f"rank{self.rank}.pt"))
            # Replicas continue from the checkpoint's; a run that had none starts them afresh.
            replica_state = saved.pop("replicas", None)
            if self.replicas is not None and replica_state is not None:
                self.replicas.load_state_dict(replica_state)
            if saved["world_size"] != self.world_size:  # the pointer names as many cuts as there were ranks
                raise ConfigError(f"{self.checkpoint_path()} names {self.world_size} ranks' cuts, and rank "
                                  f"{self.rank}'s file was written by {saved['world_size']}: the checkpoint is "
                                  f"damaged")
            with disk_tables_left_out():  # the disk tables reopened at the checkpoint's cuts
                try:
                    state = checkpoints.restored({"model": self.model.state_dict(),
                                       "optim": self._optimizer_state_without_disk_tables(), "step": 0,
                                       "world_size": self.world_size}, saved)
                except ConfigError as e:
                    raise ConfigError(f"{e} (a rank's state belongs to its place in the sharding plan, which the "
                                      f"storage settings decide: resume with the ones the run was started with)") from e
                self.model.load_state_dict(state["model"])
                optimizer = self.optimizer.state_dict()  # the disk tables' entries: their steps, as reopened
                optimizer["state"].update(state["optim"]["state"])
                if "param_groups" in state["optim"]:
                    optimizer["param_groups"] = state["optim"]["param_groups"]
                self.optimizer.load_state_dict(optimizer)
            return int(state["step"])
        state = self._resumed  # the tables were opened at its cut
        missing, unexpected = self.model.load_state_dict(state["dense"], strict=False)
        missing = [k for k in missing if not k.startswith(self._tables_prefix())]
        if missing or unexpected:
            raise ConfigError(f"{self.checkpoint_path()} does not fit this model: missing {missing}, "
                              f"unexpected {unexpected}")
        self.optimizer.load_state_dict(state["dense_optimizer"])
        return int(state["step"])


def _joined(parts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0)


def _remove_read_checkpoint(config: ExperimentConfig, distributed: bool) -> None:
    """Once a reshard's checkpoint is committed: the other kind's checkpoint file (and the directory
    of the checkpoint it read)."""
    if distributed:
        leftovers = [os.path.join(config.output_dir, checkpoints.ONE_PROCESS_CHECKPOINT)]
    else:
        pointer = os.path.join(config.output_dir, checkpoints.SHARDED_CHECKPOINT_POINTER)
        leftovers = [pointer] if os.path.exists(pointer) else []
        if leftovers:
            shutil.rmtree(os.path.join(config.output_dir, read_pointer(pointer)[0]), ignore_errors=True)
    for path in leftovers:
        if os.path.exists(path):
            os.remove(path)


def _remove_tables_but(config: ExperimentConfig, generation: str) -> None:
    """Once a reshard's checkpoint (its tables in `generation`) is committed: any other tables under
    the tables path (the checkpoint's it read, and what a kill before this left)."""
    from ..table_files import remove_tables

    remove_tables(config.tables_path)
    for name in os.listdir(config.tables_path):
        if name != generation and reshard.GENERATION.fullmatch(name):
            shutil.rmtree(os.path.join(config.tables_path, name), ignore_errors=True)


def torch_threads(config: ExperimentConfig) -> int:
    """torch's intra-op threads for a run: `train.torch_threads`, or with "auto" torch's default less
    one when disk tables look ahead, so the read-ahead thread has a core
    (docs/benchmarks.md has the measurement)."""
    if config.train.torch_threads != "auto":
        return config.train.torch_threads
    threads = torch.get_num_threads()
    return max(1, threads - 1) if config.looks_ahead else threads


def _kernels(storage: StorageConfig, device: torch.device) -> Optional[List[str]]:
    """The compute kernels the planner may choose for a table (None: any): storage kind memory keeps
    every table in memory (TorchRec's kernels but the disk one), `in_memory_tables` false puts every
    one on disk. ConfigError where TorchRec's in-memory kernels cannot run on `device`."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    from ..torchrec.kernel import DISK_KERNEL

    if storage.kind != "memory" and not storage.in_memory_tables:
        return [DISK_KERNEL]
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::bounds_check_indices",
                                                                                    "CUDA"):
        raise ConfigError("device cuda under torchrun: fbgemm-gpu here is its CPU build, so TorchRec's in-memory "
                          "kernels cannot run on the GPU: set storage.in_memory_tables=false (every table on disk), "
                          "or install fbgemm-gpu's CUDA build")
    if storage.kind == "memory":
        return [kernel.value for kernel in EmbeddingComputeKernel if kernel.value != DISK_KERNEL]
    return None


def _check_in_memory_sharding(sharding_types: List[str]) -> None:
    """ConfigError when storage kind memory is given only sharding types TorchRec's in-memory
    kernels do not take on the CPU (row-wise ones need a GPU there)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    offered = EmbeddingBagCollectionSharder().sharding_types("cpu")
    if not set(sharding_types) & set(offered):
        raise ConfigError(f"storage.sharding_types {list(sharding_types)}: storage kind memory keeps tables in "
                          f"TorchRec's kernels, which shard them on the CPU only as {offered}")


def _comms_codecs(comms: CommsConfig) -> Optional[Dict[str, Any]]:
    """TorchRec's quantized-comms codecs for `storage.comms` (None: full precision both ways)."""
    if comms.forward == comms.backward == "fp32":
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType[comms.forward.upper()],
                                                  backward_precision=CommType[comms.backward.upper()]))
