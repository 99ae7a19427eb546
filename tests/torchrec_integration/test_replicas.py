"""Replicas of hot rows across ranks (mlkv_torch.torchrec.replicas): 2 real processes under torchrun
(gloo, CPU), DLRM under DistributedModelParallel with a plan of an in-memory table, a table-wise
and a column-wise disk table, and a data-parallel one (tests/workers/replica_worker.py).

- At bounds 0 training is exact: the losses of every step and the tables equal those of the same
  run without replicas (up to the order of float additions), with SGD, Adagrad, row-wise Adagrad
  and Adam, while replicas serve part of the lookups and the all-to-alls carry fewer bytes.
- At bounds 2 no read served by a replica is more than 2 steps old (the owner updates a row at
  most once a step) and no gradient waits more than 2 steps for its push.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrec")

WORKER = Path(__file__).parents[1] / "workers" / "replica_worker.py"
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]


PHASES = ["exact", "bounds", "linear"]


def _results(phases: list, out: Path) -> dict:
    """Each phase's results, the phases run one after another in one torchrun job (torch and TorchRec
    start once a rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           ",".join(phases), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{phases} failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return {phase: json.loads((out / f"{phase}.json").read_text()) for phase in phases}


@pytest.fixture(scope="module")
def worker_phases(tmp_path_factory):
    return _results(PHASES, tmp_path_factory.mktemp("phases"))


@pytest.fixture(scope="module")
def exact(worker_phases):
    return worker_phases["exact"]


@pytest.fixture(scope="module")
def bounds(worker_phases):
    return worker_phases["bounds"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_at_bounds_zero_training_equals_training_without_replicas(exact, optimizer):
    import torch

    plain, replicated = exact[f"{optimizer}/plain"], exact[f"{optimizer}/replicas"]
    # The same arithmetic, but a hot row's gradients are summed on each rank, then at its owner:
    # equal up to the order of float additions (SGD: bit for bit here). Adagrad and Adam divide by
    # the root of their accumulators, which magnifies that where a row's gradients nearly cancel;
    # a read one step stale moves SGD's rows by 3e-4 here.
    torch.testing.assert_close(torch.tensor(replicated["losses"]), torch.tensor(plain["losses"]),
                               rtol=1e-5, atol=1e-6)
    tolerance = 1e-6 if optimizer == "sgd" else 5e-4
    for ours, theirs in zip(replicated["shards"], plain["shards"]):
        for table in ours:
            for mine, reference in zip(ours[table], theirs[table]):
                torch.testing.assert_close(torch.tensor(mine), torch.tensor(reference), rtol=0, atol=tolerance)
    for stats, hit_rate in zip(replicated["stats"], replicated["hit_rate"]):
        assert stats["replica_hits"] > 0.2 * stats["lookups"], stats  # replicas did serve
        assert hit_rate == stats["replica_hits"] / stats["lookups"]
    sent = {kind: sum(rank[kind] for rank in replicated["sent"]) for kind in ("ids", "outputs", "gradients")}
    before = {kind: sum(rank[kind] for rank in plain["sent"]) for kind in ("ids", "outputs", "gradients")}
    assert all(sent[kind] < before[kind] for kind in sent), (sent, before)


def _reads_and_pushes(trace):
    """From a rank's trace: per table, each served read's age (steps since its row was last read
    through a push bag; the owner updates a row at most once a step) and each served read's wait
    for the push of its gradient (None: not pushed by the end)."""
    ages, waits = [], []
    for table in {name for step in trace for name in step}:
        pushed_at: dict = {}
        for step, record in enumerate(trace):
            for row in record.get(table, {}).get("pushed", []):
                pushed_at.setdefault(row, []).append(step)
        for step, record in enumerate(trace):
            for row in record.get(table, {}).get("served", []):
                before = [p for p in pushed_at.get(row, []) if p < step]
                after = [p for p in pushed_at.get(row, []) if p > step]
                ages.append(step - max(before) if before else None)
                waits.append(min(after) - step if after else len(trace) - step)
    return ages, waits


def test_at_bounds_zero_every_row_read_is_fresh_and_pushed_in_its_step(exact):
    # Rank 0 owns t0, t1 and t4 whole, so it replicates only t3 and t6 (column-wise and
    # table-column-wise over both ranks).
    assert exact["sgd/replicas"]["sharding_types"] == ["column_wise", "data_parallel", "table_column_wise",
                                                       "table_wise"]
    replicated = [{table for record in trace for table in record} for trace in exact["sgd/replicas"]["trace"]]
    assert replicated == [{"t3", "t6"}, {"t0", "t1", "t3", "t4", "t6"}]
    for trace in exact["sgd/replicas"]["trace"]:
        assert len(trace) == 14 - 3  # after the 3 warm-up steps
        assert _reads_and_pushes(trace) == ([], [])  # nothing served locally
        assert all(record[t]["pushed"] for record in trace for t in record)


def test_no_read_is_staler_and_no_push_later_than_the_bounds(bounds):
    for trace in bounds["bound2"]["trace"]:
        ages, waits = _reads_and_pushes(trace)
        assert ages and None not in ages and max(ages) == 2  # served locally, and the bound is used and kept
        assert max(waits) == 2
    # Fewer rows move than at bounds 0, and training stays close to the run without replicas.
    moved = [sum(s["push_rows"] for s in bounds[f"bound{b}"]["stats"]) for b in (0, 2)]
    assert moved[1] < 0.9 * moved[0], moved
    for rank in range(2):
        for ours, theirs in zip(bounds["bound2"]["losses"][rank], bounds["plain"]["losses"][rank]):
            assert abs(ours - theirs) < 1e-3


@pytest.fixture(scope="module")
def linear(worker_phases):
    return worker_phases["linear"]


def test_every_gradient_reaches_its_owner_once(linear):
    # With a loss linear in the pooled embeddings the gradients do not depend on the rows read, so
    # once every replica gradient is pushed, SGD's tables equal the run without replicas' (up to
    # the order of float additions): none was lost, none pushed twice.
    import torch

    for rank, (ours, theirs) in enumerate(zip(linear["replicas"], linear["plain"])):
        # The last step hits no replica row of width 8: what was owed goes with the push bags
        # alone. Rank 0 replicates t5 (width 4), which hits. Some steps served hits and pushed
        # nothing: their gradients were owed, then pushed.
        assert ours["owed_before_last"] > 0 and (ours["hits_in_last"] > 0) == (rank == 0)
        assert ours["served_without_push"] > 0
        assert ours["pending"] == 0
        for table in ours["shards"]:
            for mine, reference in zip(ours["shards"][table], theirs["shards"][table]):
                torch.testing.assert_close(torch.tensor(mine), torch.tensor(reference), rtol=0, atol=1e-5)


def test_the_served_hits_are_pooled_and_their_gradients_kept_while_the_all_to_alls_run(linear):
    # r/w: TorchRec's output all-to-all sent / waited for; W/R: its gradients sent / waited for;
    # s/S: the served hits pooled / their gradients added to what the rank owes (replica_worker.call_order).
    for replicated in linear["replicas"]:
        order = replicated["call_order"]
        assert "s" in order and "S" in order, order
        for i, call in enumerate(order):
            if call == "s":
                assert order.rfind("r", 0, i) > order.rfind("w", 0, i), (i, order)
            if call == "S":
                assert order.rfind("W", 0, i) > order.rfind("R", 0, i), (i, order)


# ---- through the runner (storage.replicas.*), under torchrun --------------------------------------------
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
RUNNER = ["data.synthetic.scale=100", "train.batch_size=256", "eval.batches=2", "eval.every=100",
          "train.log_every=1", "train.checkpoint_every=4", "pipeline.depth=2"]  # with disk tables, looking ahead
BUDGET = 1 << 20


def _replicated(fraction: float, bound: int, *virtual: str) -> list:
    """The runner's keys for replicas, with the memory budget raised by their bytes (the same plan);
    `virtual`: the keys of virtual tables (each rank holding at most their trigger's ids a table)."""
    from mlkv_torch.config import cardinalities_of, load_config
    from mlkv_torch.torchrec.replicas import replica_memory_bytes

    config = load_config(QUICKSTART, [*RUNNER, *virtual])
    rows = cardinalities_of(config.data.synthetic.cardinalities, config.data.synthetic.scale)
    if config.storage.virtual_tables.enabled:
        rows = [2 * config.storage.virtual_tables.trigger_ids] * len(rows)
    extra = sum(replica_memory_bytes(n, config.model.embedding_dim, fraction) for n in rows)
    return [f"storage.replicas.fraction={fraction}", f"storage.replicas.pull_bound={bound}",
            f"storage.replicas.push_bound={bound}", "storage.replicas.warmup_steps=3",
            "storage.replicas.refresh_every=5", f"storage.memory_budget_bytes={BUDGET + extra}"]


def _runner(out: Path, steps: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}", f"train.steps={steps}", "--no-progress",
           f"storage.memory_budget_bytes={BUDGET}", *RUNNER, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((out / "summary.json").read_text())


def _logged(out: Path) -> list:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# TorchRec's virtual tables of 2**40 ids, row-wise over 2 ranks, evicting (as tests/train/test_train_runner.py's).
VIRTUAL = ["data.synthetic.scale=1000", "data.synthetic.id_space=1099511627776", "storage.sharding_types=[row_wise]",
           "storage.virtual_tables.enabled=true", "storage.virtual_tables.eviction=count_and_timestamp",
           "storage.virtual_tables.trigger_ids=60", "storage.virtual_tables.count_threshold=2",
           "storage.virtual_tables.ttl_minutes=3", "storage.virtual_tables.minute_steps=1",
           "storage.virtual_tables.total_num_buckets=4"]


def test_the_runner_with_replicas_at_bounds_zero_trains_virtual_tables_as_without_them(tmp_path):
    # Replicas of a virtual table hold at most `fraction` of the ids its ranks keep (their trigger), and
    # an id a replica serves is looked up at its owner when pushed (each step at bounds 0), so the
    # owner evicts the same ids as without replicas.
    plain = _runner(tmp_path / "plain", 12, *VIRTUAL)
    replicated = _runner(tmp_path / "replicas", 12, *VIRTUAL, *_replicated(0.3, 0, *VIRTUAL))
    import torch

    from test_train_runner import _shard_rows

    # Equal up to the order of float additions (see above; one step of 12 differed by 1 ulp).
    torch.testing.assert_close(torch.tensor([r["loss"] for r in _logged(tmp_path / "replicas")]),
                               torch.tensor([r["loss"] for r in _logged(tmp_path / "plain")]), rtol=1e-5, atol=1e-6)
    assert replicated["evicted_ids"] == plain["evicted_ids"] > 0 and replicated["live_ids"] == plain["live_ids"]
    rows, theirs = _shard_rows(tmp_path / "replicas", 16 + 1), _shard_rows(tmp_path / "plain", 16 + 1)
    assert rows.keys() == theirs.keys() and len(rows) == plain["live_ids"]
    torch.testing.assert_close(torch.stack(list(rows.values())), torch.stack([theirs[k] for k in rows]),
                               rtol=0, atol=1e-6)
    # Measured: the replicas served lookups, and the all-to-alls carried fewer bytes, some of them theirs.
    assert replicated["replica_hit_rate"] > 0.3 and plain["replica_hit_rate"] is None
    kinds = replicated["embedding_bytes_per_step_by_kind"]
    assert kinds["replica_pushes"] == kinds["replica_refreshes"] > 0 and kinds["replica_choice"] > 0
    assert replicated["embedding_bytes_per_step"] == pytest.approx(sum(kinds.values()))
    assert replicated["embedding_bytes_per_step"] < 0.8 * plain["embedding_bytes_per_step"]
    rates = [r["replica_hit_rate"] for r in _logged(tmp_path / "replicas")]
    assert rates[:3] == [0.0] * 3 and all(rate > 0.3 for rate in rates[3:])  # chosen after 3 warm-up steps


def test_the_runner_resumes_replicas_exactly_within_bounds(tmp_path):
    # At bounds 3 replicas serve stale rows: a resumed run must continue with the replicas' rows and
    # what they owed at the checkpoint (pushed before its cut), as the uninterrupted run does.
    keys = _replicated(0.02, 3)
    _runner(tmp_path / "whole", 12, *keys)
    _runner(tmp_path / "split", 10, *keys)  # its last checkpoint is at step 8
    _runner(tmp_path / "split", 12, "--resume", *keys)
    whole, split = _logged(tmp_path / "whole"), _logged(tmp_path / "split")
    assert [r["loss"] for r in split if r["step"] > 8] == [r["loss"] for r in whole if r["step"] > 8]
    # The checkpoint's step pushed every gradient owed, so its cut of the tables holds them all.
    import torch

    for rank in range(2):
        saved = torch.load(tmp_path / "whole" / "checkpoint-12" / f"rank{rank}.pt", weights_only=False)
        assert saved["replicas"]["step"] == 12
        assert not any(bool(g["has_pending"].any()) for g in saved["replicas"]["groups"])
        assert any(bool(g["keys"].numel()) for g in saved["replicas"]["groups"])


def test_bad_replica_settings_are_refused_by_key(tmp_path):
    from mlkv_torch.config import ConfigError, load_config
    from mlkv_torch.torchrec.replicas import ReplicaSettings
    from mlkv_torch.train import run

    for override, key in [("storage.replicas.fraction=1", "storage.replicas.fraction"),
                          ("storage.replicas.fraction=-0.1", "storage.replicas.fraction"),
                          ("storage.replicas.pull_bound=-1", "storage.replicas.pull_bound"),
                          ("storage.replicas.push_bound=1.5", "storage.replicas.push_bound"),
                          ("storage.replicas.refresh_every=0", "storage.replicas.refresh_every")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(QUICKSTART, [override])
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "data.synthetic.scale=1000",
                                      "storage.replicas.fraction=0.01"])
    with pytest.raises(ConfigError, match=r"storage\.replicas\.fraction: replicas need several ranks"):
        run(config, progress=False)
    for bad, match in [(dict(fraction=1.0), "fraction must be in"), (dict(pull_bound=-1), "pull_bound must be"),
                       (dict(push_bound=True), "push_bound must be"), (dict(warmup_steps=0), "warmup_steps must be")]:
        with pytest.raises(ValueError, match=match):
            ReplicaSettings(**bad)


def test_the_variable_batch_layout_is_fbgemms():
    # TorchRec's output distribution reads a kernel's variable batch in fbgemm's layout: the disk
    # kernel lays its pooled bags out with `variable_batch_layout`, checked here against fbgemm's
    # own kernel on the same rows and bags.
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                       SplitTableBatchedEmbeddingBagsCodegen)

    from mlkv_torch.torchrec.routing import variable_batch_layout

    g = torch.Generator().manual_seed(0)
    dims, rows = [4, 8, 4], [50, 60, 70]
    bags_per_rank = [[3, 1], [0, 2], [2, 4]]  # feature f: bags from rank 0, rank 1
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU)
                                                 for n, d in zip(rows, dims)], optimizer=EmbOptimType.EXACT_SGD)
    weights = [w.detach() for w in tbe.split_embedding_weights()]
    for w in weights:
        w.copy_(torch.randn(w.shape, generator=g))
    lengths = [torch.randint(0, 3, (sum(counts),), generator=g) for counts in bags_per_rank]
    ids = [torch.randint(0, n, (int(bag.sum()),), generator=g) for n, bag in zip(rows, lengths)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
    theirs = tbe(torch.cat(ids), offsets, batch_size_per_feature_per_rank=bags_per_rank).reshape(-1)
    per_feature = [torch.nn.functional.embedding_bag(
        i, w, torch.cat([torch.zeros(1, dtype=torch.int64), bag.cumsum(0)]), mode="sum", include_last_offset=True)
        for i, w, bag in zip(ids, weights, lengths)]
    ours = variable_batch_layout(per_feature, bags_per_rank)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_hits_pool_served_and_pushed_rows_as_one_embedding_bag():
    # A step's hits are pooled in two parts (ServedHits from the replica before the
    # all-to-all's wait, PushedHits from the push bags' refreshed rows after it): together
    # they must be one embedding_bag over the replica with the pushed rows refreshed, and their
    # gradients must go to what the rank owes (served rows) and to the push bags, with what was owed
    # (pushed rows). Small integers, so float sums are exact in any order.
    from types import SimpleNamespace

    import torch

    from mlkv_torch.torchrec.replicas.autograd import PushedHits
    from mlkv_torch.torchrec.replicas.groups import GroupStep, ReplicaGroup, ReplicatedTable
    from mlkv_torch.torchrec.replicas.hot_rows import HotRowReplicas

    g = torch.Generator().manual_seed(5)
    table = ReplicatedTable("t", 100, 4, ["f"], False, 4, 0, 1.0)
    group = ReplicaGroup([table], hot_count=10, sharded_tables=1)
    group.set_hot(torch.arange(10) * 7)
    group.values = torch.randint(-4, 5, (10, 4), generator=g).float()
    bags = [[1, 2], [3], [], [4, 1, 5], [6], [5, 6]]  # slots; an empty bag is a hit too
    slots = torch.tensor([s for bag in bags for s in bag])
    offsets = torch.tensor([0] + [len(bag) for bag in bags]).cumsum(0)
    weights = torch.randint(1, 4, (slots.numel(),), generator=g).float()
    push = torch.tensor([1, 5, 8])  # row 8: pushed without a hit (its push bound)
    owed = torch.randint(-4, 5, (3, 4), generator=g).float()
    step = GroupStep(["f"], torch.arange(len(bags)), offsets, slots, weights, push, [3], owed)
    fresh = torch.randint(-4, 5, (3, 4), generator=g).float().requires_grad_()
    grad = torch.randint(-4, 5, (len(bags), 4), generator=g).float()

    served, pushed = HotRowReplicas._pool_hits(
        SimpleNamespace(_anchor=torch.zeros(0, requires_grad=True)), group, step)
    ours = served + PushedHits.apply(fresh, pushed, owed)
    ours.backward(grad)

    read = group.values.clone()
    read[push] = fresh.detach()
    read.requires_grad_()
    reference = torch.nn.functional.embedding_bag(slots, read, offsets, mode="sum", per_sample_weights=weights,
                                                  include_last_offset=True)
    reference.backward(grad)
    assert torch.equal(ours, reference)
    assert torch.equal(fresh.grad, owed + read.grad[push])
    is_pushed = torch.zeros(10, dtype=torch.bool)
    is_pushed[push] = True
    assert torch.equal(group.pending[~is_pushed], read.grad[~is_pushed])
    assert not group.pending[is_pushed].any()


def test_the_hot_row_split_matches_a_plain_reference():
    # The split a step starts with (mlkv_torch._C.HotRowIndex): a bag is pooled from the replicas
    # when every id of it is hot (an empty one too); checked against a plain Python reading of that.
    import torch

    from mlkv_torch import _C

    g = torch.Generator().manual_seed(3)
    batch, tables = 40, [0, 2, 2]  # two features of table 2
    hot = sorted({t << 40 | int(r) for t in (0, 2) for r in torch.randint(0, 30, (20,), generator=g)})
    lengths = torch.randint(0, 4, (len(tables) * batch,), generator=g)
    ids = [torch.randint(0, 40, (int(lengths[m * batch:(m + 1) * batch].sum()),), generator=g)
           for m in range(len(tables))]
    (keys, value_hit, hit_bags, hit_offsets, hit_slots, kept_lengths, kept_ids, kept_bags, kept_values,
     inverse) = _C.HotRowIndex(torch.tensor(hot)).split(ids, tables, lengths, batch)

    slot = {key: i for i, key in enumerate(hot)}
    want = dict(keys=[], value_hit=[], hit_bags=[], hit_offsets=[0], hit_slots=[], kept_lengths=[], kept_ids=[],
                kept_bags=[0] * len(tables), kept_values=[0] * len(tables), inverse=[[0] * batch for _ in tables])
    for m, table in enumerate(tables):
        bags = ids[m].split(lengths[m * batch:(m + 1) * batch].tolist())
        for b, bag in enumerate(bags):
            bag_keys = [table << 40 | int(i) for i in bag]
            hit = all(k in slot for k in bag_keys)
            want["keys"] += bag_keys
            want["value_hit"] += [hit] * len(bag_keys)
            if hit:
                want["hit_bags"].append(m * batch + b)
                want["hit_slots"] += [slot[k] for k in bag_keys]
                want["hit_offsets"].append(len(want["hit_slots"]))
            else:
                want["inverse"][m][b] = want["kept_bags"][m]
                want["kept_bags"][m] += 1
                want["kept_lengths"].append(len(bag_keys))
                want["kept_ids"] += bag.tolist()
                want["kept_values"][m] += len(bag_keys)
    got = dict(keys=keys.tolist(), value_hit=value_hit.tolist(), hit_bags=hit_bags.tolist(),
               hit_offsets=hit_offsets.tolist(), hit_slots=hit_slots.tolist(), kept_lengths=kept_lengths.tolist(),
               kept_ids=kept_ids.tolist(), kept_bags=kept_bags, kept_values=kept_values, inverse=inverse.tolist())
    assert got == want
    assert 0 < len(want["hit_bags"]) < len(tables) * batch  # both kinds of bag occur

    with pytest.raises(ValueError, match="given twice"):
        _C.HotRowIndex(torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="non-negative"):
        _C.HotRowIndex(torch.tensor([-2]))
    with pytest.raises(TypeError, match="int64"):
        _C.HotRowIndex(torch.tensor([1.0]))
    index = _C.HotRowIndex(torch.tensor(hot))
    with pytest.raises(ValueError, match="lengths do not match"):
        index.split([torch.tensor([1, 2])], [0], torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match=r"lengths must be contiguous int64 \[members x batch\]"):
        index.split([torch.tensor([1, 2])], [0], torch.tensor([1, 1]), 3)
    with pytest.raises(ValueError, match="lengths do not match"):  # no overflow past the ids
        index.split([torch.tensor([1, 2])], [0], torch.tensor([1, (1 << 63) - 1, (1 << 63) - 1, 1]), 4)
    # An id outside [0, 2^40) is no hot row (nor another table's): its bag goes to TorchRec, whose
    # lookup names it.
    assert index.split([torch.tensor([-1, hot[-1]])], [0], torch.tensor([1, 1]), 2)[1].tolist() == [False, False]


def test_every_rank_chooses_the_same_rows_with_counts_scaled_to_all_ranks():
    # Two ranks' groups, without processes: table 0 is owned by rank 1 (only rank 0 counts it),
    # table 1 is shared (both count it). Scaled to both ranks, table 0's row 5 (10 lookups on one
    # rank of two) is hotter than table 1's row 7 (8 on each); each rank keeps the chosen rows of
    # the tables it replicates.
    import torch

    from mlkv_torch.torchrec.replicas.groups import ReplicaGroup, ReplicatedTable

    def table(index, weight):
        return ReplicatedTable(f"t{index}", 100, 4, [f"f{index}"], False, 4, index, weight)

    rank0 = ReplicaGroup([table(0, 2.0), table(1, 1.0)], hot_count=1, sharded_tables=2)
    rank1 = ReplicaGroup([table(1, 1.0)], hot_count=1, sharded_tables=2)
    rank0.uncounted = [torch.tensor([5] * 10 + [1 << 40 | 7] * 8)]  # keys: local table << 40 | row
    rank1.uncounted = [torch.tensor([7] * 8)]
    offered = [rank0.candidates(), rank1.candidates()]
    assert offered[0][0].tolist()[:2] == [5, 1 << 40 | 7]  # offered by the tables' global indices
    for group in (rank0, rank1):
        group.choose(offered)
    assert rank0.keys.tolist() == [5] and rank1.keys.tolist() == []
