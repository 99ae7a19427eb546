"""The disk kernel's rules that need no process group (mlkv_torch.torchrec.kernel): the rows a shard
is sized by and its budget (`DiskTableOptions.live_rows`, `virtual_cap`, `shard_budget`), a shard's
placement in host memory (`on_host`), and a virtual table's buckets over the ranks (`bucket_problem`)."""
import pytest
import torch

pytest.importorskip("torchrec")
from torch.distributed._shard.sharding_spec import ShardMetadata  # noqa: E402
from torchrec.modules.embedding_configs import (CountBasedEvictionPolicy, EmbeddingBagConfig,  # noqa: E402
                                                NoEvictionPolicy)

from mlkv_torch._C import IdActivity  # noqa: E402
from mlkv_torch.memory_budget import shard_memory_budget  # noqa: E402
from mlkv_torch.torchrec.kernel import DiskTableOptions, bucket_problem, on_host  # noqa: E402

SPACE = 2**40
ROW = 64


def config(name="t", rows=SPACE, virtual=True, trigger=None, buckets=None):
    policy = None
    if virtual:
        policy = (NoEvictionPolicy() if trigger is None else
                  CountBasedEvictionPolicy(training_id_eviction_trigger_count=trigger, eviction_threshold=2))
    extra = {} if buckets is None else {"total_num_buckets": buckets}
    return EmbeddingBagConfig(name=name, embedding_dim=8, num_embeddings=rows, feature_names=["f"],
                              use_virtual_table=virtual, virtual_table_eviction_policy=policy, **extra)


def test_a_shard_is_sized_by_its_share_of_the_live_ids_else_by_the_cap_else_by_its_rows(tmp_path):
    options = DiskTableOptions(str(tmp_path), live_ids={"t": 1000})
    # Its share of the table's live ids, spread over the rows, rounded up.
    assert options.live_rows("t", SPACE // 4, SPACE) == 250
    assert options.live_rows("t", SPACE // 3, SPACE) == 334
    assert options.live_rows("t", 100, 100) == 100  # never more than its rows
    # A table without live_ids: the cap, at most the rows; without a cap, its rows.
    assert options.live_rows("u", 5000, 5000, cap=300) == 300
    assert options.live_rows("u", 200, 5000, cap=300) == 200
    assert options.live_rows("u", 5000, 5000) == 5000


def test_a_virtual_tables_cap_is_its_eviction_trigger_and_one_without_is_refused(tmp_path):
    options = DiskTableOptions(str(tmp_path))
    assert options.virtual_cap(config(virtual=False, rows=1000)) is None
    assert options.virtual_cap(config(trigger=5000)) == 5000
    with pytest.raises(ValueError, match=r"table 't' is virtual .* training_id_eviction_trigger_count .*live_ids="):
        options.virtual_cap(config())
    # The sharder's live_ids size it instead.
    assert DiskTableOptions(str(tmp_path), live_ids={"t": 10}).virtual_cap(config()) is None


def test_a_shards_budget_is_the_memory_budget_rule_of_the_rows_it_holds_and_its_ids(tmp_path):
    options = DiskTableOptions(str(tmp_path), memory_fraction=0.25)
    plain = config(virtual=False, rows=400_000)
    assert options.shard_budget(plain, 100_000, ROW) == shard_memory_budget(100_000, ROW, 0.25)
    # A virtual table's shard: the rows its cap holds, and what its tracked ids take at the cap.
    virtual = config(trigger=50_000)
    assert options.shard_budget(virtual, SPACE // 2, ROW) == shard_memory_budget(
        50_000, ROW, 0.25, IdActivity.bytes_per_id * 50_000)
    # TorchRec's table-wise shard comes without the policy: the user's config is read by name.
    shard = config(virtual=False, rows=SPACE)
    with_configs = DiskTableOptions(str(tmp_path), memory_fraction=0.25, table_configs={"t": virtual})
    assert with_configs.shard_budget(shard, SPACE, ROW) == options.shard_budget(virtual, SPACE, ROW)
    # live_ids size a virtual table's shard by its share of them.
    live = DiskTableOptions(str(tmp_path), memory_fraction=0.25, live_ids={"t": 8000})
    assert live.shard_budget(config(), SPACE // 4, ROW) == shard_memory_budget(2000, ROW, 0.25)


def test_a_shard_is_placed_in_its_ranks_host_memory_or_on_meta():
    shard = ShardMetadata(shard_offsets=[4, 0], shard_sizes=[4, 8], placement="rank:1/cuda:1")
    host = on_host(shard)
    assert (host.shard_offsets, host.shard_sizes, str(host.placement)) == ([4, 0], [4, 8], "rank:1/cpu")
    assert str(on_host(shard, torch.device("cuda")).placement) == "rank:1/cpu"
    assert str(on_host(shard, torch.device("meta")).placement) == "rank:1/meta"
    unplaced = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[4, 8])
    assert str(on_host(unplaced).placement) == "rank:0/cpu"


def test_a_virtual_tables_buckets_must_split_evenly_over_the_ranks():
    assert bucket_problem(config(buckets=8), 4) is None
    assert bucket_problem(config(buckets=8), 3) == (
        "table 't': total_num_buckets 8 is not a multiple of the 3 ranks: a disk table shards row-wise by whole "
        "buckets, as many on each rank")
    assert bucket_problem(config(virtual=False, rows=1000, buckets=8), 3) is None  # only virtual tables
    assert bucket_problem(config(), 3) is None  # no buckets
