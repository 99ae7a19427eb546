"""TorchRec's DLRM over raw ids: each table a virtual table (TorchRec's ``use_virtual_table``) of
2**40 ids on disk, each id its own row (no hashing, no collisions), rows for ids gone cold evicted
by TorchRec's eviction policy, the live rows exported at the end for serving.

    python examples/virtual_tables.py [STORAGE_DIR]
"""
import sys
import tempfile

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import CountTimestampMixedEvictionPolicy, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import optim, remove_tables
from mlkv_torch.torchrec import DiskEmbeddingBagCollection
from mlkv_torch.virtual_tables import VirtualTableOptions

DIM, BATCH, STEPS, HOT = 16, 256, 80, 2000


def raw_ids(items: torch.Tensor) -> torch.Tensor:
    """Item k's raw 40-bit id (an odd multiplication modulo 2**40: distinct items, distinct ids)."""
    return (items * 0x9E3779B97F) & ((1 << 40) - 1)


def batch(g: torch.Generator, step: int, tables):
    """Items drawn from a window that slides: new items keep arriving and old ones stop coming."""
    items = [torch.randint(0, HOT, (BATCH,), generator=g) + 20 * step for _ in tables]
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[t.feature_names[0] for t in tables],
                                                 values=torch.cat([raw_ids(i) for i in items]),
                                                 lengths=torch.ones(len(tables) * BATCH, dtype=torch.int64))
    labels = ((items[0] % 2) ^ (items[1] % 3 == 0)).float()
    return torch.randn(BATCH, 13, generator=g), sparse, labels


def main(storage: str) -> None:
    remove_tables(storage)  # an earlier run's: each run starts from the initial rows
    torch.manual_seed(0)
    # TorchRec's own config of a virtual table: 2**40 ids; a rank keeps at most 3000 of them, evicting
    # those looked up in fewer than 2 batches (counts decayed by 0.9 a round) and unseen for 10 minutes.
    policy = CountTimestampMixedEvictionPolicy(training_id_eviction_trigger_count=3000, eviction_threshold=2,
                                               decay_rate=0.9, eviction_ttl_mins=10)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=2**40, feature_names=[f"f{i}"],
                                 use_virtual_table=True, virtual_table_eviction_policy=policy,
                                 weight_init_min=-0.05, weight_init_max=0.05)
              for i in range(2)]
    # minute_steps: a minute of the policy's ttl is 5 training steps here (reproducible; default: wall minutes).
    ebc = DiskEmbeddingBagCollection(tables, path=storage, optimizer=optim.Adagrad(lr=0.1),
                                     memory_budget_bytes=8 << 20, virtual_tables=VirtualTableOptions(minute_steps=5))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[32, DIM],
                 over_arch_layer_sizes=[32, 1])
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        dense, sparse, labels = batch(g, step, tables)
        opt.zero_grad()
        loss = loss_fn(model(dense, sparse).squeeze(1), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    stats = ebc.stats()["t0"]
    exported = sum(ids.numel() for ids, _ in ebc.embedding_bags["t0"].export_live())
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps); table t0: "
          f"{stats['live_ids']} live ids, {stats['evicted_ids']} evicted, {exported} rows exported")
    ebc.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="mlkv-example-") as folder:  # removed when the example ends
            main(folder)
