"""A torchrun worker for tests/torchrec_integration/test_lookahead_dmp.py: LookaheadPipeline under
DistributedModelParallel (gloo, CPU), on dmp_worker.py's DLRM (in DLRMTrain) with its mixed plan (t1 table-wise and t3
column-wise on disk).

    torchrun --nproc_per_node 2 tests/workers/lookahead_dmp_worker.py OUT_DIR

For each mode (the plain loop, then the pipeline at each of DEPTHS, and at depth 3 with rows read
ahead into cache slots: INTO_SLOTS), a fresh model from the same
initial rows trains the same STEPS batches, with ids drawn over whole tables so that most rows a
batch needs are not in memory yet. Rank 0 writes OUT_DIR/lookahead.json: per mode, every rank's
losses, the read-ahead hits, rows read ahead and batches pooled from their named read-aheads of
its disk shards (DiskEmbeddingBag.stats()), its
number of disk shards, the pipeline's stats(), and whether a lookahead on features in another
order than the forward's is refused.
"""
import json
import os
import sys

import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dmp_worker import SIZES, build, batch, gathered, set_initial_rows
from mlkv_torch import LookaheadPipeline

STEPS = 24  # three re-measurements of the auto depth
DEPTHS = (0, 1, 3, "auto")
# Rows read ahead into cache slots (the default on CUDA), each batch's lookup named its read-ahead.
INTO_SLOTS = "3-into-slots"


def train(mode, storage_dir: str) -> dict:
    into_slots = mode == INTO_SLOTS
    # Into slots only while the caches hold every batch in the window: the whole tables there.
    dmp, opt, _ = build(True, "rowwise_adagrad", storage_dir, train_model=True,
                        **({"read_ahead_into_slots": True, "memory_fraction": 1.0} if into_slots else {}))
    mode = 3 if into_slots else mode
    set_initial_rows(dmp, collection="model.sparse_arch.embedding_bag_collection")
    batches = (Batch(*batch(step, hot_ids=max(SIZES.values()))) for step in range(STEPS))
    losses, pipeline = [], None
    if mode == "plain":
        for b in batches:
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    else:
        pipeline = LookaheadPipeline(dmp, opt, depth=mode)
        while True:
            try:
                loss, _, _ = pipeline.progress(batches)
            except StopIteration:
                break
            losses.append(float(loss.detach()))
    sharded = dmp.module.model.sparse_arch.embedding_bag_collection
    stats = sharded.stats()
    result = {"refuses_other_keys": gathered(refuses_other_keys(sharded, Batch(*batch(STEPS)).sparse_features)),
              "losses": gathered(losses),
              "read_ahead_hits": gathered(sum(s["read_ahead_hits"] for s in stats.values())),
              "read_ahead_rows": gathered(sum(s["read_ahead_rows"] for s in stats.values())),
              "read_ahead_lookups": gathered(sum(s["read_ahead_lookups"] for s in stats.values())),
              "disk_shards": gathered(len(stats)),
              "pipeline": gathered(pipeline.stats() if pipeline is not None else None)}
    sharded.close()
    return result


def refuses_other_keys(sharded, features: KeyedJaggedTensor) -> bool:
    """Whether a lookahead on the features in another order than the forward's is refused (before
    any collective), instead of sending ids to the wrong tables."""
    keys = features.keys()
    try:
        sharded.lookahead(features.permute(list(reversed(range(len(keys))))))
    except ValueError as error:
        return "lookahead must get the KeyedJaggedTensor" in str(error)
    return False


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    result = {str(mode): train(mode, os.path.join(out_dir, f"store-{mode}"))
              for mode in ("plain",) + DEPTHS + (INTO_SLOTS,)}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "lookahead.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
