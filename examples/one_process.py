"""TorchRec's DLRM with its tables on disk, in one process: EmbeddingBagCollection swapped for
DiskEmbeddingBagCollection (the one line that changes), trained on data with a learnable signal.

    python examples/one_process.py [STORAGE_DIR]
"""
import sys
import tempfile

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import optim, remove_tables
from mlkv_torch.torchrec import DiskEmbeddingBagCollection

ROWS, DIM, BATCH, STEPS = 100_000, 16, 256, 60


def batch(g: torch.Generator, tables):
    """Dense features, one id per table per sample, and labels that depend on the ids."""
    ids = [torch.randint(0, 1000, (BATCH,), generator=g) for _ in tables]  # a hot range, so rows recur
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[t.feature_names[0] for t in tables], values=torch.cat(ids),
                                                 lengths=torch.ones(len(tables) * BATCH, dtype=torch.int64))
    labels = ((ids[0] % 2) ^ (ids[1] % 3 == 0)).float()
    return torch.randn(BATCH, 13, generator=g), sparse, labels


def main(storage: str) -> None:
    remove_tables(storage)  # an earlier run's: each run starts from the initial rows
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
              for i in range(4)]
    # The one line: instead of EmbeddingBagCollection(tables). The tables train with their own fused
    # optimizer; memory_budget_bytes bounds the host memory of all of them (here a quarter of their rows).
    ebc = DiskEmbeddingBagCollection(tables, path=storage, optimizer=optim.Adagrad(lr=0.1),
                                     memory_budget_bytes=(4 * ROWS * DIM * 4 * 2) // 4)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[32, DIM],
                 over_arch_layer_sizes=[32, 1])
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # the dense part, as before
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        dense, sparse, labels = batch(g, tables)
        opt.zero_grad()
        loss = loss_fn(model(dense, sparse).squeeze(1), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    stats = ebc.stats()["t0"]
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps); table t0: "
          f"{stats['cached_rows']} rows cached, hit rate {stats['hit_rate']:.2f}")
    ebc.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="mlkv-example-") as folder:  # removed when the example ends
            main(folder)
