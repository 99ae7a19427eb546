"""The runner's data: an experiment's batches by number (synthetic, Criteo or Parquet) and its loader's tuner.

Every source is a BatchSource: ``make_batch(number)`` for training (step s trains batch
s * world_size + rank on each rank; a Parquet dataset's rows are shared out among the ranks,
ShuffledRows), ``eval(batches, rank, world)`` for held-out batches, with the planted model's click
probabilities where the data has them, and ``tables``: (name, rows, feature names) of each table
the model needs (one a feature, but for Parquet features that share one).
"""
from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from typing import Any, Iterator, List, Optional, Tuple

import torch

from ..config import ConfigError, ExperimentConfig, cardinalities_of
from ..data.row_order import ShuffledRows
from ..data.tuning import InputTuner

__all__ = ["BatchSource", "CriteoSource", "ParquetSource", "SyntheticSource", "batch_source", "criteo_cache_dir",
           "input_cpu_budget", "loader_tuner"]

_EVAL_FIRST_BATCH = 1 << 40  # evaluation batches come from a range training never reaches


def input_cpu_budget(config: ExperimentConfig, torch_threads: int) -> int:
    """The cores that torch's `torch_threads` and the disk tables' prefetch thread leave (at least
    one) of this process's share of the cores it may run on (under torchrun, the processes of a
    node share them): what making batches may take here."""
    cores = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, cores - torch_threads - int(config.looks_ahead))


def loader_tuner(config: ExperimentConfig, torch_threads: int, remote_workers: Optional[int] = None) -> InputTuner:
    """The loader's InputTuner: data.workers and data.prefetch, within `input_cpu_budget` threads
    (with Ray, `remote_workers`: a thread waits on each actor) and data.memory_budget_bytes."""
    cpu_budget = remote_workers or input_cpu_budget(config, torch_threads)
    return InputTuner(config.data.workers, config.data.prefetch, cpu_budget=cpu_budget,
                      memory_budget_bytes=config.data.memory_budget_bytes)


class BatchSource(ABC):
    """What the runner asks of its data (see the module's docstring).

    Attributes:
        tables: (name, rows, feature names) of each table the model needs.
        num_dense: dense features a sample.
        batch_size: samples a batch.
        row_order: the rows' order where the ranks share a dataset's rows out (a ShuffledRows,
            which says what each rank reads); None where a batch is drawn from its number alone.
        remote_workers: the Ray actors making training batches, a loader thread waiting on each;
            None where batches are made in this process.
    """

    tables: List[Tuple[str, int, List[str]]]
    num_dense: int
    batch_size: int
    row_order: Optional[ShuffledRows] = None
    remote_workers: Optional[int] = None

    @abstractmethod
    def make_batch(self, number: int) -> Any:
        """Training batch `number` (a torchrec Batch)."""

    @abstractmethod
    def eval(self, batches: int, rank: int, world: int, at_batch: int = 0
             ) -> Iterator[Tuple[Any, Optional[torch.Tensor]]]:
        """This rank's share of `batches` held-out batches, each with its true click probabilities
        where the data has them (else None); `at_batch`: the training batch the run has reached."""

    @abstractmethod
    def live_ids(self, batches: int) -> Optional[Tuple[int, ...]]:
        """The ids each table is expected to hold after `batches` batches; None: the tables' rows."""

    def close(self) -> None:
        """Ends what the source started for training (Ray's actors); evaluation still reads here."""


class _TablePerFeature:
    """Sources whose every sparse feature has a table of its own, of `cardinalities` rows."""

    feature_names: list
    cardinalities: tuple

    @property
    def tables(self) -> List[Tuple[str, int, List[str]]]:
        return [(name, rows, [name]) for name, rows in zip(self.feature_names, self.cardinalities)]


class _FileBatches(BatchSource):
    """Sources of files read batch by number: `train_batches` and `eval_batches` (or None)."""

    train_batches: Any
    eval_batches: Any

    def make_batch(self, number: int) -> Any:
        """Training batch `number` (epochs repeat, each with its own shuffle)."""
        return self.train_batches(number)

    def eval(self, batches: int, rank: int, world: int, at_batch: int = 0
             ) -> Iterator[Tuple[Any, Optional[torch.Tensor]]]:
        """At most `batches` held-out batches for this rank (one pass over the evaluation files, as
        many on every rank: under DMP each batch is a collective), without probabilities."""
        if self.eval_batches is None:
            return
        for k in range(min(batches, self.eval_batches.batches_per_epoch // world)):
            yield self.eval_batches(rank + world * k), None


class SyntheticSource(_TablePerFeature, BatchSource):
    """Batches of mlkv_torch.data.SyntheticCTR, with the planted model's probabilities for evaluation."""

    def __init__(self, config: ExperimentConfig) -> None:
        from ..data.synthetic import SyntheticCTR

        data = config.data.synthetic
        self.generator = SyntheticCTR(cardinalities=cardinalities_of(data.cardinalities, data.scale),
                                      num_dense=data.num_dense, zipf=data.zipf, effect_scale=data.effect_scale,
                                      seed=data.seed, id_space=data.id_space, new_ids_per_batch=data.new_ids_per_batch,
                                      hash_rows=data.hash_rows)
        # A table per feature, of as many rows as its ids may take (the id space, with raw ids).
        self.feature_names, self.cardinalities = self.generator.feature_names, self.generator.table_sizes
        self._new_ids_per_batch = data.new_ids_per_batch if data.id_space is not None else None
        self._hashed = data.hash_rows is not None
        self.num_dense, self.batch_size = data.num_dense, config.train.batch_size

    def live_ids(self, batches: int) -> Optional[Tuple[int, ...]]:
        """With raw ids, the ids each feature's table holds after `batches` batches at most (its
        vocabulary and the ids that entered it meanwhile); None: the tables' rows."""
        if self._new_ids_per_batch is None or self._hashed:
            return None
        return tuple(min(rows, n + math.ceil(self._new_ids_per_batch * batches))
                     for rows, n in zip(self.cardinalities, self.generator.cardinalities))

    def make_batch(self, number: int) -> Any:
        """Training batch `number`."""
        from ..data.synthetic import synthetic_batch

        return synthetic_batch(self.generator, number, self.batch_size)

    def eval(self, batches: int, rank: int, world: int, at_batch: int = 0
             ) -> Iterator[Tuple[Any, Optional[torch.Tensor]]]:
        """This rank's share of `batches` held-out batches, each with its true click probabilities;
        with new ids entering, drawn from the vocabulary of training batch `at_batch` (where training is)."""
        from ..data.synthetic import synthetic_batch

        vocabulary = at_batch if self._new_ids_per_batch else None
        for k in range(batches):
            number = _EVAL_FIRST_BATCH + rank + world * k
            yield (synthetic_batch(self.generator, number, self.batch_size, vocabulary),
                   self.generator.batch(number, self.batch_size, vocabulary)[3])


def criteo_cache_dir() -> str:
    """Where converted Criteo files are kept when data.criteo.cache_dir is not set: shared by runs
    and experiments, so each input is converted once ($MLKV_CACHE_DIR/criteo, or
    ~/.cache/mlkv_torch/criteo)."""
    root = os.environ.get("MLKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mlkv_torch")
    return os.path.join(root, "criteo")


class CriteoSource(_TablePerFeature, _FileBatches):
    """Criteo days (TSV files, converted once, or torchrec's npy layout), batch by number."""

    def __init__(self, config: ExperimentConfig) -> None:
        from ..data.criteo_convert import convert_file
        from ..data.criteo_batches import RAW_ID_SPACE, CriteoBatches
        from ..data.criteo_tsv import CAT_FEATURES, INT_FEATURES, CriteoFormatError

        criteo = config.data.criteo
        train_days, eval_days = list(criteo.train), list(criteo.eval)
        if criteo.format == "tsv":
            cache = criteo.cache_dir or criteo_cache_dir()
            try:
                # Conversions are reported on stderr; files already converted are used at once. The
                # entries are held while this process reads them (see convert_file).
                train = [convert_file(path, cache, days=criteo.days, progress=True, hold=True) for path in criteo.train]
                evaluation = [convert_file(path, cache, progress=True, hold=True) for path in criteo.eval]
                self._conversions = train + evaluation
                train_days = [p for conversion in train for p in conversion.prefixes]
                eval_days = [p for conversion in evaluation for p in conversion.prefixes]
            except (CriteoFormatError, OSError, RuntimeError) as e:
                raise ConfigError(f"data.criteo: {e}") from e
            if criteo.days and not criteo.eval:
                eval_days = [train_days.pop()]  # the last part is held out, as DLRM's split does
        raw = criteo.cardinalities == "raw"
        self.cardinalities = (RAW_ID_SPACE,) * CAT_FEATURES if raw else cardinalities_of(criteo.cardinalities,
                                                                                           criteo.scale)
        hashes = None if raw else self.cardinalities
        self._raw = raw
        self.num_dense, self.batch_size = INT_FEATURES, config.train.batch_size
        try:
            self.train_batches = CriteoBatches(train_days, self.batch_size, hashes,
                                               shuffle_window=criteo.shuffle_window, seed=criteo.seed)
            self.eval_batches = CriteoBatches(eval_days, self.batch_size, hashes) if eval_days else None
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.criteo: {e}") from e
        self.feature_names = self.train_batches.feature_names

    def live_ids(self, batches: int) -> Optional[Tuple[int, ...]]:
        """With raw ids, the ids each table is expected to hold: the distinct values of Criteo
        Kaggle's features (torchrec's counts), an estimate for other days; None: the tables' rows."""
        from ..data.synthetic import CRITEO_KAGGLE_CARDINALITIES

        return CRITEO_KAGGLE_CARDINALITIES if self._raw else None


class ParquetSource(_FileBatches):
    """A user's Parquet files with a declared schema (mlkv_torch.data.parquet), batch by number,
    each of `world` ranks reading its own share of the rows (`row_order`, a ShuffledRows); with
    data.engine ray, training batches are made by Ray actors (mlkv_torch.data.ray_batches) and
    evaluation batches here. `remote_workers`: the actors (None: made here)."""

    def __init__(self, config: ExperimentConfig, cpu_budget: int = 1, world: int = 1) -> None:
        import functools

        from ..data.parquet import ParquetBatches, schema_features
        from ..data.transforms import RowGroupTransform

        data = config.data.parquet
        features, self.tables = schema_features(data.sparse)
        self.feature_names = [f.column for f in features]
        self.num_dense, self.batch_size = len(data.dense), config.train.batch_size
        transform = data.transform and RowGroupTransform(data.transform.function, tuple(data.transform.reads),
                                                         dict(data.transform.args))
        # Picklable: a Ray actor builds its own.
        batches = functools.partial(ParquetBatches, batch_size=self.batch_size, label=data.label, dense=data.dense,
                                    sparse=features, transform=transform, world=world)
        try:  # opened here in any case: the files' schemas are checked before a worker starts
            self.train_batches = batches(data.train, shuffle_window=data.shuffle_window, seed=data.seed)
            self.eval_batches = batches(data.eval) if data.eval else None
        except (ValueError, TypeError, RuntimeError) as e:  # a file, or the user's transform, refused
            raise ConfigError(f"data.parquet: {e}") from e
        self.row_order = self.train_batches.row_indices
        self._started_ray = False
        if config.data.engine == "ray":
            self._prepare_on_ray(config, functools.partial(batches, data.train, shuffle_window=data.shuffle_window,
                                                           seed=data.seed), world, cpu_budget)

    def _prepare_on_ray(self, config: ExperimentConfig, make: Any, world: int, cpu_budget: int) -> None:
        import functools

        from ..data.parquet import parquet_batch

        try:
            from ..data.ray_batches import RayBatches, connect_ray
            import ray  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"data.engine ray needs Ray: pip install '.[ray]' ({e})") from e

        data, settings = config.data.parquet, config.data.ray
        try:  # a local Ray gets the cores the loader would have, or as many as the actors asked for
            local_cpus = settings.actors if settings.actors != "auto" else cpu_budget
            self._started_ray = connect_ray(settings.address, local_cpus)
        except (ConnectionError, ValueError) as e:
            raise ConfigError(f"data.ray.address: {e}") from e
        import ray

        actors = settings.actors
        if actors == "auto":  # a local Ray is this rank's alone; a cluster's CPUs are shared by the ranks
            cpus = int(ray.cluster_resources().get("CPU", 1))
            actors = max(1, cpus if self._started_ray else cpus // world)
        local = self.train_batches
        # Unshuffled, consecutive batches share row groups: an actor makes a row group's run of them.
        chunk = 1 if data.shuffle_window else max(1, local.rows // local.row_groups // self.batch_size)
        try:
            self.train_batches = RayBatches(make, functools.partial(parquet_batch, self.feature_names), actors,
                                            stride=world, chunk=chunk,
                                            start_timeout_s=settings.start_timeout_s,
                                            batch_timeout_s=settings.batch_timeout_s)
        except RuntimeError as e:
            if self._started_ray:  # a failed source leaves no local Ray behind for the next run to join
                ray.shutdown()
            raise ConfigError(f"data.ray: {e}") from e
        self.remote_workers = actors

    def close(self) -> None:
        """Ends the Ray actors (and a local Ray this source started)."""
        if self.remote_workers is None:
            return
        self.train_batches.close()
        if self._started_ray:
            import ray

            ray.shutdown()
        self.remote_workers = None

    def live_ids(self, batches: int) -> None:
        """The tables' rows: ids are hashed into them."""
        return None


def batch_source(config: ExperimentConfig, cpu_budget: int = 1, world: int = 1) -> BatchSource:
    """The source of data.kind for a run of `world` ranks (`cpu_budget`: the cores a local Ray may
    take, `input_cpu_budget`)."""
    if config.data.kind == "parquet":
        return ParquetSource(config, cpu_budget, world)
    if config.data.kind == "criteo":
        return CriteoSource(config)
    return SyntheticSource(config)
