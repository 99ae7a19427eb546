"""A sequence model with its item table on disk, in one process: a user's history of items and a
candidate item looked up in TorchRec's EmbeddingCollection (one embedding per id), swapped for
DiskEmbeddingCollection (the one line that changes); the candidate attends over the history
(as DIN does) to predict a click.

    python examples/sequence.py [STORAGE_DIR]
"""
import sys
import tempfile

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from mlkv_torch import optim, remove_tables
from mlkv_torch.torchrec import DiskEmbeddingCollection

ITEMS, DIM, BATCH, STEPS, HISTORY = 1_000_000, 16, 256, 80, 8
HOT_ITEMS = 2_000  # the items users see (a hot range, so rows recur)


def batch(g: torch.Generator):
    """Histories of 1 to HISTORY items and one candidate per user; a click when the candidate is
    an even item and so are at least half the history's."""
    lengths = torch.randint(1, HISTORY + 1, (BATCH,), generator=g)
    history = torch.randint(0, HOT_ITEMS, (int(lengths.sum()),), generator=g)
    candidate = torch.randint(0, HOT_ITEMS, (BATCH,), generator=g)
    user = torch.repeat_interleave(torch.arange(BATCH), lengths)
    even_share = torch.zeros(BATCH).index_add_(0, user, (history % 2 == 0).float()) / lengths
    labels = ((candidate % 2 == 0) & (even_share >= 0.5)).float()
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["history", "candidate"], values=torch.cat([history, candidate]),
        lengths=torch.cat([lengths, torch.ones(BATCH, dtype=torch.int64)]))
    return features, labels


class ClickModel(torch.nn.Module):
    """The candidate's embedding attends over the history's; both, and their product, through an MLP."""

    def __init__(self, embeddings: torch.nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        looked_up = self.embeddings(features)
        candidate = looked_up["candidate"].values()  # [users, DIM]: one id each
        history = looked_up["history"].to_padded_dense(desired_length=HISTORY)  # [users, HISTORY, DIM]
        present = torch.arange(HISTORY) < looked_up["history"].lengths().unsqueeze(1)
        scores = (history @ candidate.unsqueeze(2)).squeeze(2).masked_fill(~present, float("-inf"))
        attended = (scores.softmax(dim=1).unsqueeze(2) * history).sum(dim=1)
        return self.mlp(torch.cat([candidate, attended, candidate * attended], dim=1)).squeeze(1)


def main(storage: str) -> None:
    remove_tables(storage)  # an earlier run's: each run starts from the initial rows
    torch.manual_seed(0)
    items = EmbeddingConfig(name="item", embedding_dim=DIM, num_embeddings=ITEMS,
                            feature_names=["history", "candidate"])
    # The one line: instead of EmbeddingCollection([items]). The table trains with its own fused
    # optimizer; memory_budget_bytes bounds its host memory (here 4 MiB of its 128 MiB of rows and state).
    embeddings = DiskEmbeddingCollection([items], path=storage, optimizer=optim.Adagrad(lr=0.1),
                                         memory_budget_bytes=4 << 20)
    model = ClickModel(embeddings)
    opt = torch.optim.Adagrad(model.mlp.parameters(), lr=0.1)  # the dense part, as before
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        features, labels = batch(g)
        opt.zero_grad()
        loss = loss_fn(model(features), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    stats = embeddings.stats()["item"]
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps); table item: "
          f"{stats['cached_rows']} rows cached, hit rate {stats['hit_rate']:.2f}")
    embeddings.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="mlkv-example-sequence-") as folder:  # removed when the example ends
            main(folder)
