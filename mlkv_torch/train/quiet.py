"""The runner's output without the warnings that TorchRec and torch print for every run of its
models, where they are known to be harmless: each filter matches one message, and says why it may
go. Library users' own scripts keep them (the filters are the runner's, installed by its main)."""
from __future__ import annotations

import logging
import warnings

# TorchRec logs it for every replicated table, whether or not caching parameters were given; the
# runner gives none (torchrec/distributed/utils.py, add_params_from_parameter_sharding).
_CACHING_IGNORED = "Sharding Type is data_parallel, caching params will be ignored"
# TorchRec's plan check logs it for every replicated table: such a table has no sharding spec, by
# design (torchrec/distributed/planner/planners.py, _validate_sharding_plan).
_NO_SHARDING_SPEC = "Sharding spec not found for "
# The replicated tables' backward passes through fbgemm's dense lookup, which has no autograd
# kernel of its own; its rows step as torch.nn.EmbeddingBag's do (tests/torchrec_integration/
# test_torchrec_routes.py, test_torchrecs_data_parallel_tables_train_as_embedding_bags_...).
_DENSE_LOOKUP_AUTOGRAD = r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered"
# TorchRec's planner builds this reservation when given none, and warns of it in its constructor;
# the runner's budget rule is built on its 15% (experiment.py, _PLANNER_RESERVED), so it stays
# until that rule is redone for another reservation.
_HEURISTIC_RESERVATION = r"HeuristicalStorageReservation is known to cause issues"
# The same reservation logs it whenever no dense_tensor_estimate is given; in the runner's model only
# the tables (which the estimate leaves out) are on the meta device, its dense layers are real, so
# the estimate is their size (storage_reservations.py, _get_dense_tensor_size).
_DRY_RUN_ESTIMATE = "There is a known issue with TorchRec's dense tensor size calculation in dry run"
# TorchRec passes DistributedDataParallel this deprecated argument for its replicated tables and
# dense model; the argument still does what it did (torch/nn/parallel/distributed.py).
_BROADCAST_BUFFERS = r"`broadcast_buffers` is deprecated"
# torch logs it once when TorchRec asks is_fx_tracing() in a forward; nothing of the runner traces.
_FX_TRACING = "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"


class _DropMessages(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def quiet_known_warnings() -> None:
    """Installs the runner's filters (once per process is enough; again changes nothing)."""
    for name, message in (("torchrec.distributed.utils", _CACHING_IGNORED), (None, _NO_SHARDING_SPEC),  # None: root
                          ("torchrec.distributed.planner.storage_reservations", _DRY_RUN_ESTIMATE),
                          ("torch.fx._symbolic_trace", _FX_TRACING)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.start == message for f in logger.filters):
            logger.addFilter(_DropMessages(message))
    warnings.filterwarnings("ignore", message=_DENSE_LOOKUP_AUTOGRAD, category=UserWarning)
    for message in (_HEURISTIC_RESERVATION, _BROADCAST_BUFFERS):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
