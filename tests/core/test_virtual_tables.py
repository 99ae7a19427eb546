"""Virtual tables (TorchRec's use_virtual_table): raw ids in a 2**40 id space, each its own row,
against a fixed-size table fed the same ids renumbered; eviction and the frequency filter against
a plain Python model of the policy; live rows exported, saved and restored, across a reopen."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

torchrec = pytest.importorskip("torchrec")
from torchrec.modules.embedding_configs import (CountBasedEvictionPolicy,  # noqa: E402
                                                CountTimestampMixedEvictionPolicy, EmbeddingBagConfig,
                                                FeatureScoreBasedEvictionPolicy, TimestampBasedEvictionPolicy)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from mlkv_torch import optim  # noqa: E402
from mlkv_torch.memory_budget import MemoryBudgetError  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingBagCollection  # noqa: E402
from mlkv_torch.virtual_tables import IdPolicy, VirtualTableOptions  # noqa: E402

DIM = 8
SPACE = 2**40
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
STEPS_PER_MINUTE = VirtualTableOptions(minute_steps=1)  # a ttl of n minutes is n steps: reproducible


def config(num_embeddings=SPACE, virtual=True, policy=None, name="t"):
    return EmbeddingBagConfig(num_embeddings=num_embeddings, embedding_dim=DIM, name=name, feature_names=["f"],
                              use_virtual_table=virtual, virtual_table_eviction_policy=policy,
                              weight_init_min=-0.1, weight_init_max=0.1)


def collection(tmp_path, cfg, sub="v", optimizer=None, device="cpu", **kwargs):
    return DiskEmbeddingBagCollection([cfg], path=tmp_path / sub, optimizer=optimizer or optim.SGD(lr=0.1),
                                      seed=7, memory_budget_bytes=1 << 20, cache_rows=64, device=device, **kwargs)


def raw_batches(steps, batch=24, pool=60, seed=0):
    """Batches of raw ids spread over the 2**40 space: a Zipf-like pool (some ids come back often,
    most rarely), each batch one id per sample."""
    g = torch.Generator().manual_seed(seed)
    pool_ids = torch.randint(0, SPACE, (pool,), generator=g)
    weights = 1.0 / torch.arange(1, pool + 1, dtype=torch.float64)
    return [pool_ids[torch.multinomial(weights, batch, replacement=True, generator=g)] for _ in range(steps)]


def kjt(ids):
    return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(ids.numel(), dtype=torch.int64))


def train(ebc, batches):
    losses = []
    for ids in batches:
        out = ebc(kjt(ids.to(ebc.device))).values()
        loss = (out * torch.linspace(-1, 1, DIM, device=out.device)).sum()
        loss.backward()
        losses.append(loss.item())
    return losses


def live_rows(ebc, name="t"):
    bag = ebc.embedding_bags[name]
    ids = bag.live_ids()
    return ids, bag.export_rows(ids)


def test_a_virtual_table_trains_as_a_fixed_table_fed_the_ids_renumbered(tmp_path):
    batches = raw_batches(12)
    virtual = collection(tmp_path, config())
    distinct = torch.unique(torch.cat(batches))
    dense = {int(raw): i for i, raw in enumerate(distinct.tolist())}
    fixed = collection(tmp_path, config(num_embeddings=distinct.numel(), virtual=False), sub="f")
    # The same starting rows: the virtual table's initial rows of its raw ids (reading them writes nothing).
    fixed.embedding_bags["t"].import_rows(torch.arange(distinct.numel()),
                                          virtual.embedding_bags["t"].export_rows(distinct))
    assert virtual.embedding_bags["t"].live_ids().numel() == 0
    renumbered = [torch.tensor([dense[int(i)] for i in ids.tolist()]) for ids in batches]
    assert train(virtual, batches) == train(fixed, renumbered)  # bit for bit: the same kernel on the same rows
    ids, rows = live_rows(virtual)
    assert torch.equal(ids, distinct)  # each raw id its own row, and only those
    assert torch.equal(rows, fixed.embedding_bags["t"].export_rows(torch.arange(distinct.numel())))
    assert virtual.embedding_bags["t"].virtual and not fixed.embedding_bags["t"].virtual


class PolicyModel:
    """The eviction policy and the frequency filter in plain Python (a dict per id), as
    docs/torchrec.md states them: a batch counts once per distinct id; before a batch, a round runs
    when more ids than the trigger hold rows: counts decay (float32), the rule picks, then the
    weakest (count, then last seen, then id) go until `keep` hold rows."""

    def __init__(self, policy: IdPolicy):
        self.p = policy
        self.ids = {}  # id -> [count (float32), last step, holds a row]
        self.evicted = 0

    def live(self):
        return sorted(i for i, (_, _, holds) in self.ids.items() if holds)

    def before_batch(self, step):
        if self.p.trigger_ids and len(self.live()) > self.p.trigger_ids:
            self.round(step)

    def round(self, now):
        picked, kept = [], []
        for i, entry in self.ids.items():
            entry[0] = float(np.float32(entry[0]) * np.float32(self.p.decay_rate))
            rare = entry[0] < self.p.count_threshold
            expired = now - entry[1] > self.p.ttl()
            evict = {"none": False, "count": rare, "timestamp": expired,
                     "count_and_timestamp": rare and expired}[self.p.rule]
            if evict:
                picked.append(i)
            elif entry[2]:
                kept.append(i)
        if self.p.keep_ids and len(kept) > self.p.keep_ids:
            kept.sort(key=lambda i: (self.ids[i][0], self.ids[i][1], i))
            picked += kept[:len(kept) - self.p.keep_ids]
        self.evicted += sum(1 for i in picked if self.ids[i][2])
        for i in picked:
            del self.ids[i]

    def observe(self, ids, step):
        for i in torch.unique(ids).tolist():
            entry = self.ids.setdefault(i, [0.0, step, False])
            entry[0] += 1
            entry[1] = step
            entry[2] = entry[2] or entry[0] >= self.p.admit_after


@pytest.mark.parametrize("policy", [
    CountBasedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_threshold=2, decay_rate=0.9),
    TimestampBasedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_ttl_mins=3),
    CountTimestampMixedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_threshold=2, decay_rate=0.9,
                                      eviction_ttl_mins=2),
], ids=["count", "timestamp", "mixed"])
@pytest.mark.parametrize("device", DEVICES)
def test_eviction_follows_torchrecs_policies_as_a_python_model_of_them(tmp_path, policy, device):
    # On CUDA the batch's ids take the host's lookup (the policy counts them there), its rows the device.
    ebc = collection(tmp_path, config(policy=policy), optimizer=optim.Adagrad(lr=0.1),
                     virtual_tables=STEPS_PER_MINUTE, device=device)
    bag = ebc.embedding_bags["t"]
    model = PolicyModel(bag._batch.tables[0].id_policy)
    assert model.p.trigger_ids == 30 and model.p.keep_ids == 27  # the cap: 0.9 of the trigger
    fresh = collection(tmp_path, config(policy=policy), sub="fresh", optimizer=optim.Adagrad(lr=0.1))
    batches = raw_batches(25, pool=200)

    for step, ids in enumerate(batches):
        train(ebc, [ids])  # its forward runs the round due first, then counts the batch's ids
        model.before_batch(step)
        model.observe(ids, step)
        assert bag.live_ids().tolist() == model.live(), step
    stats = bag.stats()
    assert stats["evicted_ids"] == model.evicted > 0 and stats["eviction_rounds"] > 0
    assert stats["live_ids"] == len(model.live())
    # An evicted id reads its initial row and optimizer state again, as a table that never saw it.
    ever = torch.unique(torch.cat(batches))
    gone = ever[~torch.isin(ever, bag.live_ids())][:10]
    weights, state = bag.export_rows(gone, include_state=True)
    fresh_weights, fresh_state = fresh.embedding_bags["t"].export_rows(gone, include_state=True)
    assert torch.equal(weights, fresh_weights) and torch.equal(state, fresh_state)


def test_rows_stay_at_the_cap_and_a_round_can_be_asked_for(tmp_path):
    policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=40, eviction_threshold=1, decay_rate=1.0)
    ebc = collection(tmp_path, config(policy=policy), virtual_tables=VirtualTableOptions(keep_fraction=0.5))
    bag = ebc.embedding_bags["t"]
    most, rounds, after_rounds = 0, 0, []
    for ids in raw_batches(20, pool=400):
        train(ebc, [ids])
        stats = bag.stats()
        most = max(most, stats["live_ids"])
        if stats["eviction_rounds"] > rounds:
            rounds = stats["eviction_rounds"]
            after_rounds.append(stats["live_ids"])
    # A round runs before a batch once more than 40 ids hold rows and leaves 20; a batch of 24 adds at most 24.
    assert 40 < most <= 40 + 24
    assert len(after_rounds) >= 2 and max(after_rounds) <= 20 + 24
    before = bag.stats()["live_ids"]
    evicted = bag.evict()  # a round on demand: the count rule (threshold 1, no decay) picks none, the cap 20
    assert evicted == max(0, before - 20) and bag.live_ids().numel() == min(before, 20)


def test_the_frequency_filter_gives_rows_only_to_ids_seen_enough(tmp_path):
    ebc = collection(tmp_path, config(policy=None), virtual_tables=VirtualTableOptions(admit_after=3))
    bag = ebc.embedding_bags["t"]
    reference = collection(tmp_path, config(policy=None), sub="r")  # unfiltered, same seed: the same initial rows
    rows = {}  # the reference: rows of admitted ids, trained by SGD in Python
    seen = {}
    weight = torch.linspace(-1, 1, DIM)
    for ids in raw_batches(12, pool=40):
        out = ebc(kjt(ids)).values()
        expected = torch.zeros(ids.numel(), DIM)
        for i in torch.unique(ids).tolist():
            seen[i] = seen.get(i, 0) + 1
            if seen[i] >= 3 and i not in rows:
                rows[i] = reference.embedding_bags["t"].export_rows(torch.tensor([i]))[0]
        admitted = torch.tensor([i in rows for i in ids.tolist()])
        for k, i in enumerate(ids.tolist()):
            if i in rows:
                expected[k] = rows[i]
        assert not bool(out[~admitted].any())  # ids not yet admitted read zeros
        # SGD here rounds its multiply-add in two steps, the kernel in one (conftest's rounding_tolerance)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        (out * weight).sum().backward()
        for i in set(ids.tolist()) & set(rows):
            hits = int((ids == i).sum())
            rows[i] = rows[i] - 0.1 * (hits * weight)  # SGD's step on the summed gradient
    ids, got = live_rows(ebc)
    assert ids.tolist() == sorted(rows)
    torch.testing.assert_close(got, torch.stack([rows[i] for i in sorted(rows)]), rtol=1e-6, atol=1e-6)
    assert bag.stats()["live_ids"] == len(rows)


def test_live_rows_export_in_id_order_and_the_state_dict_holds_them(tmp_path):
    policy = TimestampBasedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_ttl_mins=2)
    ebc = collection(tmp_path, config(policy=policy), optimizer=optim.Adam(lr=0.01), virtual_tables=STEPS_PER_MINUTE)
    train(ebc, raw_batches(15, pool=150))
    bag = ebc.embedding_bags["t"]
    ids, rows = live_rows(ebc)
    chunks = list(bag.export_live(chunk_rows=7, include_state=True))
    assert all(c[0].numel() <= 7 for c in chunks)
    assert torch.equal(torch.cat([c[0] for c in chunks]), ids) and bool((ids[1:] > ids[:-1]).all())
    assert torch.equal(torch.cat([c[1] for c in chunks]), rows)
    assert torch.equal(torch.cat([c[2] for c in chunks]), bag.export_rows(ids, include_state=True)[1])
    state = ebc.state_dict()  # a 2**40-row table: its live rows, not 2**40 of them
    assert torch.equal(state["embedding_bags.t.weight_id"], ids) and torch.equal(state["embedding_bags.t.weight"], rows)
    other = collection(tmp_path, config(policy=policy), sub="other", virtual_tables=STEPS_PER_MINUTE)
    train(other, raw_batches(3, seed=5))  # rows of other ids, which the load replaces
    other.load_state_dict(state)
    got_ids, got_rows = live_rows(other)
    assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows)
    assert other.embedding_bags["t"].stats()["live_ids"] == ids.numel()
    with pytest.raises(ValueError, match="is virtual"):
        bag.snapshot()


@pytest.mark.parametrize("admit_after", [1, 2])
def test_a_run_reopened_at_its_cut_evicts_as_the_uninterrupted_run(tmp_path, admit_after):
    policy = CountTimestampMixedEvictionPolicy(training_id_eviction_trigger_count=25, eviction_threshold=2,
                                               decay_rate=0.8, eviction_ttl_mins=3)
    options = VirtualTableOptions(minute_steps=1, admit_after=admit_after)
    batches = raw_batches(20, pool=120)
    whole = collection(tmp_path, config(policy=policy), sub="whole", optimizer=optim.Adagrad(lr=0.1),
                       virtual_tables=options)
    whole_losses = train(whole, batches)
    first = collection(tmp_path, config(policy=policy), sub="cut", optimizer=optim.Adagrad(lr=0.1),
                       virtual_tables=options)
    losses = train(first, batches[:9])
    first.close()  # takes a cut at step 9, with the ids' activity beside it
    second = collection(tmp_path, config(policy=policy), sub="cut", optimizer=optim.Adagrad(lr=0.1),
                        virtual_tables=options, reopen=True)
    losses += train(second, batches[9:])
    assert losses == whole_losses
    ids, rows = live_rows(second)
    whole_ids, whole_rows = live_rows(whole)
    assert torch.equal(ids, whole_ids) and torch.equal(rows, whole_rows)
    assert second.embedding_bags["t"].stats()["evicted_ids"] == whole.embedding_bags["t"].stats()["evicted_ids"] > 0


def test_bad_virtual_tables_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"table 'big'.*2\*\*40"):
        collection(tmp_path, config(num_embeddings=2**50, name="big"))
    with pytest.raises(ValueError, match="table 't'.*FeatureScoreBasedEvictionPolicy is not supported"):
        collection(tmp_path, config(policy=FeatureScoreBasedEvictionPolicy()))
    with pytest.raises(ValueError, match="table 't'.*decay_rate"):
        collection(tmp_path, config(policy=CountBasedEvictionPolicy(decay_rate=1.5)))
    with pytest.raises(ValueError, match="table 't'.*count threshold 0"):
        collection(tmp_path, config(policy=CountBasedEvictionPolicy(eviction_threshold=0)))
    with pytest.raises(ValueError, match="admit_after"):
        VirtualTableOptions(admit_after=0)
    # The ids' counts and ages come out of the memory budget: 100,000 ids of 38 bytes exceed 1 MiB.
    with pytest.raises(MemoryBudgetError, match=r"counts and ages of the ids .*'t': 3,800,000 bytes"):
        collection(tmp_path, config(policy=CountBasedEvictionPolicy(training_id_eviction_trigger_count=100_000)))
    ebc = collection(tmp_path, config(policy=None))
    for bad in (-1, SPACE):
        with pytest.raises(ValueError, match=f"id {bad} is out of range.*'t'"):
            ebc(kjt(torch.tensor([3, bad])))
    with pytest.raises(ValueError, match="no eviction policy"):
        ebc.embedding_bags["t"].evict()


def test_a_sequence_models_virtual_table_keeps_one_row_per_raw_id(tmp_path):
    from torchrec.modules.embedding_configs import EmbeddingConfig

    from mlkv_torch.torchrec import DiskEmbeddingCollection

    policy = TimestampBasedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_ttl_mins=2)
    table = EmbeddingConfig(num_embeddings=SPACE, embedding_dim=DIM, name="t", feature_names=["f"],
                            use_virtual_table=True, virtual_table_eviction_policy=policy,
                            weight_init_min=-0.1, weight_init_max=0.1)
    ec = DiskEmbeddingCollection([table], path=tmp_path / "ec", optimizer=optim.SGD(lr=0.1), seed=7,
                                 memory_budget_bytes=1 << 20, virtual_tables=STEPS_PER_MINUTE)
    bags = collection(tmp_path, config(policy=policy), virtual_tables=STEPS_PER_MINUTE)  # one id a bag: the same
    for ids in raw_batches(12, pool=100):
        out, pooled = ec(kjt(ids))["f"].values(), bags(kjt(ids)).values()
        torch.testing.assert_close(out, pooled, rtol=0, atol=0)
        for embeddings in (out, pooled):
            (embeddings * torch.linspace(-1, 1, DIM)).sum().backward()
    assert ec.stats()["t"]["evicted_ids"] == bags.embedding_bags["t"].stats()["evicted_ids"] > 0
    assert torch.equal(ec.embeddings["t"].live_ids(), bags.embedding_bags["t"].live_ids())


@pytest.mark.skipif(not __import__("mlkv_torch")._C.with_rocksdb, reason="built without RocksDB")
def test_eviction_deletes_rows_from_rocksdb_too(tmp_path):
    policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=20, eviction_threshold=3, decay_rate=1.0)
    ebc = collection(tmp_path, config(policy=policy), backend="rocksdb")
    fresh = collection(tmp_path, config(policy=policy), sub="fresh")
    batches = raw_batches(10, pool=200)
    train(ebc, batches)
    bag = ebc.embedding_bags["t"]
    assert bag.stats()["evicted_ids"] > 0
    ebc.flush()
    seen = torch.unique(torch.cat(batches))
    model = PolicyModel(bag._batch.tables[0].id_policy)
    for step, ids in enumerate(batches):
        model.before_batch(step)
        model.observe(ids, step)
    gone = seen[~torch.isin(seen, torch.tensor(model.live()))]
    # Evicted ids hold nothing in RocksDB: they read the initial rows of a table that never saw them.
    assert torch.equal(bag.export_rows(gone), fresh.embedding_bags["t"].export_rows(gone))
    assert bag._store.stats()["rows_written"] > 0


def test_an_incremental_export_since_a_cut_brings_a_copy_of_the_cut_to_the_table_now(tmp_path):
    policy = TimestampBasedEvictionPolicy(training_id_eviction_trigger_count=40, eviction_ttl_mins=100)
    ebc = collection(tmp_path, config(policy=policy), optimizer=optim.Adagrad(lr=0.1),
                     virtual_tables=VirtualTableOptions(minute_steps=1, admit_after=2, keep_fraction=1.0))
    bag = ebc.embedding_bags["t"]
    # Other ids after the cut than before: some of the first stay live untouched, others are evicted.
    batches = raw_batches(8, pool=100) + raw_batches(12, pool=400, seed=1)
    train(ebc, batches[:8])
    ebc.checkpoint()
    ids, rows = live_rows(ebc)
    copy = {i: (w, s) for i, w, s in zip(ids.tolist(), rows, bag.export_rows(ids, include_state=True)[1])}
    train(ebc, batches[8:])
    chunks, tombstones = bag.export_changes(chunk_rows=5, include_state=True)
    changed = set()
    for chunk_ids, weights, state in chunks:
        assert chunk_ids.numel() <= 5
        for i, w, s in zip(chunk_ids.tolist(), weights, state):
            copy[i] = (w, s)
            changed.add(i)
    now_ids, now_rows = live_rows(ebc)
    # Exactly the ids trained since the cut that hold rows now.
    assert changed == set(torch.cat(batches[8:]).tolist()) & set(now_ids.tolist())
    at_cut = set(copy)
    for i in tombstones.tolist():
        del copy[i]
    assert sorted(copy) == now_ids.tolist()
    assert torch.equal(torch.stack([copy[i][0] for i in now_ids.tolist()]), now_rows)
    assert torch.equal(torch.stack([copy[i][1] for i in now_ids.tolist()]),
                       bag.export_rows(now_ids, include_state=True)[1])
    # Exactly the ids the copy holds that the table no longer does: none of the ids that came after
    # the cut and went again (what follows the changes is bounded by the ids holding rows).
    assert set(tombstones.tolist()) == at_cut - set(now_ids.tolist()) and tombstones.numel() > 0
    came_and_went = set(torch.cat(batches[8:]).tolist()) - at_cut - set(now_ids.tolist())
    assert came_and_went and bag.stats()["evicted_ids"] > len(at_cut - set(now_ids.tolist()))
    with pytest.raises(ValueError, match="follows no ids"):
        collection(tmp_path, config(policy=None), sub="plain").embedding_bags["t"].export_changes()


FULL_DISK_CHILD = """
import resource, signal, sys
import torch
sys.path.insert(0, sys.argv[2])
from test_virtual_tables import collection, config, policy_of_full_disk, raw_batches, train
from pathlib import Path
from mlkv_torch import optim

ebc = collection(Path(sys.argv[1]), config(policy=policy_of_full_disk()), optimizer=optim.Adagrad(lr=0.1))
train(ebc, raw_batches(9, pool=120))
ebc.checkpoint()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # the disk is full
try:
    for seed in range(1, 400):  # new ids, far more rows than the budget holds: they go to the full disk
        train(ebc, raw_batches(1, batch=2000, pool=100_000, seed=seed))
        ebc.embedding_bags["t"].flush()
    print("NO ERROR")
except OSError as e:
    print("ERROR", type(e).__name__, e)
try:
    ebc.close()  # its last cut cannot be written either
except OSError as e:
    print("CLOSE", type(e).__name__, e)
"""


def policy_of_full_disk():
    return CountBasedEvictionPolicy(training_id_eviction_trigger_count=10_000, eviction_threshold=1, decay_rate=0.5)


def test_a_disk_that_fills_while_rows_are_created_names_its_file_and_keeps_the_last_cut(tmp_path):
    # The reference: the same table trained to its cut, never past it.
    reference = collection(tmp_path, config(policy=policy_of_full_disk()), sub="reference",
                           optimizer=optim.Adagrad(lr=0.1))
    train(reference, raw_batches(9, pool=120))
    done = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    error = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    # The store's error, naming its file under the table's directory and why.
    assert error and "File too large" in error[0] and str(tmp_path / "v") in error[0], done.stdout[-3000:]
    reopened = collection(tmp_path, config(policy=policy_of_full_disk()), optimizer=optim.Adagrad(lr=0.1),
                          reopen=True)
    ids, rows = live_rows(reopened)
    reference_ids, reference_rows = live_rows(reference)
    assert torch.equal(ids, reference_ids) and torch.equal(rows, reference_rows)
    bag, theirs = reopened.embedding_bags["t"], reference.embedding_bags["t"]
    assert torch.equal(bag.export_rows(ids, include_state=True)[1], theirs.export_rows(ids, include_state=True)[1])
    batches = raw_batches(5, pool=120, seed=9)  # and it trains on as the reference does
    assert train(reopened, batches) == train(reference, batches)


def test_an_evaluation_reads_the_rows_ids_hold_and_changes_no_id(tmp_path):
    # In eval mode a virtual table counts, admits and evicts nothing (as TorchRec profiles ids only in
    # training): ids holding rows read them, the others zeros, and the table goes on as if never read.
    policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=20, eviction_threshold=2, decay_rate=1.0)
    options = VirtualTableOptions(keep_fraction=0.5)
    ebc = collection(tmp_path, config(policy=policy), virtual_tables=options)
    reference = collection(tmp_path, config(policy=policy), sub="r", virtual_tables=options)
    batches = raw_batches(6, pool=40)
    train(ebc, batches[:3])
    train(reference, batches[:3])
    ids, rows = live_rows(ebc)
    unseen = torch.randint(0, SPACE, (30,), generator=torch.Generator().manual_seed(9))
    ebc.eval()
    with torch.no_grad():
        out = ebc(kjt(torch.cat([ids, unseen]))).values()
    ebc.train()
    assert torch.equal(out[:ids.numel()], rows) and not bool(out[ids.numel():].any())
    assert torch.equal(live_rows(ebc)[0], ids)  # nothing admitted (30 fresh ids would pass the trigger)
    assert train(ebc, batches[3:]) == train(reference, batches[3:])  # counts and ages as never read
    assert torch.equal(live_rows(ebc)[0], live_rows(reference)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_read_ahead_across_eviction_rounds_train_as_without_look_ahead(tmp_path, device):
    # Eviction rounds come between a batch's read-ahead and its lookup: the rows read ahead wait in
    # the staging area (never in cache slots, where an evicted id's row would outlive its round,
    # as it did on CUDA's default), and training is the same as without look-ahead.
    policy = CountBasedEvictionPolicy(training_id_eviction_trigger_count=30, eviction_threshold=2, decay_rate=0.9)
    batches = raw_batches(40, pool=200)
    plain = collection(tmp_path, config(policy=policy), sub="plain", device=device,
                       virtual_tables=STEPS_PER_MINUTE)
    ahead = collection(tmp_path, config(policy=policy), sub="ahead", device=device,
                       virtual_tables=STEPS_PER_MINUTE)
    expected = train(plain, batches)
    assert plain.stats()["t"]["evicted_ids"] > 0, "the rounds must evict"
    losses, token = [], ahead.lookahead(kjt(batches[0].to(device)))
    for step, ids in enumerate(batches):  # one batch ahead, as the pipeline reads
        following = ahead.lookahead(kjt(batches[step + 1].to(device))) if step + 1 < len(batches) else None
        ahead.read_ahead_next(token)
        losses.extend(train(ahead, [ids]))
        token = following
    assert ahead.stats()["t"]["read_ahead_rows"] > 0
    assert losses == expected
    with pytest.raises(ValueError, match="virtual tables .* read ahead into the staging area"):
        collection(tmp_path, config(policy=policy), sub="slots", read_ahead_into_slots=True)
