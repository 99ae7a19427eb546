"""The table-batched disk kernel trains DLRM exactly as TorchRec's fused in-memory kernel (fbgemm,
under DistributedModelParallel in a one-process gloo group): the same loss at every step, for each
fused optimizer, with no cache, a cache of part of the rows, and every row cached, with and without
look-ahead."""
import pytest
import torch

torchrec = pytest.importorskip("torchrec")
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from conftest import rounding_tolerance  # noqa: E402
from mlkv_torch import initial_rows, optim  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingBagCollection  # noqa: E402
from mlkv_torch.torchrec.tables import table_seed  # noqa: E402

DIM, DENSE, BATCH, STEPS = 8, 4, 16, 25
ROWS = {"t0": 400, "t1": 60, "t2": 250, "t3": 7}
LR = 0.05
# A step's update over lr is at most 1 (Adagrad) or sqrt(DIM) (row-wise Adagrad); None: computed alike.
STEP_BOUNDS = {"sgd": None, "adagrad": 1.0, "rowwise_adagrad": DIM ** 0.5}
OPTIMIZERS = {
    "sgd": (optim.SGD(lr=LR), {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}),
    "adagrad": (optim.Adagrad(lr=LR, eps=1e-8), {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR,
                                                 "eps": 1e-8}),
    "rowwise_adagrad": (optim.RowWiseAdagrad(lr=LR, eps=1e-8),
                        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}),
}


def configs():
    return [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f_{name}"])
            for name, n in ROWS.items()]


def dlrm(collection):
    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=collection, dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                over_arch_layer_sizes=[16, 1])


def batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (len(ROWS), BATCH), generator=g)
        # Skewed ids (squares of uniforms), so a part-size cache holds hot rows and misses cold ones.
        values = torch.cat([(torch.rand(int(lengths[i].sum()), generator=g) ** 2 * n).long()
                            for i, n in enumerate(ROWS.values())])
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{name}" for name in ROWS], values=values,
                                                     lengths=lengths.flatten())
        out.append((torch.randn(BATCH, DENSE, generator=g), sparse,
                    torch.randint(0, 2, (BATCH,), generator=g).float()))
    return out


def local(sharded):
    (shard,) = sharded.local_shards()  # one rank, table-wise: the whole table
    return shard.tensor.detach().clone()


def torchrec_training(fused_params):
    """Trains DLRM under DistributedModelParallel with TorchRec's fused kernel: the losses, and per
    table the trained rows and optimizer state (fbgemm's momentum1, absent for SGD)."""
    model = dlrm(EmbeddingBagCollection(configs(), device=torch.device("meta")))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), batch_size=BATCH,
        constraints={name: ParameterConstraints(sharding_types=["table_wise"]) for name in ROWS},
    ).plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    state = dmp.state_dict()
    for name, n in ROWS.items():
        for shard in state[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"].local_shards():
            shard.tensor.detach().copy_(initial_rows(torch.arange(n), DIM, seed=table_seed(0, name), num_embeddings=n))
    dmp.load_state_dict(state)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    losses = train(dmp, opt, batches())
    state, fused_state = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
    tables = {}
    for name in ROWS:
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"
        momentum = fused_state[key].get(f"{name}.momentum1")
        tables[name] = (local(state[key]), None if momentum is None else local(momentum).reshape(ROWS[name], -1))
    return losses, tables


def train(model, opt, data, lookahead=None, depth=0):
    losses = []
    for t, (dense, sparse, labels) in enumerate(data):
        if lookahead is not None and t + depth < len(data):
            lookahead(data[t + depth][1])
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1), labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("cache", ["none", "part", "all"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_dlrm_on_the_disk_kernel_equals_torchrec_in_memory(process_group, tmp_path, optimizer, cache):
    ours, fused_params = OPTIMIZERS[optimizer]
    expected, expected_tables = torchrec_training(fused_params)
    cache_rows = {"none": 0, "part": 60, "all": sum(ROWS.values())}[cache]
    collection = DiskEmbeddingBagCollection(configs(), path=tmp_path / "tables", optimizer=ours,
                                            cache_rows=cache_rows, memory_budget_bytes=1 << 20, seed=0)
    assert collection.embedding_bags["t0"]._batch is collection.embedding_bags["t3"]._batch  # one kernel
    model = dlrm(collection)
    opt = torch.optim.SGD([p for name, p in model.named_parameters() if "embedding_bags" not in name], lr=LR)
    data = batches()
    losses = train(model, opt, data, collection.lookahead, depth=2 if cache == "part" else 0)
    # SGD: one rule in the same operation order, and each row's gradient summed over its ids in the
    # order fbgemm sums them: the computation is the same, so the losses and rows are equal to the bit.
    # fbgemm's Adagrad adds eps in double and its row-wise Adagrad sums squares in SIMD lanes: their
    # rows and state, and the losses after them, differ in rounding (conftest.rounding_tolerance).
    bound = STEP_BOUNDS[optimizer]
    tolerance = dict(rtol=0, atol=0) if bound is None else rounding_tolerance(STEPS, LR, bound)
    torch.testing.assert_close(losses, expected, **tolerance)
    stats = collection.stats()
    if cache == "part":  # rows went through the cache, the store and the staging area
        assert sum(s["evictions"] for s in stats.values()) > 0
        assert sum(s["read_ahead_hits"] for s in stats.values()) > 0
    trained = {name: bag.export_rows(torch.arange(ROWS[name]), include_state=True)
               for name, bag in collection.embedding_bags.items()}
    for name, (rows, state) in trained.items():
        expected_rows, expected_state = expected_tables[name]
        torch.testing.assert_close(rows, expected_rows, **tolerance, msg=f"table {name}'s rows")
        if expected_state is not None:  # sums of squared gradients, whose roundings scale with the largest
            unit = 0 if bound is None else tolerance["rtol"]
            torch.testing.assert_close(state, expected_state, rtol=unit, atol=unit * float(expected_state.max()),
                                       msg=f"table {name}'s optimizer state")
    collection.close()
    # Reopened, every table holds what training left: cached rows were written back, evicted ones
    # went through the write-back buffer.
    reopened = DiskEmbeddingBagCollection(configs(), path=tmp_path / "tables", optimizer=ours,
                                          cache_rows=cache_rows, memory_budget_bytes=1 << 20, reopen=True)
    for name, bag in reopened.embedding_bags.items():
        rows, state = bag.export_rows(torch.arange(ROWS[name]), include_state=True)
        torch.testing.assert_close(rows, trained[name][0], rtol=0, atol=0)
        torch.testing.assert_close(state, trained[name][1], rtol=0, atol=0)
    reopened.close()


class SparseReferenceCollection(torch.nn.Module):
    """An EmbeddingBagCollection of torch.nn.EmbeddingBag(sparse=True) tables: the reference for Adam,
    which fbgemm's CPU kernel lacks (our Adam is torch.optim.SparseAdam's rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.configs = configs()
        self.bags = torch.nn.ModuleDict({c.name: torch.nn.EmbeddingBag(c.num_embeddings, DIM, mode="sum", sparse=True)
                                         for c in self.configs})
        for c in self.configs:
            self.bags[c.name].weight.data.copy_(initial_rows(torch.arange(c.num_embeddings), DIM,
                                                             seed=table_seed(0, c.name),
                                                             num_embeddings=c.num_embeddings))

    def embedding_bag_configs(self):
        return self.configs

    def forward(self, features: KeyedJaggedTensor):
        from torchrec.sparse.jagged_tensor import KeyedTensor

        by_name = features.to_dict()
        pooled = [self.bags[c.name](by_name[c.feature_names[0]].values(), by_name[c.feature_names[0]].offsets()[:-1])
                  for c in self.configs]
        return KeyedTensor(keys=[c.feature_names[0] for c in self.configs], values=torch.cat(pooled, dim=1),
                           length_per_key=[DIM] * len(self.configs))


@pytest.mark.parametrize("cache", ["none", "part", "all"])
def test_dlrm_with_adam_on_the_disk_kernel_equals_sparse_adam(tmp_path, cache):
    reference = dlrm(SparseReferenceCollection())
    tables = [p for name, p in reference.named_parameters() if "bags" in name]
    dense = [p for name, p in reference.named_parameters() if "bags" not in name]
    sparse_opt, dense_opt = torch.optim.SparseAdam(tables, lr=LR, eps=1e-8), torch.optim.SGD(dense, lr=LR)

    class Both:
        def zero_grad(self):
            sparse_opt.zero_grad()
            dense_opt.zero_grad()

        def step(self):
            sparse_opt.step()
            dense_opt.step()

    expected = train(reference, Both(), batches())
    cache_rows = {"none": 0, "part": 60, "all": sum(ROWS.values())}[cache]
    collection = DiskEmbeddingBagCollection(configs(), path=tmp_path / "tables", optimizer=optim.Adam(lr=LR, eps=1e-8),
                                            cache_rows=cache_rows, memory_budget_bytes=1 << 20, seed=0)
    model = dlrm(collection)
    opt = torch.optim.SGD([p for name, p in model.named_parameters() if "embedding_bags" not in name], lr=LR)
    # SparseAdam's vectorized kernels round differently from one CPU capability to another (a loss
    # differed by 1 ulp on AVX2), so against it: the rounding of a few operations a step
    # (conftest.rounding_tolerance), a step over lr at most (1 - beta1) / sqrt(1 - beta2) < 3.2. A row
    # also feels the rounding of earlier steps through its later gradients, which Adam divides by
    # sqrt(v), small for rare rows: that carried the rows to 1.3x the bound (AVX2), so they get 4x. The
    # rule itself equals its float32 model to the bit (test_optim.py); a rule off by 0.1% moves these
    # rows 100x further than this tolerance.
    tolerance = rounding_tolerance(STEPS, LR, 3.2)
    torch.testing.assert_close(train(model, opt, batches(), collection.lookahead, depth=1), expected, **tolerance)
    rows_tolerance = {k: 4 * v for k, v in tolerance.items()}
    for name, bag in collection.embedding_bags.items():
        reference_rows = reference.sparse_arch.embedding_bag_collection.bags[name].weight.detach()
        torch.testing.assert_close(bag.export_rows(torch.arange(ROWS[name])), reference_rows, **rows_tolerance,
                                   msg=f"table {name}'s rows")
    collection.close()


def test_one_rank_dmp_without_the_disk_sharder_trains_the_collection_as_it_is(process_group, tmp_path):
    # DistributedModelParallel with its default sharders leaves the collection unsharded (one rank:
    # it is the whole model); it trains as in one process, and DMP's fused_optimizer carries its tables.
    expected, _ = torchrec_training(OPTIMIZERS["sgd"][1])
    collection = DiskEmbeddingBagCollection(configs(), path=tmp_path / "tables", optimizer=optim.SGD(lr=LR),
                                            memory_budget_bytes=1 << 20, seed=0)
    dmp = DistributedModelParallel(dlrm(collection), device=torch.device("cpu"))
    assert dmp.module.sparse_arch.embedding_bag_collection is collection
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    torch.testing.assert_close(train(dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), batches()), expected,
                               rtol=0, atol=0)
    collection.close()
