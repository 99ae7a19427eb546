"""DiskEmbeddingBagCollection against torchrec's EmbeddingBagCollection, alone and inside DLRM."""
import functools

import pytest
import torch

torchrec = pytest.importorskip("torchrec")
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from conftest import TORCH_FUSES_MULTIPLY_ADD, rounding_tolerance  # noqa: E402
from mlkv_torch import optim  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingBagCollection  # noqa: E402

DIM = 8


def tables(weighted=False, shared=True):
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=500, embedding_dim=DIM, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", num_embeddings=80, embedding_dim=DIM, feature_names=["f2"],
                           pooling=PoolingType.SUM if weighted else PoolingType.MEAN),  # weights need SUM
        # f2 feeds two tables: its embeddings read f2@t1 and f2@t2 (DLRM reads by feature, so not there)
        EmbeddingBagConfig(name="t2", num_embeddings=300, embedding_dim=DIM,
                           feature_names=["f2", "f3"] if shared else ["f3"]),
    ]


FEATURES = ["f0", "f1", "f2", "f3"]
SIZES = {"f0": 500, "f1": 500, "f2": 80, "f3": 300}


def kjt(step, batch=6, weighted=False):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(FEATURES), batch), generator=g)
    values = torch.cat([torch.randint(0, SIZES[f], (int(lengths[i].sum()),), generator=g)
                        for i, f in enumerate(FEATURES)])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths.flatten(),
                                               weights=weights)


def disk_copy_of(ebc, tmp_path, **kwargs):
    disk = DiskEmbeddingBagCollection(ebc.embedding_bag_configs(), path=tmp_path / "tables",
                                      memory_budget_bytes=1 << 20,
                                      cache_rows=200, is_weighted=ebc.is_weighted(), **kwargs)
    for name, bag in ebc.embedding_bags.items():
        disk.embedding_bags[name].import_rows(torch.arange(bag.num_embeddings), bag.weight.detach())
    return disk


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_equals_embedding_bag_collection(tmp_path, weighted):
    ebc = EmbeddingBagCollection(tables(weighted), is_weighted=weighted)
    disk = disk_copy_of(ebc, tmp_path)
    assert disk.embedding_bag_configs() is not None and disk.is_weighted() == weighted
    for step in range(3):
        features = kjt(step, weighted=weighted)
        ours, theirs = disk(features), ebc(features)
        assert ours.keys() == theirs.keys()  # the shared f2 reads f2@t1 and f2@t2
        torch.testing.assert_close(ours.values(), theirs.values(), rtol=0, atol=0)


# step_bound: None, the same operations; else torch's CPU sqrt rounds differently, and its scalar
# kernel (ATEN_CPU_CAPABILITY=default) does not fuse SGD's multiply-add (conftest.rounding_tolerance;
# the tables' gradients here are below 1).
SGD_STEP_BOUND = None if TORCH_FUSES_MULTIPLY_ADD else 1.0


@pytest.mark.parametrize("ours, reference, step_bound", [
    (optim.SGD(lr=0.05), lambda params: torch.optim.SGD(params, lr=0.05), SGD_STEP_BOUND),
    (optim.Adagrad(lr=0.05), lambda params: torch.optim.Adagrad(params, lr=0.05), 1.0),
], ids=["sgd", "adagrad"])
def test_dlrm_trains_to_the_same_losses(tmp_path, ours, reference, step_bound):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(shared=False))
    model_ref = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                     over_arch_layer_sizes=[16, 1])
    disk = disk_copy_of(ebc, tmp_path, optimizer=ours)
    model = DLRM(embedding_bag_collection=disk, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1])
    dense_state = {k: v for k, v in model_ref.state_dict().items() if "embedding_bags" not in k}
    model.load_state_dict(dense_state, strict=False)
    opt_ref = reference(model_ref.parameters())
    dense_params = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    opt = reference(dense_params)
    tolerance = {} if step_bound is None else rounding_tolerance(50, 0.05, step_bound)
    assert_same_losses((model_ref, opt_ref, None), (model, opt, None), steps=50, first_batch=100, **tolerance)
    assert_same_tables(ebc, disk, **tolerance)


def assert_same_tables(ebc, disk, **tolerance):
    """The trained rows of every table, read back, equal the reference collection's (to the bit unless
    a tolerance is given)."""
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(disk.embedding_bags[name].weight.to_dense(), bag.weight.detach(),
                                   **(tolerance or dict(rtol=0, atol=0)), msg=f"table {name}")


def assert_same_losses(reference, ours, steps, first_batch, **tolerance):
    """Trains both (model, optimizer, LR scheduler or None) on the same batches; the losses must be
    equal (to the bit unless a tolerance is given)."""
    loss_fn = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        dense = torch.randn(6, 4, generator=g)
        labels = torch.randint(0, 2, (6,), generator=g).float()
        features = kjt(first_batch + step)
        losses = []
        for m, o, schedule in (reference, ours):
            o.zero_grad()
            loss = loss_fn(m(dense, features).squeeze(1), labels)
            loss.backward()
            o.step()
            if schedule is not None:
                schedule.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **(tolerance or dict(rtol=0, atol=0)), msg=f"step {step}")


def test_bad_features_are_refused(tmp_path):
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        DiskEmbeddingBagCollection(tables(), path=None, memory_budget_bytes=1 << 20)
    disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "t", memory_budget_bytes=1 << 20)
    lacking = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES[:3], values=torch.tensor([1, 2, 3]),
                                                  lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="lacks features of the tables: \\['f3'\\]"):
        disk(lacking)
    out_of_range = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.tensor([1, 2, 999, 4]),
                                                       lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="out of range"):
        disk(out_of_range)


def test_state_dict_moves_between_the_two_collections(tmp_path):
    ebc = EmbeddingBagCollection(tables())
    disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "t", memory_budget_bytes=1 << 20, cache_rows=100)
    assert set(disk.state_dict()) == set(ebc.state_dict())  # embedding_bags.<table>.weight
    disk.load_state_dict(ebc.state_dict())
    features = kjt(7)
    torch.testing.assert_close(disk(features).values(), ebc(features).values(), rtol=0, atol=0)
    (disk(features).values() ** 2).sum().backward()  # trains on disk
    back = EmbeddingBagCollection(tables())
    back.load_state_dict(disk.state_dict())
    torch.testing.assert_close(back(features).values(), disk(features).values(), rtol=0, atol=0)


def test_state_dict_keys_a_table_does_not_have_are_unexpected_as_in_embedding_bag_collection(tmp_path):
    ebc = EmbeddingBagCollection(tables())
    disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "t", memory_budget_bytes=1 << 20)
    state = dict(ebc.state_dict(), **{"embedding_bags.t1.bias": torch.zeros(3)})
    for collection in (ebc, disk):
        with pytest.raises(RuntimeError, match="Unexpected key.*embedding_bags.t1.bias"):
            collection.load_state_dict(state)
        assert collection.load_state_dict(state, strict=False).unexpected_keys == ["embedding_bags.t1.bias"]
    disk.close()


def test_the_fused_optimizers_state_dict_carries_the_tables_optimizer_state(tmp_path):
    # model.state_dict() and fused_optimizer.state_dict(), TorchRec's checkpoint: once it lost the
    # Adagrad sums, and a model loaded from it trained on differently from the reference.
    features = kjt(0)
    ebc = EmbeddingBagCollection(tables())
    reference = torch.optim.Adagrad(ebc.parameters(), lr=0.5)
    trained = disk_copy_of(ebc, tmp_path / "a", optimizer=optim.Adagrad(lr=0.5))
    for _ in range(3):
        reference.zero_grad()
        ebc(features).values().sum().backward()
        reference.step()
        trained(features).values().sum().backward()
    saved = trained.fused_optimizer.state_dict()
    assert saved["state"]["t1.weight"]["t1.optimizer_state"]["step"] == 3
    loaded = DiskEmbeddingBagCollection(tables(), path=tmp_path / "b" / "tables", memory_budget_bytes=1 << 20,
                                        optimizer=optim.Adagrad(lr=0.5))
    loaded.load_state_dict(trained.state_dict())
    loaded.fused_optimizer.load_state_dict(saved)
    reference.zero_grad()
    ebc(features).values().sum().backward()
    reference.step()
    loaded(features).values().sum().backward()
    # torch's CPU sqrt rounds differently from ours (conftest.rounding_tolerance); a lost sum of squares
    # would move the rows by far more.
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(loaded.embedding_bags[name].weight.to_dense(), bag.weight.detach(),
                                   **rounding_tolerance(4, 0.5, 1.0))
    trained.close()
    loaded.close()


def test_a_collection_open_on_a_device_refuses_to_move(tmp_path):
    # Its caches stay where they were opened: moving only the anchors would leave outputs behind.
    disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "t", memory_budget_bytes=1 << 20)
    before = disk(kjt(0)).values()
    with pytest.raises(ValueError, match="open on cpu and cannot move"):
        disk.to("meta")
    disk.to("cpu")  # where it is: nothing moves
    torch.testing.assert_close(disk(kjt(0)).values(), before, rtol=0, atol=0)  # the refused move left it whole
    disk.close()


def test_torch_manual_seed_makes_initial_rows_reproducible_and_a_reopened_table_keeps_its_own(tmp_path):
    def initial(name, **kwargs):
        disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / name, memory_budget_bytes=1 << 20,
                                          optimizer=optim.SGD(lr=0.1), **kwargs)
        rows = {t: disk.embedding_bags[t].weight[:] for t in ("t0", "t1", "t2")}
        disk.close()
        return rows

    torch.manual_seed(3)
    first = initial("a")
    torch.manual_seed(3)
    same = initial("b")
    torch.rand(1)
    moved_on = initial("c")  # the generator has moved on: other rows, as EmbeddingBagCollection's
    state = torch.get_rng_state()
    initial("d")
    assert torch.equal(torch.get_rng_state(), state)  # drawing the seed consumed nothing of torch's stream
    torch.manual_seed(4)
    reopened = initial("a", reopen=True)  # the seed recorded in its directory, not the generator's
    for t in first:
        torch.testing.assert_close(same[t], first[t], rtol=0, atol=0)
        torch.testing.assert_close(reopened[t], first[t], rtol=0, atol=0)
        assert not torch.equal(moved_on[t], first[t])
    disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "a", memory_budget_bytes=1 << 20,
                                      optimizer=optim.SGD(lr=0.1))
    (disk(kjt(0)).values().sum()).backward()  # rows written: a later open must say it reopens
    disk.close()
    with pytest.raises(FileExistsError, match=r"'t0' at .*/a/t0 \(\d+ rows\).*reopen=True"):
        DiskEmbeddingBagCollection(tables(), path=tmp_path / "a", optimizer=optim.SGD(lr=0.1))


def test_tables_of_one_layout_share_one_cache_and_layouts_split_the_budget_by_traffic(tmp_path):
    from mlkv_torch.memory_budget import (INDEX_ALLOWANCE, MemoryBudgetError, buffer_host_bytes, cache_host_bytes,
                                          host_memory_for_all_rows, least_host_memory, split_host_memory)

    for tables_in_kernel, rows, width in ((1, 10, 36), (26, 3_376_254, 64), (3, 500_000, 68)):  # the rule, inverted
        budget = host_memory_for_all_rows(tables_in_kernel, rows, width)
        assert split_host_memory(budget, tables_in_kernel, rows, width, on_host=True)[0] == rows

    configs = [EmbeddingBagConfig(name="small", num_embeddings=100, embedding_dim=DIM, feature_names=["a"]),
               EmbeddingBagConfig(name="big", num_embeddings=200_000, embedding_dim=DIM, feature_names=["b"]),
               EmbeddingBagConfig(name="wide", num_embeddings=200_000, embedding_dim=2 * DIM, feature_names=["c"])]
    budget = 2 << 20
    ours = DiskEmbeddingBagCollection(configs, path=tmp_path / "c", memory_budget_bytes=budget,
                                      lookups_per_sample={"wide": 4.0})
    small, big, wide = (ours.embedding_bags[n] for n in ("small", "big", "wide"))
    assert small._batch is big._batch and wide._batch is not small._batch  # one kernel per row layout
    assert small.memory_budget_bytes + wide.memory_budget_bytes <= budget
    # each layout its least first, then traffic 1 + 1 against 4: the wide layout gets twice the rest the other gets
    least_small = least_host_memory(2, 200_100, small._batch.row_bytes)
    least_wide = least_host_memory(1, 200_000, wide._batch.row_bytes)
    assert wide.memory_budget_bytes - least_wide == pytest.approx(2 * (small.memory_budget_bytes - least_small),
                                                                  rel=1e-6)
    # A budget below the layouts' least is refused with the least that opens them, not raised silently.
    with pytest.raises(MemoryBudgetError, match=f"use at least {least_small + least_wide}$"):
        DiskEmbeddingBagCollection(configs, path=tmp_path / "tiny", memory_budget_bytes=least_small + least_wide - 1)
    DiskEmbeddingBagCollection(configs, path=tmp_path / "least", memory_budget_bytes=least_small + least_wide).close()
    for bag, tables_in_kernel in ((small, 2), (wide, 1)):
        cache_rows, log_bytes, staging_rows, write_back_rows, index_bytes = split_host_memory(
            bag.memory_budget_bytes, tables_in_kernel, sum(t.num_embeddings for t in bag._batch.tables),
            bag._batch.row_bytes, on_host=True)
        assert bag.cache_rows == cache_rows
        cache_bytes = cache_host_bytes(cache_rows, bag._batch.row_bytes)  # its rows and their index
        staging = buffer_host_bytes(staging_rows, 0, bag._batch.row_bytes)
        write_back = buffer_host_bytes(0, write_back_rows, bag._batch.row_bytes)
        indexes = tables_in_kernel * index_bytes
        assert cache_bytes + staging + write_back + tables_in_kernel * log_bytes + indexes <= bag.memory_budget_bytes
        # The stores' indexes: an eighth, less their allowances (a fixed cost beside the budget).
        assert indexes == tables_in_kernel * max(0, bag.memory_budget_bytes // (8 * tables_in_kernel)
                                                 - INDEX_ALLOWANCE)
        assert bag.memory_budget_bytes // 16 < staging <= bag.memory_budget_bytes // 8
        assert bag.memory_budget_bytes // 64 < write_back <= bag.memory_budget_bytes // 32
        # the cache takes most of the rest: the logs an eighth, and what one more cache row would not fill
        assert tables_in_kernel * log_bytes <= bag.memory_budget_bytes // 8 + (
            cache_host_bytes(cache_rows + 1, bag._batch.row_bytes) - cache_bytes)
    # Each store hashes only keys below its table's rows (its key_limit): an empty table's index is
    # a bucket or two whatever its rows, not the 256 KiB an index of any keys takes at its least.
    index_bytes = [store.stats()["index_bytes"] for store in small._batch.stores + wide._batch.stores]
    assert max(index_bytes) <= 1024, index_bytes
    # One frequency-aware cache for both tables: the 100 rows of the small table, each read every
    # batch, all end up cached, while the big table's uniformly spread ids mostly miss.
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        values = torch.cat([torch.arange(100), torch.randint(0, 200_000, (4_000,), generator=g),
                            torch.randint(0, 200_000, (100,), generator=g)])
        lengths = torch.cat([torch.full((100,), 1), torch.full((100,), 40), torch.full((100,), 1)])
        ours(KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c"], values=values, lengths=lengths)
             ).values().sum().backward()
    assert small.stats()["cached_rows"] == 100
    assert big.stats()["cached_rows"] + small.stats()["cached_rows"] <= small.cache_rows
    assert big.stats()["hit_rate"] < 0.5 < small.stats()["hit_rate"]
    ours.close()
    with pytest.raises(ValueError, match="lookups_per_sample names tables.*'nope'"):
        DiskEmbeddingBagCollection(configs, path=tmp_path / "d", lookups_per_sample={"nope": 1.0})


@pytest.mark.parametrize("layout", ["two row layouts", "a feature read by two tables", "features in another order"])
def test_learnable_per_sample_weights_get_embedding_bag_collections_gradients(tmp_path, layout):
    # As TorchRec's position weights train them: the gradient reaches the weights through the
    # features' reordering (once a segfault or wrong values, from fbgemm's permute backward).
    def table(name, dim, features):
        return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=10, feature_names=features)
    configs, keys, lengths = {
        "two row layouts": ([table("a", 4, ["f1"]), table("b", 8, ["f2"])], ["f1", "f2"], [1, 2, 2, 1]),
        "a feature read by two tables": ([table("a", 4, ["f1"]), table("b", 4, ["f1"])], ["f1"], [2, 1]),
        "features in another order": ([table("a", 4, ["f1"]), table("b", 4, ["f2"])], ["f2", "f1"], [1, 2, 2, 1]),
    }[layout]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(configs, is_weighted=True)
    disk = disk_copy_of(ebc, tmp_path, optimizer=optim.SGD(lr=1e-9))
    lengths = torch.tensor(lengths)
    values = torch.arange(int(lengths.sum())) % 10
    def weight_gradients(collection, dtype=torch.float32):
        weights = torch.linspace(0.1, 0.9, values.numel(), dtype=dtype).requires_grad_()
        out = collection(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)).values()
        (out * torch.arange(out.numel(), dtype=dtype).view_as(out)).sum().backward()
        return weights.grad

    expected, ours = weight_gradients(ebc), weight_gradients(disk)
    # Each weight's gradient is a sum of dot products over rows of up to 8 terms, which torch's kernels
    # add in another order than ours (their order depends on the CPU's vector width): each result within
    # 8 roundings of the sum of its terms' magnitudes, computed here by the same collection in float64
    # over the rows' magnitudes.
    magnitudes = EmbeddingBagCollection(configs, is_weighted=True).double()
    for name, bag in magnitudes.embedding_bags.items():
        bag.weight.data.copy_(ebc.embedding_bags[name].weight.detach().abs())
    bound = 8 * 2**-24 * weight_gradients(magnitudes, torch.float64)
    assert ((ours.double() - expected.double()).abs() <= bound).all(), (ours, expected, bound)
    disk.close()


def test_features_of_different_batch_sizes_are_refused(tmp_path):
    ours = DiskEmbeddingBagCollection(tables(shared=False), path=tmp_path / "c", memory_budget_bytes=1 << 20)
    good = kjt(0)
    lengths = good.lengths().clone()
    # Feature f3 gets one bag fewer than the others: a KJT whose features disagree on the batch size.
    stride_lengths = {f: lengths[i * 6:(i + 1) * 6] for i, f in enumerate(FEATURES)}
    stride_lengths["f3"] = stride_lengths["f3"][:5]
    values = good.values()[: int(torch.cat(list(stride_lengths.values())).sum())]
    bad = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=torch.cat(list(stride_lengths.values())),
                            stride_per_key_per_rank=[[6], [6], [6], [5]])
    with pytest.raises(ValueError, match="feature 'f3' has 5 bags, the batch has 6"):
        ours(bad)
    ours.close()


def test_arguments_and_inputs_as_embedding_bag_collection(tmp_path):
    # EmbeddingBagCollection(tables, is_weighted, device): the second positional argument is is_weighted.
    weighted = DiskEmbeddingBagCollection(tables(weighted=True), True, path=tmp_path / "w", memory_budget_bytes=1 << 20)
    assert weighted.is_weighted() and EmbeddingBagCollection(tables(weighted=True), True).is_weighted()
    with pytest.raises(TypeError, match="is_weighted must be a bool"):
        DiskEmbeddingBagCollection(tables(), "cpu", path=tmp_path / "x")
    # Features no table names are ignored, as EmbeddingBagCollection ignores them (one KJT may feed
    # several collections).
    ebc = EmbeddingBagCollection(tables())
    disk = disk_copy_of(ebc, tmp_path)
    base = kjt(0)
    extra = KeyedJaggedTensor.from_lengths_sync(
        keys=["zz"] + FEATURES, values=torch.cat([torch.arange(6) * 1000, base.values()]),
        lengths=torch.cat([torch.ones(6, dtype=torch.int64), base.lengths()]))
    ours, theirs = disk(extra), ebc(extra)
    assert ours.keys() == theirs.keys()
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=0, atol=0)
    torch.testing.assert_close(ours.values(), disk(base).values(), rtol=0, atol=0)
    # No tables: an empty collection, as EmbeddingBagCollection([]) builds; it pools nothing.
    empty = DiskEmbeddingBagCollection([], path=tmp_path / "empty")
    assert len(empty.embedding_bags) == 0 and EmbeddingBagCollection([]).embedding_bag_configs() == []
    out = empty(base)
    assert out.keys() == [] and tuple(out.values().shape) == (6, 0)
    for collection in (weighted, disk, empty):
        collection.close()


def test_weight_reads_rows_by_index_as_embedding_bag_collection(tmp_path):
    ebc = EmbeddingBagCollection(tables())
    disk = disk_copy_of(ebc, tmp_path)
    disk(kjt(0))  # cached rows and rows on disk alike
    for name, bag in ebc.embedding_bags.items():
        ours, theirs = disk.embedding_bags[name].weight, bag.weight.detach()
        assert ours.shape == theirs.shape and ours.size(1) == DIM and len(ours) == theirs.shape[0]
        assert ours.dtype == theirs.dtype and ours.dim() == 2 and ours.numel() == theirs.numel()
        ids = torch.tensor([0, 7, 3, 7, theirs.shape[0] - 1])
        torch.testing.assert_close(ours[ids], theirs[ids], rtol=0, atol=0)
        torch.testing.assert_close(ours[[1, 2]], theirs[[1, 2]], rtol=0, atol=0)
        torch.testing.assert_close(ours[5:40:3], theirs[5:40:3], rtol=0, atol=0)
        torch.testing.assert_close(ours[-1], theirs[-1], rtol=0, atol=0)
        torch.testing.assert_close(ours.to_dense(), theirs, rtol=0, atol=0)
    with pytest.raises(IndexError, match="out of range"):
        disk.embedding_bags["t1"].weight[80]
    with pytest.raises(ValueError, match="out of range"):
        disk.embedding_bags["t1"].weight[torch.tensor([80])]
    # not a parameter: the fused optimizer trains the rows
    assert all(p.numel() == 0 for p in disk.parameters())
    disk.close()


def test_a_learning_rate_schedule_reaches_the_tables_through_fused_optimizer(tmp_path):
    # TorchRec's idiom: the tables' fused optimizer joins the dense one in a CombinedOptimizer and an
    # LR scheduler drives it; the losses equal EmbeddingBagCollection's with torch.optim.SGD and the
    # same schedule over all parameters.
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(shared=False))
    model_ref = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                     over_arch_layer_sizes=[16, 1])
    disk = disk_copy_of(ebc, tmp_path, optimizer=optim.SGD(lr=0.2))
    model = DLRM(embedding_bag_collection=disk, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1])
    model.load_state_dict({k: v for k, v in model_ref.state_dict().items() if "embedding_bags" not in k}, strict=False)
    assert disk.fused_optimizer.param_groups[0]["lr"] == 0.2
    opt_ref = torch.optim.SGD(model_ref.parameters(), lr=0.2)
    dense = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda params: torch.optim.SGD(params, lr=0.2))
    opt = CombinedOptimizer([("dense", dense), ("tables", disk.fused_optimizer)])
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3) for o in (opt_ref, opt)]
    tolerance = {} if SGD_STEP_BOUND is None else rounding_tolerance(10, 0.2, SGD_STEP_BOUND)
    assert_same_losses((model_ref, opt_ref, schedules[0]), (model, opt, schedules[1]), steps=10, first_batch=200,
                       **tolerance)
    assert disk.embedding_bags["t0"].lr == pytest.approx(0.2 * 0.3 ** 3)
    assert_same_tables(ebc, disk, **tolerance)
    disk.close()


def test_a_collection_without_an_optimizer_says_which_one_trains_its_tables(tmp_path):
    with pytest.warns(UserWarning, match=r"SGD\(lr=0.01\).*does not reach the tables"):
        DiskEmbeddingBagCollection(tables(), path=tmp_path / "t").close()


def test_built_on_the_meta_device_it_opens_nothing_until_to_empty(tmp_path):
    # TorchRec users build models on the meta device and materialise them later.
    path = tmp_path / "tables"
    ebc = DiskEmbeddingBagCollection(tables(), device=torch.device("meta"), path=path, optimizer=optim.SGD(lr=0.1),
                                     seed=3)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1], dense_device=torch.device("meta"))
    assert not path.exists()  # no store opened, no rows allocated
    assert model.state_dict()["sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"].is_meta
    # A table's weight is a meta tensor of its shape, as EmbeddingBagCollection's there, built either way.
    with torch.device("meta"):
        in_context = DiskEmbeddingBagCollection(tables(), path=tmp_path / "c", optimizer=optim.SGD(lr=0.1))
        theirs = EmbeddingBagCollection(tables())
    assert in_context.device.type == "meta" and not (tmp_path / "c").exists()
    for collection in (ebc, in_context):
        for name, bag in theirs.embedding_bags.items():
            weight = collection.embedding_bags[name].weight
            assert weight.device.type == "meta" and weight.shape == bag.weight.shape, name
    # Forward there gives shapes alone, as EmbeddingBagCollection's on meta: the same keys and shape,
    # also through the model.
    ours, theirs = ebc(kjt(0)), EmbeddingBagCollection(tables(), device=torch.device("meta"))(kjt(0))
    assert ours.values().is_meta and ours.values().shape == theirs.values().shape
    assert ours.keys() == theirs.keys() and ours.length_per_key() == theirs.length_per_key()
    in_model = DLRM(embedding_bag_collection=DiskEmbeddingBagCollection(  # DLRM reads unshared features
        tables(shared=False), device=torch.device("meta"), path=tmp_path / "m", optimizer=optim.SGD(lr=0.1)),
        dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
        dense_device=torch.device("meta"))
    logits = in_model(torch.empty(6, 4, device="meta"), kjt(0))
    assert logits.is_meta and logits.shape == (6, 1)
    assert not path.exists() and not (tmp_path / "m").exists()
    with pytest.raises(RuntimeError, match="meta device: materialise it with to_empty"):
        ebc.fused_optimizer
    with pytest.raises(RuntimeError, match=r"embedding_bags\.t0\.weight: the collection is on the meta device, .*"
                                           r"call to_empty\(device=\.\.\.\) first"):
        ebc.load_state_dict(EmbeddingBagCollection(tables()).state_dict())
    model.to_empty(device="cpu")
    assert ebc.device == torch.device("cpu") and (path / "t0").is_dir()
    direct = DiskEmbeddingBagCollection(tables(), path=tmp_path / "direct", optimizer=optim.SGD(lr=0.1), seed=3)
    torch.testing.assert_close(ebc(kjt(1)).values(), direct(kjt(1)).values(), rtol=0, atol=0)  # the same initial rows
    assert ebc.fused_optimizer.param_groups[0]["lr"] == 0.1
    for collection in (ebc, direct):
        collection.close()


@pytest.mark.parametrize("trace", ["torch.fx", "torchrec.fx"])
def test_symbolic_tracing_keeps_the_collection_as_one_call(tmp_path, trace):
    import torchrec.fx

    ebc = EmbeddingBagCollection(tables(shared=False))
    disk = disk_copy_of(ebc, tmp_path, optimizer=optim.SGD(lr=0.1))
    model = DLRM(embedding_bag_collection=disk, dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1])
    traced = (torch.fx.symbolic_trace if trace == "torch.fx" else torchrec.fx.symbolic_trace)(model)
    calls = [n for n in traced.graph.nodes if n.op == "call_module" and n.target.endswith("embedding_bag_collection")]
    assert len(calls) == 1
    dense = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(traced(dense, kjt(3)), model(dense, kjt(3)), rtol=0, atol=0)
    # and the traced model trains the tables: a step through it changes the rows it looked up
    before = disk.embedding_bags["t0"].export_rows(torch.arange(500))
    traced(dense, kjt(4)).sum().backward()
    assert not torch.equal(disk.embedding_bags["t0"].export_rows(torch.arange(500)), before)
    # The collection traced as the root itself (as TorchRec traces an EmbeddingBagCollection).
    alone = (torch.fx.symbolic_trace if trace == "torch.fx" else torchrec.fx.symbolic_trace)(disk)
    with torch.no_grad():
        got, expected = alone(kjt(5)), disk(kjt(5))
    assert got.keys() == expected.keys()
    torch.testing.assert_close(got.values(), expected.values(), rtol=0, atol=0)
    disk.close()


def test_initial_rows_follow_the_tables_init_fn_range_or_normal_and_another_init_fn_is_reported(tmp_path):
    from mlkv_torch import initial_rows
    from mlkv_torch.torchrec.tables import table_seed

    config = EmbeddingBagConfig(name="t", num_embeddings=2000, embedding_dim=DIM, feature_names=["f"],
                                weight_init_min=-0.5, weight_init_max=0.5)
    disk = DiskEmbeddingBagCollection([config], path=tmp_path / "a", optimizer=optim.SGD(lr=0.1), seed=2)
    rows = disk.embedding_bags["t"].weight[:]
    torch.testing.assert_close(rows, initial_rows(torch.arange(2000), DIM, seed=table_seed(2, "t"), low=-0.5, high=0.5),
                               rtol=0, atol=0)
    assert -0.5 <= float(rows.min()) and float(rows.max()) < 0.5 and abs(float(rows.std()) - 0.5 / 3 ** 0.5) < 0.01
    disk.close()
    # TorchRec users write init_fn=partial(torch.nn.init.normal_, ...): honoured, row by row from (seed, id)
    normal = EmbeddingBagConfig(name="n", num_embeddings=20_000, embedding_dim=DIM, feature_names=["f"],
                                init_fn=functools.partial(torch.nn.init.normal_, mean=0.25, std=1.5))
    disk = DiskEmbeddingBagCollection([normal], path=tmp_path / "n", optimizer=optim.SGD(lr=0.1), seed=3)
    rows = disk.embedding_bags["n"].weight[:]
    torch.testing.assert_close(rows, initial_rows(torch.arange(20_000), DIM, seed=table_seed(3, "n"), mean=0.25,
                                                  std=1.5), rtol=0, atol=0)
    assert abs(float(rows.mean()) - 0.25) < 0.02 and abs(float(rows.std()) - 1.5) < 0.02
    ebc = EmbeddingBagCollection([normal])  # the same distribution as TorchRec's table
    assert abs(float(ebc.embedding_bags["n"].weight.std()) - float(rows.std())) < 0.03
    disk.reset_parameters()  # back to the same normal rows
    torch.testing.assert_close(disk.embedding_bags["n"].weight[:], rows, rtol=0, atol=0)
    disk.close()
    uniform = EmbeddingBagConfig(name="u", num_embeddings=100, embedding_dim=DIM, feature_names=["f"],
                                 init_fn=functools.partial(torch.nn.init.uniform_, a=-2.0, b=-1.0))
    disk = DiskEmbeddingBagCollection([uniform], path=tmp_path / "u", optimizer=optim.SGD(lr=0.1))
    rows = disk.embedding_bags["u"].weight[:]
    assert -2.0 <= float(rows.min()) and float(rows.max()) < -1.0
    disk.close()
    custom = EmbeddingBagConfig(name="c", num_embeddings=100, embedding_dim=DIM, feature_names=["f"],
                                init_fn=lambda w: torch.nn.init.normal_(w, std=1.5))
    with pytest.warns(UserWarning, match=r"table 'c': its init_fn is not applied on disk \(only functools.partial"):
        DiskEmbeddingBagCollection([custom], path=tmp_path / "c", optimizer=optim.SGD(lr=0.1)).close()


def test_apply_optimizer_in_backward_chooses_the_tables_optimizer(tmp_path):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables())
    with pytest.warns(UserWarning, match="none was given"):
        disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "t", memory_budget_bytes=1 << 20, cache_rows=100)
    # TorchRec's idiom for fused tables, then the weights: the tables take Adagrad before a row is written
    apply_optimizer_in_backward(torch.optim.Adagrad, disk.parameters(), {"lr": 0.05, "eps": 1e-8})
    disk.load_state_dict(ebc.state_dict())
    assert {type(bag.optimizer) for bag in disk.embedding_bags.values()} == {optim.Adagrad}
    assert disk.fused_optimizer.param_groups[0]["lr"] == 0.05
    reference = torch.optim.Adagrad(ebc.parameters(), lr=0.05, eps=1e-8)
    for step in range(5):
        features = kjt(step)
        for module in (ebc, disk):
            (module(features).values() ** 2).sum().backward()
        reference.step()
        reference.zero_grad()
        # Tables read by two features: torch sums each feature's gradient apart and autograd adds the
        # two, we sum a row's ids in one pass (as fbgemm does). A reordered sum of n <= 24 terms is off
        # by n 2^-24 relative, Adagrad's step (at most lr per element) by twice that: over 5 steps and
        # up to 3 ids a bag, 5 * 3 * lr * 2 * 24 * 2^-24 = 2.1e-6.
        torch.testing.assert_close(disk(features).values(), ebc(features).values(), rtol=0,
                                   atol=5 * 3 * 0.05 * 2 * 24 * 2**-24, msg=f"step {step}")
    # Rows written with one rule keep it: another in-backward optimizer is refused, by name.
    apply_optimizer_in_backward(RowWiseAdagrad, disk.parameters(), {"lr": 0.1})
    with pytest.raises(RuntimeError, match=r"asks for RowWiseAdagrad.* written with Adagrad.*'t0' \(\d+ rows\)"):
        disk(kjt(0))
    disk.close()


def test_reset_parameters_brings_rows_and_optimizer_state_back_to_their_start(tmp_path):
    disk = DiskEmbeddingBagCollection(tables(), path=tmp_path / "a", optimizer=optim.Adagrad(lr=0.5), seed=4)
    fresh = DiskEmbeddingBagCollection(tables(), path=tmp_path / "b", optimizer=optim.Adagrad(lr=0.5), seed=4)
    disk(kjt(0)).values().sum().backward()
    ids = torch.arange(80)
    assert not torch.equal(disk.embedding_bags["t1"].weight[ids], fresh.embedding_bags["t1"].weight[ids])
    disk.reset_parameters()
    for name, bag in disk.embedding_bags.items():
        rows = torch.arange(bag.num_embeddings)
        for ours, start in zip(bag.export_rows(rows, include_state=True),
                               fresh.embedding_bags[name].export_rows(rows, include_state=True)):
            torch.testing.assert_close(ours, start, rtol=0, atol=0)
    for collection in (disk, fresh):
        collection.close()


def test_one_kjt_feeds_a_memory_collection_and_a_disk_collection(tmp_path):
    # A model that keeps some tables in memory and others on disk, both reading one KJT: each
    # collection takes its own features (as EmbeddingBagCollection does) and the outputs equal an
    # all-in-memory model's from the same weights.
    in_memory, on_disk = tables(shared=False)[:1], tables(shared=False)[1:]
    reference = EmbeddingBagCollection(tables(shared=False))
    memory = EmbeddingBagCollection(in_memory)
    memory.load_state_dict({k: v for k, v in reference.state_dict().items() if ".t0." in k})
    disk = disk_copy_of(EmbeddingBagCollection(on_disk), tmp_path, optimizer=optim.SGD(lr=0.1))
    for name in ("t1", "t2"):
        disk.embedding_bags[name].import_rows(torch.arange(SIZES[{"t1": "f2", "t2": "f3"}[name]]),
                                              reference.embedding_bags[name].weight.detach())
    for step in range(3):
        features = kjt(step)
        both = torch.cat([memory(features).values(), disk(features).values()], dim=1)
        torch.testing.assert_close(both, reference(features).values(), rtol=0, atol=0)
    disk.close()
