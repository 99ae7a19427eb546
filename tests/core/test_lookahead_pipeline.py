"""LookaheadPipeline: at staleness 0 training equals the plain loop at every depth, while the
rows of future batches are read ahead (read-ahead hits); depth "auto" follows the measurements."""
import itertools

import pytest
import torch

torchrec = pytest.importorskip("torchrec")
from torchrec.models.dlrm import DLRM, DLRMTrain  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402

from mlkv_torch import LookaheadPipeline, optim  # noqa: E402
from mlkv_torch.data import SyntheticCTR, SyntheticCTRDataset  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingBagCollection  # noqa: E402

DATA = SyntheticCTR(cardinalities=(50_000, 20_000, 300, 50_000), num_dense=4, zipf=1.1)
STEPS = 24


def _model(path):
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"cat_{i}"])
              for i, n in enumerate(DATA.cardinalities)]
    ebc = DiskEmbeddingBagCollection(tables, path=path, optimizer=optim.Adagrad(lr=0.05),
                                     memory_budget_bytes=1 << 20)  # ~1/10 of the tables: misses read the disk
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8],
                           over_arch_layer_sizes=[8, 1]))
    return model, ebc, torch.optim.SGD(model.parameters(), lr=0.05)


def _batches():
    return iter(SyntheticCTRDataset(DATA, batch_size=256, num_batches=STEPS, rank=0, world_size=1))


def _plain_losses(path):
    model, ebc, opt = _model(path)
    losses = []
    for batch in _batches():
        opt.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    ebc.close()
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _plain_losses(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("depth", [0, 1, 3, "auto"])
def test_training_equals_the_plain_loop_at_every_depth(tmp_path, reference, depth):
    model, ebc, opt = _model(tmp_path / "t")
    pipeline = LookaheadPipeline(model, opt, depth=depth)
    data = _batches()
    losses = []
    for _ in itertools.count():
        try:
            loss, _, _ = pipeline.progress(data)
        except StopIteration:
            break
        losses.append(float(loss))
    assert losses == pytest.approx(reference, rel=0, abs=0)
    hits = sum(s["read_ahead_hits"] for s in ebc.stats().values())
    if depth == 0:
        assert hits == 0
    else:
        assert hits > 0, "rows of future batches must be staged before they are needed"
    if depth == "auto":
        stats = pipeline.stats()
        assert 1 <= pipeline.depth <= 8 and stats["read_ahead_latency_ms"] > 0 and stats["step_ms"] > 0
    ebc.close()


def test_bad_depth_is_refused(tmp_path):
    model, ebc, opt = _model(tmp_path / "t")
    with pytest.raises(ValueError, match="depth"):
        LookaheadPipeline(model, opt, depth=-1)
    with pytest.raises(ValueError, match="depth"):
        LookaheadPipeline(model, opt, depth="deep")
    ebc.close()


def test_a_batch_whose_parts_disagree_on_its_size_is_refused_before_any_lookahead(tmp_path):
    from torchrec.datasets.utils import Batch

    model, ebc, opt = _model(tmp_path / "t")
    good = next(_batches())
    short_dense = Batch(dense_features=good.dense_features[:100], sparse_features=good.sparse_features,
                        labels=good.labels)
    pipeline = LookaheadPipeline(model, opt, depth=1)
    with pytest.raises(ValueError, match="batch 0: dense_features has 100 rows but sparse_features has 256 samples"):
        pipeline.progress(iter([short_dense]))
    with torch.no_grad():  # a fetch waits for reads ahead of its ids: had the batch been looked ahead, it would hit
        ebc(good.sparse_features)
    stats = list(ebc.stats().values())
    assert sum(s["read_ahead_rows"] for s in stats) == 0 and sum(s["read_ahead_hits"] for s in stats) == 0
    with pytest.raises(TypeError, match="batch 1 has no sparse_features"):
        pipeline.progress(iter([{"dense": torch.zeros(3)}]))
    ebc.close()
