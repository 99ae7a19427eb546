"""DiskEmbeddingCollection against torchrec's EmbeddingCollection (one embedding per id)."""
import pytest
import torch

torchrec = pytest.importorskip("torchrec")
from torchrec.modules.embedding_configs import EmbeddingConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from conftest import rounding_tolerance  # noqa: E402
from mlkv_torch import optim  # noqa: E402
from mlkv_torch.memory_budget import host_memory_for_all_rows  # noqa: E402
from mlkv_torch.row_layout import row_bytes  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingCollection  # noqa: E402
from test_disk_embedding_bag import RowWiseAdagradReference  # noqa: E402

DIM = 8
FEATURES = ["history", "query", "shared"]
SIZES = {"history": 400, "query": 300, "shared": 300, "other": 10**9}


def tables(shared=True):
    return [EmbeddingConfig(name="products", num_embeddings=400, embedding_dim=DIM, feature_names=["history"]),
            # "shared" feeds two tables: its embeddings read shared@words and shared@items
            EmbeddingConfig(name="words", num_embeddings=300, embedding_dim=DIM,
                            feature_names=["query", "shared"] if shared else ["query"])] + (
        [EmbeddingConfig(name="tags", num_embeddings=300, embedding_dim=DIM, feature_names=["shared"])]
        if shared else [])


def kjt(step, batch=5, keys=FEATURES):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 7, (len(keys), batch), generator=g)  # sequences of up to 6 ids, some empty
    values = torch.cat([torch.randint(0, SIZES[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(keys)])
    values[:4] = 3  # a repeated id: its row's gradients are summed
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths.flatten())


def disk_copy_of(ec, path, optimizer):
    """A disk copy of `ec`'s tables whose budget caches 150 of their 1,000 rows, with the stores'
    smallest logs: rows go to disk and come back."""
    budget = host_memory_for_all_rows(len(ec.embedding_configs()), 150, row_bytes(DIM, torch.float32, optimizer))
    disk = DiskEmbeddingCollection(ec.embedding_configs(), need_indices=ec.need_indices(), path=path,
                                   memory_budget_bytes=budget, optimizer=optimizer)
    for name, emb in ec.embeddings.items():
        disk.embeddings[name].import_rows(torch.arange(emb.num_embeddings), emb.weight.detach())
    return disk


@pytest.mark.parametrize("need_indices", [False, True])
def test_forward_equals_embedding_collection(tmp_path, need_indices):
    ec = EmbeddingCollection(tables(), need_indices=need_indices)
    disk = disk_copy_of(ec, tmp_path / "t", optim.SGD(lr=0.1))
    assert disk.embedding_dim() == ec.embedding_dim() and disk.need_indices() == need_indices
    assert disk.embedding_names_by_table() == ec.embedding_names_by_table()
    # The features in another order, and one no table reads: the output is keyed and ordered by table.
    for features in (kjt(0), kjt(1, keys=["shared", "other", "query", "history"])):
        ours, theirs = disk(features), ec(features)
        assert list(ours) == list(theirs) == ["history", "query", "shared@words", "shared@tags"]
        for name in theirs:
            torch.testing.assert_close(ours[name].values(), theirs[name].values(), rtol=0, atol=0, msg=name)
            assert torch.equal(ours[name].lengths(), theirs[name].lengths()), name
            if need_indices:
                assert torch.equal(ours[name].weights(), theirs[name].weights()), name
            else:
                assert ours[name].weights_or_none() is None
    disk.close()


OPTIMIZERS = {
    "sgd": (optim.SGD(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "adagrad": (optim.Adagrad(lr=0.2), lambda p: torch.optim.Adagrad(p, lr=0.2)),
    "rowwise_adagrad": (optim.RowWiseAdagrad(lr=0.2), lambda p: RowWiseAdagradReference(p, lr=0.2)),
    "adam": (optim.Adam(lr=0.05), lambda p: torch.optim.SparseAdam(p, lr=0.05)),
}
# A bound on one step's update over lr (as tests/core/test_disk_embedding_bag.py's): SGD's gradient row
# (at most 6 + 4 ids of a batch x |head| <= 2 x |d loss / d logit| <= 1 per id).
STEP_BOUNDS = {"sgd": 20.0, "adagrad": 1.0, "rowwise_adagrad": DIM ** 0.5, "adam": 4.0}


class SequenceModel(torch.nn.Module):
    """A per-position click model: each id's embedding through one linear head, the logits of a
    feature's sequence summed per sample."""

    def __init__(self, embeddings):
        super().__init__()
        self.embeddings = embeddings
        torch.manual_seed(0)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, features):
        logits = []
        for jagged in self.embeddings(features).values():
            per_id = self.head(jagged.values()).squeeze(1)
            bag = torch.repeat_interleave(torch.arange(jagged.lengths().numel()), jagged.lengths())
            logits.append(torch.zeros(jagged.lengths().numel()).index_add(0, bag, per_id))
        return torch.stack(logits, dim=1).sum(dim=1)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_sequence_model_trains_as_with_embedding_collection(tmp_path, optimizer):
    ours, reference = OPTIMIZERS[optimizer]
    ec = EmbeddingCollection(tables())
    disk = disk_copy_of(ec, tmp_path / "t", ours)
    for emb in ec.embeddings.values():  # sparse gradients, as the sparse references take them
        emb.sparse = True
    model_ref, model = SequenceModel(ec), SequenceModel(disk)
    table_opt = reference(list(ec.parameters()))
    dense_ref, dense = (torch.optim.SGD(m.head.parameters(), lr=0.1) for m in (model_ref, model))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    steps = 10
    tolerance = rounding_tolerance(steps, ours.lr, STEP_BOUNDS[optimizer])
    for step in range(steps):
        features = kjt(100 + step)
        labels = torch.randint(0, 2, (5,), generator=torch.Generator().manual_seed(step)).float()
        losses = []
        for m, opts in ((model_ref, (table_opt, dense_ref)), (model, (dense,))):
            for o in opts:
                o.zero_grad()
            loss = loss_fn(m(features), labels)
            loss.backward()
            for o in opts:
                o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **tolerance, msg=f"step {step}")
    for name, emb in ec.embeddings.items():
        torch.testing.assert_close(disk.embeddings[name].weight.to_dense(), emb.weight.detach(), **tolerance,
                                   msg=f"table {name}")
    stats = disk.stats()
    assert sum(s["disk_rows"] for s in stats.values()) > 0, "a budget of 150 cached rows was meant to push rows to disk"
    disk.close()


def test_state_dict_moves_between_the_two_collections(tmp_path):
    ec = EmbeddingCollection(tables())
    disk = DiskEmbeddingCollection(tables(), path=tmp_path / "t", optimizer=optim.SGD(lr=0.1),
                                   memory_budget_bytes=1 << 20)
    assert set(disk.state_dict()) == set(ec.state_dict())  # embeddings.<table>.weight
    disk.load_state_dict(ec.state_dict())
    features = kjt(7)
    torch.testing.assert_close(disk(features)["query"].values(), ec(features)["query"].values(), rtol=0, atol=0)
    (disk(features)["query"].values() ** 2).sum().backward()  # trains on disk
    back = EmbeddingCollection(tables())
    back.load_state_dict(disk.state_dict())
    torch.testing.assert_close(back(features)["query"].values(), disk(features)["query"].values(), rtol=0, atol=0)
    disk.close()


def test_built_on_the_meta_device_it_opens_nothing_until_to_empty(tmp_path):
    path = tmp_path / "tables"
    disk = DiskEmbeddingCollection(tables(), device=torch.device("meta"), path=path, optimizer=optim.SGD(lr=0.1),
                                   seed=3)
    theirs = EmbeddingCollection(tables(), device=torch.device("meta"))
    ours = disk(kjt(0))
    for name, jagged in theirs(kjt(0)).items():  # shapes alone, as EmbeddingCollection's on meta
        assert ours[name].values().is_meta and ours[name].values().shape == jagged.values().shape, name
    assert disk.state_dict()["embeddings.products.weight"].is_meta and not path.exists()
    disk.to_empty(device="cpu")
    direct = DiskEmbeddingCollection(tables(), path=tmp_path / "direct", optimizer=optim.SGD(lr=0.1), seed=3)
    torch.testing.assert_close(disk(kjt(1))["history"].values(), direct(kjt(1))["history"].values(), rtol=0, atol=0)
    for collection in (disk, direct):
        collection.close()


def test_bad_tables_and_features_are_refused(tmp_path):
    mixed = [EmbeddingConfig(name="a", num_embeddings=10, embedding_dim=8, feature_names=["fa"]),
             EmbeddingConfig(name="b", num_embeddings=10, embedding_dim=4, feature_names=["fb"])]
    with pytest.raises(ValueError, match="share one embedding_dim.*'a': 8, 'b': 4"):
        DiskEmbeddingCollection(mixed, path=tmp_path / "mixed", optimizer=optim.SGD())
    disk = DiskEmbeddingCollection(tables(), path=tmp_path / "t", optimizer=optim.SGD(), memory_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"lacks features of the tables: \['shared'\]"):
        disk(kjt(0, keys=["history", "query"]))
    too_big = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.tensor([1, 400, 2]),
                                                  lengths=torch.tensor([2, 0, 1, 0, 0, 0]))
    with pytest.raises(ValueError, match="products"):  # id 400 of a 400-row table
        disk(too_big)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        disk(torch.tensor([1, 2]))
    disk.close()
