"""The experiment schema: YAML files and ``dotted.key=value`` overrides, read through pydantic.

Every section forbids unknown keys; a wrong key, a wrong type or a missing data path raises
ConfigError with the dotted name of the key at fault.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["ConfigError", "ExperimentConfig", "load_config"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key or path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    """DLRM's architecture."""

    embedding_dim: int = Field(16, gt=0)
    dense_arch: List[int] = [64, 16]  # the last layer is embedding_dim
    over_arch: List[int] = [64, 1]  # the last layer is 1


class SyntheticDataConfig(_Section):
    """The synthetic generator (mlkv_torch.data.SyntheticCTR)."""

    cardinalities: Union[Literal["criteo_kaggle"], List[int]] = "criteo_kaggle"
    scale: int = Field(1, gt=0, description="divide every cardinality by this (at least 2 rows)")
    num_dense: int = Field(13, ge=0)
    zipf: float = Field(1.05, gt=1.0)
    effect_scale: float = Field(1.0, ge=0)  # range of the hidden per-id effects: how much the ids decide
    seed: int = 0
    # Raw ids spread over [0, id_space) (a power of two, e.g. 2**40, written 1099511627776), each
    # table that many rows; the cardinalities are then the live vocabularies, into which
    # new_ids_per_batch new ids enter a batch (mlkv_torch.data.synthetic).
    id_space: Optional[int] = Field(None, gt=1)
    new_ids_per_batch: float = Field(0.0, ge=0)
    # Raw ids hashed into this many rows a table (collisions and all), as fixed-size tables do.
    hash_rows: Optional[int] = Field(None, gt=0)


class CriteoDataConfig(_Section):
    """Criteo click logs: `tsv` files (converted once into `cache_dir`) or torchrec's `npy` day
    prefixes (``<prefix>_dense.npy``, ``_sparse.npy``, ``_labels.npy``).

    `days` splits each TSV file into that many consecutive parts (Criteo Kaggle's one
    ``train.txt``, as DLRM's preprocessing does); with no `eval` files, the last part of the
    last file is held out for evaluation. `shuffle_window` (batches) shuffles the training rows
    within windows of that many batches, and the windows' order, anew each epoch from `seed`.
    """

    format: Literal["tsv", "npy"] = "tsv"
    train: List[str] = []
    eval: List[str] = []
    days: Optional[int] = Field(None, ge=2)
    # "raw": no hashing, each categorical value its own id (a table of 2**32 rows per feature)
    cardinalities: Union[Literal["criteo_kaggle", "raw"], List[int]] = "criteo_kaggle"
    scale: int = Field(1, gt=0)
    cache_dir: Optional[str] = None  # default: $MLKV_CACHE_DIR/criteo, or ~/.cache/mlkv_torch/criteo
    shuffle_window: int = Field(0, ge=0)
    seed: int = Field(0, ge=0)


class ParquetFeatureConfig(_Section):
    """A sparse feature of a Parquet dataset: its column (int ids, lists of int ids, or strings,
    hashed), the table it looks up (default: its column's name; features naming one table share
    it) and that table's rows (ids are taken modulo them)."""

    column: str
    table: Optional[str] = None
    rows: int = Field(gt=0)


class ParquetTransformConfig(_Section):
    """A user's transform of each row group (mlkv_torch.data.transforms): `function`, its import
    path ("package.module:function", importable wherever batches are made), the file columns it
    `reads` besides the declared ones, and the keyword `args` it is called with."""

    function: str
    reads: List[str] = []
    args: Dict[str, Any] = {}


class ParquetDataConfig(_Section):
    """A user's Parquet dataset (mlkv_torch.data.parquet): `train` and `eval` files, directories of
    them or glob patterns, and the schema the model reads (only these columns are read)."""

    train: List[str] = []
    eval: List[str] = []
    label: str = "label"
    dense: List[str] = []
    sparse: List[ParquetFeatureConfig] = []
    transform: Optional[ParquetTransformConfig] = None
    shuffle_window: int = Field(0, ge=0)
    seed: int = Field(0, ge=0)


class RayDataConfig(_Section):
    """Where `data.engine: ray` prepares batches: `address`, the Ray head's host:port (empty: a
    local Ray started for the run), `actors`, the batch makers each rank keeps there ("auto": the
    cluster's CPUs shared among the ranks), `start_timeout_s`, how long they may take to start
    (a cluster without the CPUs for them fails the run then), and `batch_timeout_s`, how long a
    batch may take before it is asked for again (of the next batch maker; a few times, then the run
    fails naming it)."""

    address: str = ""
    actors: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    start_timeout_s: float = Field(300.0, gt=0)
    batch_timeout_s: float = Field(120.0, gt=0)


class DataConfig(_Section):
    """The data and its loader: `workers` threads make batches, `prefetch` batches wait ready;
    "auto" (the default) picks and re-picks them from measured times within a CPU budget (the
    cores torch's threads and the disk tables' read-ahead thread leave) and `memory_budget_bytes`
    for the batches in flight."""

    kind: Literal["synthetic", "criteo", "parquet"] = "synthetic"
    synthetic: SyntheticDataConfig = SyntheticDataConfig()
    criteo: CriteoDataConfig = CriteoDataConfig()
    parquet: ParquetDataConfig = ParquetDataConfig()
    workers: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    prefetch: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    memory_budget_bytes: int = Field(256 << 20, gt=0)
    # Where batches are made: this process's threads ("local") or Ray actors (Parquet data only).
    engine: Literal["local", "ray"] = "local"
    ray: RayDataConfig = RayDataConfig()


class ReplicasConfig(_Section):
    """Replicas of the sharded tables' hottest rows on every rank, under torchrun (HET; see
    mlkv_torch.torchrec.replicas): `fraction` of their rows (0: none), the most looked up of any
    table, served at most
    `pull_bound` of the owner's updates stale, their gradients pushed at most `push_bound` steps
    late; chosen after `warmup_steps` steps and again every `refresh_every` steps."""

    fraction: float = Field(0.0, ge=0, lt=1)
    pull_bound: int = Field(0, ge=0)
    push_bound: int = Field(0, ge=0)
    refresh_every: int = Field(25, gt=0)
    warmup_steps: int = Field(10, gt=0)


class CommsConfig(_Section):
    """Under torchrun: the precision of the embeddings' all-to-alls and reduce-scatters (TorchRec's
    quantized comms), `forward` for the pooled embeddings, `backward` for their gradients; ids stay
    integers."""

    forward: Literal["fp32", "fp16", "bf16"] = "fp32"
    backward: Literal["fp32", "fp16", "bf16"] = "fp32"


class VirtualTablesConfig(_Section):
    """Every table as TorchRec's virtual table (``use_virtual_table``; mlkv_torch.virtual_tables): an
    id gets its own row once trained (after `admit_after` batches that look it up: the frequency
    filter), and ids go by `eviction` once a table holds more than `trigger_ids` on a rank (then at
    most `keep_fraction` of that stay): "count" (looked up in fewer than `count_threshold` batches,
    counts decayed by `decay_rate` at each round), "timestamp" (not looked up for `ttl_minutes`;
    `minute_steps` training steps make a minute, else wall minutes), "count_and_timestamp" (both),
    "none". Under torchrun, row-wise tables shard by `total_num_buckets` (a multiple of the ranks)."""

    enabled: bool = False
    eviction: Literal["none", "count", "timestamp", "count_and_timestamp"] = "none"
    trigger_ids: int = Field(0, ge=0)
    count_threshold: int = Field(15, ge=0)
    decay_rate: float = Field(0.99, gt=0, le=1)
    ttl_minutes: int = Field(1440, ge=0)
    minute_steps: Optional[int] = Field(None, ge=1)
    admit_after: int = Field(1, ge=1)
    keep_fraction: float = Field(0.9, gt=0, le=1)
    total_num_buckets: Optional[int] = Field(None, ge=1)


class StorageConfig(_Section):
    """Where the embedding tables live: `memory` (torchrec's EmbeddingBagCollection), `disk`
    (mlkv's log-structured store) or `rocksdb` (the same cache and op over RocksDB: the
    offloading baseline).

    `memory_budget_bytes` is for the whole collection in one process, and per rank under
    torchrun, where the planner keeps in memory the tables that fit it and puts the rest on disk.
    """

    kind: Literal["memory", "disk", "rocksdb"] = "disk"
    path: Optional[str] = None  # default: <output_dir>/tables
    memory_budget_bytes: int = Field(64 << 20, gt=0)
    cache_rows: Optional[int] = Field(None, ge=0)
    staleness: int = Field(0, ge=0)
    cache_policy: Literal["lfu", "lru"] = "lfu"
    # Under torchrun: a disk table's memory, of its bytes; auto: the planner spends the job's budget
    # (memory_budget_bytes a rank) by each table's reads predicted from the input's first batches.
    memory_fraction: Union[Literal["auto"], Annotated[float, Field(gt=0, le=1)]] = 0.1
    # Write every row to the store before training, so reads come from disk as in a table trained
    # for a while, not from the generator of fresh rows (benchmarks).
    populate: bool = False
    replicas: ReplicasConfig = ReplicasConfig()
    # Under torchrun: the shardings the planner may choose for a table. Row-wise ones spread a disk
    # table's reads over every rank's disk.
    sharding_types: List[Literal["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise",
                                 "data_parallel"]] = Field(
        default_factory=lambda: ["table_wise", "column_wise", "table_column_wise", "data_parallel"], min_length=1)
    comms: CommsConfig = CommsConfig()
    virtual_tables: VirtualTablesConfig = VirtualTablesConfig()
    # Under torchrun (storage kind disk or rocksdb): whether the planner may keep the tables that fit
    # the budget in memory, in TorchRec's own kernels (on GPUs those need fbgemm-gpu's CUDA build);
    # false puts every table on disk.
    in_memory_tables: bool = True


class PipelineConfig(_Section):
    depth: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"


class TrainConfig(_Section):
    batch_size: int = Field(1024, gt=0)
    steps: int = Field(100, gt=0)
    optimizer: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: float = Field(0.05, gt=0)
    dense_lr: Optional[float] = Field(None, gt=0)  # default: lr
    log_every: int = Field(10, gt=0)
    checkpoint_every: Optional[int] = Field(None, gt=0)
    seed: int = 0
    # torch's intra-op threads: "auto" leaves one core of torch's default to the disk tables' I/O
    # threads when they look ahead (on few cores, sharing them costs more than the core gives)
    torch_threads: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    tensorboard: bool = False  # also write the metrics as TensorBoard scalars under output_dir/tensorboard


class EvalConfig(_Section):
    every: int = Field(50, gt=0)
    batches: int = Field(8, gt=0)


class ExperimentConfig(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    storage: StorageConfig = StorageConfig()
    pipeline: PipelineConfig = PipelineConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    output_dir: str
    # Where the dense model, the tables' hot caches, pooling and batches live. CUDA: disk or rocksdb
    # tables (storage kind memory is TorchRec's fused kernels, which need fbgemm-gpu's CUDA build);
    # under torchrun each rank on the GPU of its LOCAL_RANK, over NCCL.
    device: Literal["cpu", "cuda"] = "cpu"

    @property
    def tables_path(self) -> str:
        """Where the run's disk tables are: storage.path, else output_dir/tables."""
        return self.storage.path or os.path.join(self.output_dir, "tables")

    @property
    def looks_ahead(self) -> bool:
        """Whether the run's disk tables read ahead (each kernel on a thread of its own)."""
        return self.storage.kind != "memory" and self.pipeline.depth != 0

    @model_validator(mode="after")
    def _consistent(self) -> "ExperimentConfig":
        if not self.model.dense_arch or self.model.dense_arch[-1] != self.model.embedding_dim:
            raise ValueError(f"model.dense_arch must end with model.embedding_dim ({self.model.embedding_dim}), "
                             f"got {self.model.dense_arch}")
        if not self.model.over_arch or self.model.over_arch[-1] != 1:
            raise ValueError(f"model.over_arch must end with 1, got {self.model.over_arch}")
        if self.data.kind == "criteo" and not self.data.criteo.train:
            raise ValueError("data.criteo.train must list the training files")
        if self.data.engine == "ray" and self.data.kind != "parquet":
            raise ValueError(f"data.engine ray prepares Parquet datasets (data.kind parquet), not {self.data.kind}; "
                             f"Criteo days become Parquet with `criteo convert --format parquet`")
        if self.data.kind == "parquet":
            from .data.parquet import schema_features
            if not self.data.parquet.train:
                raise ValueError("data.parquet.train must list the training files")
            if not self.data.parquet.sparse:
                raise ValueError("data.parquet.sparse must declare at least one sparse feature")
            schema_features(self.data.parquet.sparse)  # tables' rows agree
        if self.device == "cuda" and self.storage.kind == "memory":
            raise ValueError("device cuda trains disk or rocksdb tables (storage.kind); storage kind memory runs "
                             "TorchRec's fused kernels, which need fbgemm-gpu's CUDA build")
        if self.data.kind == "synthetic":
            from .data.synthetic import raw_ids_problem
            synthetic = self.data.synthetic
            problem = raw_ids_problem(synthetic.id_space, synthetic.new_ids_per_batch,
                                      cardinalities_of(synthetic.cardinalities, synthetic.scale))
            if problem:
                raise ValueError(f"data.synthetic: {problem}")
            hash_rows, id_space = synthetic.hash_rows, synthetic.id_space
            if hash_rows is not None and (id_space is None or hash_rows > id_space):
                raise ValueError("data.synthetic.hash_rows hashes raw ids: it needs id_space, and at most that many")
        virtual = self.storage.virtual_tables
        if virtual.enabled and (virtual.eviction == "none") != (virtual.trigger_ids == 0):
            raise ValueError("storage.virtual_tables: an eviction policy needs trigger_ids (rounds run once a table "
                             "holds more ids on a rank), and trigger_ids needs an eviction policy")
        if self.storage.kind == "memory" and not self.storage.in_memory_tables:
            raise ValueError("storage.in_memory_tables false puts every table on disk, and storage.kind memory every "
                             "table in memory: choose one")
        if self.storage.virtual_tables.enabled and self.storage.kind == "memory":
            raise ValueError("storage.virtual_tables: virtual tables live on disk (storage.kind disk or rocksdb); "
                             "TorchRec's own need fbgemm-gpu's CUDA SSD kernels")
        if self.data.criteo.days is not None and self.data.criteo.format != "tsv":
            raise ValueError("data.criteo.days splits TSV files: it needs data.criteo.format tsv")
        return self


def _apply_override(tree: Dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {'.'.join(keys[:depth + 1])} is not a section")
        node = child
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None


def load_config(path: Union[str, os.PathLike], overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Reads a YAML experiment, applies ``dotted.key=value`` overrides (values parsed as YAML)
    and validates it; raises ConfigError naming the key at fault."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist")
    with open(path) as f:
        try:
            tree = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{os.fspath(path)}: not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"{os.fspath(path)}: the top level must be a mapping of sections")
    for override in overrides:
        _apply_override(tree, override)
    try:
        config = ExperimentConfig.model_validate(tree)
    except ValidationError as e:
        # One line a key: pydantic's names of a union's members (`literal['auto']`, `constrained-int`)
        # are left out of the key, their problems joined; a key an override set names the override.
        problems: Dict[str, List[str]] = {}
        for error in e.errors():
            parts = [str(part) for part in error["loc"] if isinstance(part, int) or str(part).isidentifier()]
            problem = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            found = problems.setdefault(".".join(parts) or "config", [])
            if problem not in found:
                found.append(problem)
        set_by = {override.split("=", 1)[0].strip(): override for override in overrides}
        lines = []
        for where, found in problems.items():
            source = next((o for key, o in set_by.items() if where == key or where.startswith(key + ".")), None)
            lines.append(f"{f'override {source!r}' if source else os.fspath(path)}: {where}: {' or '.join(found)}")
        raise ConfigError("; ".join(lines)) from None
    if config.data.kind == "criteo":
        criteo = config.data.criteo
        suffixes = [".tsv"] if criteo.format == "tsv" else ["_dense.npy", "_sparse.npy", "_labels.npy"]
        for split in ("train", "eval"):
            for i, entry in enumerate(getattr(criteo, split)):
                for suffix in suffixes:
                    file = entry if criteo.format == "tsv" else entry + suffix
                    if not os.path.isfile(file):
                        raise ConfigError(f"data.criteo.{split}[{i}]: file {file!r} does not exist")
    return config


def cardinalities_of(cardinalities: Union[str, Sequence[int]], scale: int) -> Tuple[int, ...]:
    """Rows per table: Criteo Kaggle's ("criteo_kaggle") or the list given, divided by `scale`
    (at least 2 rows each)."""
    from .data import CRITEO_KAGGLE_CARDINALITIES

    base = CRITEO_KAGGLE_CARDINALITIES if cardinalities == "criteo_kaggle" else tuple(cardinalities)
    return tuple(max(2, int(n) // scale) for n in base)
