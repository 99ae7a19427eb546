"""What DiskEmbeddingBagCollection and the sharded disk kernel share: how a TorchRec table
becomes a disk table (seed, pooling, dtype, memory budget), how features reach the
table-batched kernels (KernelRouting), and how TorchRec's fused optimizer parameters map to
mlkv_torch.optim."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import warnings
import zlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec.optim.fused import FusedOptimizer

from .. import optim as optim_lib
from ..table_batch import DiskTableBatch

POOLING_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
DATA_TYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
MIN_TABLE_BUDGET = 64 << 10  # a table's share never drops below the store's few pages


_disk_tables_in_state_dict: contextvars.ContextVar[bool] = contextvars.ContextVar("disk_tables_in_state_dict",
                                                                                 default=True)


@contextlib.contextmanager
def disk_tables_left_out() -> Iterator[None]:
    """Within it, ``state_dict()`` of a sharded model and of its optimizer leaves the disk tables'
    rows and optimizer state out (only their step counts stay), and ``load_state_dict()`` does
    not miss them: a training checkpoint that holds them in cuts of their own
    (`ShardedDiskEmbeddingBagCollection.checkpoint`) saves the rest with
    torch.distributed.checkpoint, and copies no row."""
    token = _disk_tables_in_state_dict.set(False)
    try:
        yield
    finally:
        _disk_tables_in_state_dict.reset(token)


def disk_tables_in_state_dict() -> bool:
    """False within `disk_tables_left_out`."""
    return _disk_tables_in_state_dict.get()


class TableOptimizerState:
    """One table's optimizer state in TorchRec's stateful protocol, for a collection's table and a
    rank's shards of one alike: KeyedOptimizer.state_dict() calls `state_dict()` ({"rows": the
    state rows read from the stores (a ShardedTensor for shards), "step": the steps its kernel took,
    which Adam's bias correction uses}); load_state_dict() calls `load_state_dict()` (written back).
    So `fused_optimizer.state_dict()` carries what ``torch.optim.Adagrad`` over an
    EmbeddingBagCollection's weights would. Within `disk_tables_left_out` only the step is carried
    (the rows are in a cut)."""

    def __init__(self, read_rows: Callable[[], Any], read_step: Callable[[], int],
                 write: Callable[[Any, int], None]) -> None:
        self._read_rows, self._read_step, self._write = read_rows, read_step, write

    def state_dict(self) -> Dict[str, Any]:
        if not disk_tables_in_state_dict():
            return {"step": self._read_step()}
        return {"rows": self._read_rows(), "step": self._read_step()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "rows" not in state:  # saved within disk_tables_left_out: the tables reopened at their cut
            return
        self._write(state["rows"], int(state["step"]))


class DiskFusedOptimizer(FusedOptimizer):
    """The fused optimizer of disk tables, in TorchRec's protocol (a KeyedOptimizer): step() is a
    no-op (the tables update in backward); ``param_groups[0]["lr"]`` is their learning rate, which
    the owner hands to its kernels before each forward (`apply_lr`), so learning-rate schedules
    and CombinedOptimizer reach the tables as they reach TorchRec's fused ones."""

    def __init__(self, params: Dict[str, torch.Tensor], state: Dict[torch.Tensor, Any], lr: float) -> None:
        super().__init__(params, state, [{"params": list(params.values()), "lr": lr}])
        self._applied_lr = lr

    def step(self, closure: Any = None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def apply_lr(self, batches: Sequence[DiskTableBatch]) -> None:
        """Sets the kernels' learning rate when param_groups changed it (a rate set on a table
        directly stays until then)."""
        lr = float(self.param_groups[0]["lr"])
        if lr != self._applied_lr:
            for batch in batches:
                batch.lr = lr
            self._applied_lr = lr


_INIT_FNS = {torch.nn.init.uniform_: ("uniform", "a", "b"), torch.nn.init.normal_: ("normal", "mean", "std")}


def initial_distribution_of(config: Any) -> Tuple[str, float, float]:
    """How a TorchRec table's rows start on disk: ("uniform", low, high) or ("normal", mean, std).
    A disk table generates each row when first read, from (seed, id), so its init_fn is read, not
    run: ``functools.partial(torch.nn.init.uniform_ or normal_, ...)`` (TorchRec's default is the
    uniform one over weight_init_min/max) is honoured; any other init_fn cannot run there, and is
    reported."""
    init_fn = getattr(config, "init_fn", None)
    if isinstance(init_fn, functools.partial) and init_fn.func in _INIT_FNS:
        kind, first, second = _INIT_FNS[init_fn.func]
        try:
            bound = inspect.signature(init_fn.func).bind(torch.empty(0), *init_fn.args, **init_fn.keywords)
        except TypeError:
            bound = None
        if bound is not None:
            bound.apply_defaults()
            return kind, float(bound.arguments[first]), float(bound.arguments[second])
    if init_fn is not None:
        warnings.warn(f"table {config.name!r}: its init_fn is not applied on disk (only functools.partial of "
                      f"torch.nn.init.uniform_ or normal_ can be); its rows start uniform in "
                      f"[weight_init_min, weight_init_max] = [{config.get_weight_init_min():g}, "
                      f"{config.get_weight_init_max():g}] (set those, or write rows with import_rows)", stacklevel=3)
    return "uniform", float(config.get_weight_init_min()), float(config.get_weight_init_max())


def table_seed(seed: int, table_name: str) -> int:
    """The seed of a table's initial rows: the collection's seed mixed with the table's name."""
    return (seed * 1_000_003 + zlib.crc32(table_name.encode())) & 0x7FFFFFFF


def select_features(features: KeyedJaggedTensor, positions: List[int]) -> KeyedJaggedTensor:
    """The features at `positions` of a KeyedJaggedTensor with one batch size for every feature,
    in that order (a feature may be left out or repeated).

    Not `KeyedJaggedTensor.permute`: fbgemm's CPU backward of that op reads outside the weights'
    gradient when features are left out or repeated (a segfault or wrong gradients for learnable
    per-sample weights, such as TorchRec's position weights). Values and weights are gathered
    here with one `index_select` each, whose backward is torch's own."""
    keys = features.keys()
    if positions == list(range(len(keys))):
        return features
    if features.variable_stride_per_key():
        raise ValueError("features of different batch sizes (TorchRec's variable batch per feature) are not supported")
    stride = features.stride()
    lengths = features.lengths()
    starts = features.offset_per_key()  # where each feature's values begin, and the end
    device = features.values().device
    index = torch.cat([torch.arange(starts[p], starts[p + 1], device=device) for p in positions]
                      + [torch.empty(0, dtype=torch.int64, device=device)])
    weights = features.weights_or_none()
    return KeyedJaggedTensor(
        keys=[keys[p] for p in positions], values=features.values().index_select(0, index),
        weights=None if weights is None else weights.index_select(0, index),
        lengths=lengths.view(len(keys), stride).index_select(
            0, torch.tensor(positions, dtype=torch.int64, device=lengths.device)).reshape(-1),
        stride=stride)


class KernelRouting:
    """How the features of a batch reach the table-batched kernels that pool them.

    The features come in one fixed order (the collection's tables' features, or a TorchRec
    group's shards' features); feature i is pooled by kernel ``owners[i][0]`` as a row of its
    table ``owners[i][1]``. Each kernel pools all its features in one call; their outputs are put
    back in the features' order, as TorchRec lays out a KeyedTensor.
    """

    def __init__(self, owners: List[Tuple[int, int]]) -> None:
        kernels = 1 + max((k for k, _ in owners), default=-1)
        self.positions: List[List[int]] = [[] for _ in range(kernels)]  # the features of each kernel, in order
        self.tables: List[List[int]] = [[] for _ in range(kernels)]  # the table of each, within its kernel
        for i, (k, t) in enumerate(owners):
            self.positions[k].append(i)
            self.tables[k].append(t)
        pooled_order = [i for positions in self.positions for i in positions]
        # Where each feature's output columns are among the kernels' concatenated outputs (None: in order).
        self.output_permutation: Optional[List[int]] = (
            None if pooled_order == list(range(len(owners))) else [pooled_order.index(i) for i in range(len(owners))])

    def _kernel_input(self, features: KeyedJaggedTensor, kernel: int) -> KeyedJaggedTensor:
        return select_features(features, self.positions[kernel])

    def pool(self, batches: Sequence[DiskTableBatch], features: KeyedJaggedTensor, weighted: bool) -> torch.Tensor:
        """[batch, sum of feature dims] float32, features in order."""
        batch_size = features.stride()
        pooled = []
        for k, batch in enumerate(batches):
            kjt = self._kernel_input(features, k)
            lengths = kjt.lengths()
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths, 0, out=offsets[1:])
            out = batch.pool(kjt.values(), kjt.length_per_key(), self.tables[k], offsets,
                             kjt.weights() if weighted else None).float()
            num_features = len(self.positions[k])
            if num_features > 1:
                out = out.view(num_features, batch_size, -1).transpose(0, 1).reshape(batch_size, -1)
            pooled.append(out)
        if self.output_permutation is None:
            return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
        per_feature = [chunk for out, positions in zip(pooled, self.positions)
                       for chunk in out.split(out.shape[1] // len(positions), dim=1)]
        return torch.cat([per_feature[i] for i in self.output_permutation], dim=1)

    def lookahead(self, batches: Sequence[DiskTableBatch], features: KeyedJaggedTensor) -> None:
        """Starts each kernel's reads of the rows `features` (as `pool` takes them) will look up."""
        for k, batch in enumerate(batches):
            kjt = self._kernel_input(features, k)
            if kjt.values().numel():
                batch.lookahead(kjt.values(), kjt.length_per_key(), self.tables[k])


_FUSED_KINDS = {
    EmbOptimType.EXACT_SGD: optim_lib.SGD,
    EmbOptimType.EXACT_ADAGRAD: optim_lib.Adagrad,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: optim_lib.RowWiseAdagrad,
    EmbOptimType.ADAM: optim_lib.Adam,
}
_FBGEMM_EPS = 1.0e-8  # FBGEMM's default eps, so disk and in-memory tables of one plan train alike


def optimizer_from_fused_params(fused_params: Optional[Mapping[str, Any]], table: str
                                ) -> Optional[optim_lib.SparseOptimizer]:
    """The mlkv_torch.optim rule for TorchRec's fused parameters (from the sharder's fused_params
    or `apply_optimizer_in_backward`); None when they name no optimizer."""
    params = dict(fused_params or {})
    kind = params.get("optimizer")
    if kind is None:
        return None
    if isinstance(kind, str):
        kind = EmbOptimType(kind)
    if kind not in _FUSED_KINDS:
        raise ValueError(f"table {table!r}: optimizer {kind} has no disk-table form; use SGD, Adagrad, "
                         f"row-wise Adagrad or Adam")
    if params.get("weight_decay"):
        raise ValueError(f"table {table!r}: weight_decay is not supported on disk tables")
    lr = float(params.get("learning_rate", params.get("lr", 0.01)))
    eps = float(params.get("eps", _FBGEMM_EPS))
    if kind == EmbOptimType.EXACT_SGD:
        return optim_lib.SGD(lr=lr)
    if kind == EmbOptimType.EXACT_ADAGRAD:
        return optim_lib.Adagrad(lr=lr, eps=eps, initial_accumulator_value=float(
            params.get("initial_accumulator_value", 0.0)))
    if kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return optim_lib.RowWiseAdagrad(lr=lr, eps=eps)
    betas = params.get("betas", (params.get("beta1", 0.9), params.get("beta2", 0.999)))
    return optim_lib.Adam(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps)


def fused_params_of(optimizer: optim_lib.SparseOptimizer) -> Dict[str, Any]:
    """TorchRec's fused parameters for an mlkv_torch.optim rule, so tables TorchRec keeps in
    memory train with the same rule as the disk tables."""
    kind = {cls: kind for kind, cls in _FUSED_KINDS.items()}[type(optimizer)]
    params: Dict[str, Any] = {"optimizer": kind, "learning_rate": optimizer.lr}
    if hasattr(optimizer, "eps"):
        params["eps"] = optimizer.eps
    if isinstance(optimizer, optim_lib.Adam):
        params["beta1"], params["beta2"] = optimizer.betas
    return params
