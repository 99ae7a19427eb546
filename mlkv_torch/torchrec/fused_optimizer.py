"""The disk tables' fused optimizer in TorchRec's protocol (`DiskFusedOptimizer`, one
`TableOptimizerState` per table), and TorchRec's fused optimizer parameters mapped to and from
mlkv_torch.optim rules."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.optim.fused import FusedOptimizer

from .. import optim as optim_lib
from ..table_batch import DiskTableBatch
from .state_dicts import disk_tables_in_state_dict


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


_FUSED_KINDS = {
    EmbOptimType.EXACT_SGD: optim_lib.SGD,
    EmbOptimType.EXACT_ADAGRAD: optim_lib.Adagrad,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: optim_lib.RowWiseAdagrad,
    EmbOptimType.ADAM: optim_lib.Adam,
}


# FBGEMM's defaults (SplitTableBatchedEmbeddingBagsCodegen's arguments), which TorchRec's fused
# tables take for what fused_params leaves out: disk and in-memory tables of one plan train alike.
_FBGEMM_DEFAULTS: Dict[str, Any] = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01, "eps": 1.0e-8,
                                    "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0}


def planned_optimizer(tensor: Any, fused_params: Optional[Mapping[str, Any]], table: str) -> optim_lib.SparseOptimizer:
    """The optimizer a sharder gives the table of `tensor` (its weight): an in-backward optimizer's
    (`apply_optimizer_in_backward`), over the sharder's fused_params, as TorchRec merges them (its
    ``lr`` is FBGEMM's ``learning_rate``)."""
    params = dict(fused_params or {})
    classes = getattr(tensor, "_optimizer_classes", [None])
    if classes and classes[0] is not None:
        declared = dict(getattr(tensor, "_optimizer_kwargs", [{}])[0])
        if "lr" in declared:
            declared["learning_rate"] = declared.pop("lr")
        params.update(declared, optimizer=optimizer_type_to_emb_opt_type(classes[0]))
    return optimizer_from_fused_params(params, table)


def optimizer_from_fused_params(fused_params: Optional[Mapping[str, Any]], table: str) -> optim_lib.SparseOptimizer:
    """The mlkv_torch.optim rule TorchRec's fused parameters (the sharder's fused_params, or
    `apply_optimizer_in_backward`'s) give a table, read as FBGEMM reads them: what they leave out
    takes FBGEMM's default (EXACT_SGD at learning_rate 0.01, eps 1e-8, betas 0.9 and 0.999), so
    ``fused_params={"learning_rate": 0.1}`` trains with exact SGD at 0.1, as TorchRec's fused
    tables do. ``lr`` (torch.optim's name) is read as ``learning_rate``. ValueError names an
    optimizer or option the disk tables do not have."""
    given = {k: v for k, v in (fused_params or {}).items() if v is not None}
    if "lr" in given and "learning_rate" not in given:
        given["learning_rate"] = given["lr"]
    params = {**_FBGEMM_DEFAULTS, **given}
    kind = params["optimizer"]
    if isinstance(kind, str):
        try:
            kind = EmbOptimType(kind)
        except ValueError:
            raise ValueError(f"table {table!r}: optimizer {kind!r} is none of FBGEMM's "
                             f"({', '.join(t.value for t in EmbOptimType)})") from None
    if kind not in _FUSED_KINDS:
        raise ValueError(f"table {table!r}: optimizer {kind} has no disk-table form; use SGD, Adagrad, "
                         f"row-wise Adagrad or Adam")
    if params["weight_decay"]:
        raise ValueError(f"table {table!r}: weight_decay is not supported on disk tables")
    lr, eps = float(params["learning_rate"]), float(params["eps"])
    if kind == EmbOptimType.EXACT_SGD:
        return optim_lib.SGD(lr=lr)
    if kind == EmbOptimType.EXACT_ADAGRAD:
        return optim_lib.Adagrad(lr=lr, eps=eps, initial_accumulator_value=float(
            params.get("initial_accumulator_value", 0.0)))
    if kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return optim_lib.RowWiseAdagrad(lr=lr, eps=eps)
    betas = params.get("betas", (params["beta1"], params["beta2"]))
    return optim_lib.Adam(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps)


def fused_params_of(optimizer: optim_lib.SparseOptimizer) -> Dict[str, Any]:
    """TorchRec's fused parameters for an mlkv_torch.optim rule, so tables TorchRec keeps in
    memory train with the same rule as the disk tables."""
    if isinstance(optimizer, optim_lib.Adagrad) and optimizer.initial_accumulator_value:
        raise ValueError(f"{optimizer}: FBGEMM's fused Adagrad starts its accumulators at 0, and a sharder's rule "
                         f"reaches the tables through TorchRec's fused parameters; use initial_accumulator_value=0 "
                         f"(or DiskEmbeddingBagCollection in one process)")
    kind = {cls: kind for kind, cls in _FUSED_KINDS.items()}[type(optimizer)]
    params: Dict[str, Any] = {"optimizer": kind, "learning_rate": optimizer.lr}
    eps, beta1, beta2 = optimizer.rule_constants()
    if not isinstance(optimizer, optim_lib.SGD):
        params["eps"] = eps
    if isinstance(optimizer, optim_lib.Adam):
        params["beta1"], params["beta2"] = beta1, beta2
    return params
