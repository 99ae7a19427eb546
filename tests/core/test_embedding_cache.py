"""DiskEmbeddingBag's hot cache, asynchronous updates and staleness bound, weight dtypes,
lookahead, and the gradient of per_sample_weights (gradcheck in double)."""

from pathlib import Path

import pytest
import torch

from mlkv_torch import DiskEmbeddingBag, optim
from conftest import rounding_tolerance
from test_disk_embedding_bag import DIM, NUM, STEP_BOUNDS, batch, make, reference_like


def zipf_batches(count, ids_per_batch, num, exponent=1.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    scatter = torch.randperm(num, generator=g)  # hot ids spread over the id space
    for _ in range(count):
        yield scatter[torch.multinomial(probs, ids_per_batch, replacement=True, generator=g)]


def test_staleness_bound_is_exact_with_a_held_applier(tmp_path):
    emb = make(tmp_path, cache_rows=50, staleness=2, optimizer=optim.SGD(lr=0.5))
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0])
    before = emb.export_rows(ids)
    emb._cache.pause_applier(True)
    first = emb(ids, offsets)
    first.sum().backward()  # update 1 queued, held
    torch.testing.assert_close(emb(ids, offsets), first, rtol=0, atol=0)  # misses 1 update: allowed
    emb(ids, offsets).sum().backward()  # update 2 queued
    third = emb(ids, offsets)  # misses 2 updates: allowed at staleness 2
    torch.testing.assert_close(third, first, rtol=0, atol=0)
    assert emb.stats()["max_staleness"] == 2 and emb.stats()["pending_updates"] == 2
    third.sum().backward()  # update 3 queued: a read now would miss 3
    with pytest.raises(RuntimeError, match="paused"):
        emb(ids, offsets)
    emb._cache.pause_applier(False)
    fourth = emb(ids, offsets)  # waits until at most 2 are queued
    assert not torch.equal(fourth, first)
    assert emb.stats()["max_staleness"] == 2
    emb.flush()
    # sum of one bag: each row's gradient is 1 per step, whatever it read; no update is lost.
    torch.testing.assert_close(emb.export_rows(ids), before - 0.5 - 0.5 - 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("staleness", [1, 4])
def test_asynchronous_updates_lose_nothing_and_respect_the_bound(tmp_path, staleness):
    # With SGD and a loss linear in the pooled rows the gradient does not depend on the weights
    # read, so any staleness must end at the reference weights once every update is applied.
    emb = make(tmp_path, cache_rows=8, staleness=staleness, optimizer=optim.SGD(lr=0.3))
    ref = reference_like(emb, sparse=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for step in range(40):
        ids, offsets, target = batch(step % 12, bags=32)
        (emb(ids, offsets) * target).sum().backward()
        ref_opt.zero_grad()
        (ref(ids, offsets) * target).sum().backward()
        ref_opt.step()
        assert emb.stats()["max_staleness"] <= staleness
    emb.flush()
    assert emb.stats()["pending_updates"] == 0
    # torch's coalesce sums a repeated id's gradients in its own order
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), ref.weight.detach(),
                               **rounding_tolerance(40, 0.3, STEP_BOUNDS["sgd"]))


def test_frequency_admission_beats_lru_on_zipf(tmp_path):
    rates = {}
    for policy in ("lfu", "lru"):
        emb = DiskEmbeddingBag(20_000, 8, path=tmp_path / policy, cache_rows=1_000, memory_budget_bytes=1 << 20,
                               cache_policy=policy)
        with torch.no_grad():
            for ids in zipf_batches(60, 2_000, 20_000):
                emb(ids, torch.tensor([0]))
        stats = emb.stats()
        assert stats["cached_rows"] <= 1_000
        rates[policy] = stats["hit_rate"]
    assert rates["lfu"] > rates["lru"] + 0.02, rates


def test_cache_never_exceeds_its_rows_and_dirty_rows_survive_reopen(tmp_path):
    emb = make(tmp_path, cache_rows=20, optimizer=optim.Adagrad(lr=0.2))
    for step in range(10):
        ids, offsets, target = batch(step, bags=40)  # ~120 distinct ids per batch, 20 cached
        (emb(ids, offsets) * target).sum().backward()
        assert emb.stats()["cached_rows"] <= 20
    trained = emb.export_rows(torch.arange(NUM))
    assert emb.stats()["evictions"] > 0
    emb.close()  # writes the dirty cached rows back
    again = make(tmp_path, cache_rows=20, optimizer=optim.Adagrad(lr=0.2), reopen=True)
    torch.testing.assert_close(again.export_rows(torch.arange(NUM)), trained, rtol=0, atol=0)


@pytest.mark.parametrize("depth", [1, 3])
def test_lookahead_changes_nothing_at_staleness_zero(tmp_path, depth):
    # Rows staged ahead are updated by the batches in between: their staged copies must not be served.
    # A budget whose staging area (a sixteenth) holds the rows of the batches read ahead.
    plain = make(tmp_path, "plain", cache_rows=10, optimizer=optim.RowWiseAdagrad(lr=0.1), memory_budget_bytes=1 << 20)
    ahead = make(tmp_path, "ahead", cache_rows=10, optimizer=optim.RowWiseAdagrad(lr=0.1), memory_budget_bytes=1 << 20)
    batches = [batch(step % 5, bags=24) for step in range(15)]
    for ids, _, _ in batches[:depth]:
        ahead.lookahead(ids)
    for step, (ids, offsets, target) in enumerate(batches):
        if step + depth < len(batches):
            ahead.lookahead(batches[step + depth][0])
        (plain(ids, offsets) * target).sum().backward()
        (ahead(ids, offsets) * target).sum().backward()
    torch.testing.assert_close(ahead.export_rows(torch.arange(NUM)), plain.export_rows(torch.arange(NUM)),
                               rtol=0, atol=0)
    stats = ahead.stats()
    assert stats["read_ahead_rows"] > 0 and stats["read_ahead_hits"] > 0, stats
    assert stats["store_reads"] + stats["fresh_rows"] < plain.stats()["store_reads"] + plain.stats()["fresh_rows"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tables(tmp_path, dtype):
    emb = make(tmp_path, cache_rows=30, dtype=dtype, optimizer=optim.SGD(lr=0.3))
    weights = emb.export_rows(torch.arange(NUM))
    assert weights.dtype == dtype
    ref = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", _weight=weights.clone())
    ids, offsets, _ = batch(0)
    out = emb(ids, offsets)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref(ids, offsets), rtol=0, atol=0)
    # Training follows the float32 reference within the weights' precision.
    ref32 = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=True, _weight=weights.float())
    opt32 = torch.optim.SGD(ref32.parameters(), lr=0.3)
    for step in range(6):
        ids, offsets, target = batch(step)
        (emb(ids, offsets).float() * target).sum().backward()
        opt32.zero_grad()
        (ref32(ids, offsets) * target).sum().backward()
        opt32.step()
    tolerance = 2e-2 if dtype == torch.float16 else 1e-1
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)).float(), ref32.weight.detach(),
                               rtol=tolerance, atol=tolerance)


def test_gradcheck_of_per_sample_weights_in_double(tmp_path):
    emb = make(tmp_path, cache_rows=30, dtype=torch.float64).requires_grad_(False)  # frozen: rows stay put
    ids, offsets, _ = batch(5)
    psw = torch.rand(ids.numel(), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: emb(ids, offsets, w), (psw,))
    assert emb.stats()["updates_applied"] == 0


def test_frozen_table_is_not_updated(tmp_path):
    emb = make(tmp_path, cache_rows=30)
    before = emb.export_rows(torch.arange(NUM))
    emb.requires_grad_(False)
    ids, offsets, _ = batch(1)
    psw = torch.rand(ids.numel(), requires_grad=True)
    emb(ids, offsets, psw).sum().backward()
    assert psw.grad is not None
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), before, rtol=0, atol=0)


def test_stats_report_the_cache(tmp_path):
    emb = make(tmp_path, cache_rows=30)
    ids = torch.tensor([1, 2, 3, 1])
    emb(ids, torch.tensor([0])).sum().backward()
    emb(ids, torch.tensor([0])).sum().backward()
    stats = emb.stats()
    assert stats["cache_misses"] == 3 and stats["cache_hits"] == 3
    assert stats["fresh_rows"] == 3 and stats["step"] == 2 and stats["cached_rows"] == 3
    emb.flush()
    assert emb.stats()["pending_updates"] == 0 and emb.stats()["written_back"] == 3


def test_bad_cache_configuration(tmp_path):
    with pytest.raises(ValueError, match="store needs"):  # the logs and buffers fit, the cache asked for does not
        DiskEmbeddingBag(NUM, DIM, path=tmp_path / "a", cache_rows=NUM, memory_budget_bytes=48 << 10)
    with pytest.raises(ValueError, match="cannot hold the stores' logs .* use at least"):
        DiskEmbeddingBag(NUM, DIM, path=tmp_path / "a", cache_rows=0, memory_budget_bytes=32 << 10)
    with pytest.raises(ValueError, match="cache_policy"):
        DiskEmbeddingBag(NUM, DIM, path=tmp_path / "b", cache_policy="fifo")
    with pytest.raises(ValueError, match="staleness"):
        DiskEmbeddingBag(NUM, DIM, path=tmp_path / "c", staleness=-1)
    with pytest.raises(TypeError, match="dtype"):
        DiskEmbeddingBag(NUM, DIM, path=tmp_path / "d", dtype=torch.int8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            DiskEmbeddingBag(NUM, DIM, path=tmp_path / "e", device="cuda")


def test_threads_training_one_table_lose_no_update(tmp_path):
    import threading

    emb = make(tmp_path, cache_rows=16, staleness=1, optimizer=optim.SGD(lr=0.1))
    ref = reference_like(emb, sparse=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [batch(step, bags=24) for step in range(24)]
    errors = []

    def train(part):
        try:
            for ids, offsets, target in batches[part::3]:
                (emb(ids, offsets) * target).sum().backward()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(part,)) for part in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for ids, offsets, target in batches:  # gradients do not depend on the weights: order is free
        ref_opt.zero_grad()
        (ref(ids, offsets) * target).sum().backward()
        ref_opt.step()
    # the threads' updates of a row land in another order than the reference's, each rounded
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), ref.weight.detach(),
                               **rounding_tolerance(24, 0.1, STEP_BOUNDS["sgd"]))


FULL_DISK_CHILD = """
import os, resource, signal, sys, torch
from mlkv_torch import DiskEmbeddingBag, optim
emb = DiskEmbeddingBag(1_000_000, 32, path=sys.argv[1], cache_rows=64, memory_budget_bytes=64 << 10,
                       staleness=2, optimizer=optim.SGD(lr=0.1))
ids = torch.arange(500)
emb(ids, torch.tensor([0])).sum().backward()
emb.flush(); emb._store.checkpoint()
saved = emb.export_rows(ids)
torch.save(saved, sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
error = None
for step in range(400):
    try:
        fresh = torch.arange(1000 + 2000 * step, 3000 + 2000 * step)
        emb(fresh, torch.tensor([0])).sum().backward()
    except OSError as e:
        error = e
        break
assert error is not None, "the file size limit never hit"
print("ERROR", type(error).__name__, str(error))
try:
    emb(ids, torch.tensor([0]))
    print("AGAIN no error")
except OSError as e:
    print("AGAIN", type(e).__name__)
sys.stdout.flush()
os._exit(0)
"""


def test_write_failure_in_the_applier_is_raised_and_the_checkpoint_survives(tmp_path):
    import subprocess
    import sys

    path, saved = str(tmp_path / "t"), str(tmp_path / "saved.pt")
    result = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, path, saved], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    error = next(line for line in lines if line.startswith("ERROR"))
    assert "File too large" in error and "segment-" in error, error
    assert "AGAIN StoreIOError" in lines, lines  # the applier's error stays raised
    emb = DiskEmbeddingBag(1_000_000, 32, path=path, cache_rows=64, memory_budget_bytes=64 << 10, reopen=True)
    torch.testing.assert_close(emb.export_rows(torch.arange(500)), torch.load(saved), rtol=0, atol=0)


EVICTION_FAILURE_CHILD = """
import os, resource, signal, sys, torch
from mlkv_torch import DiskEmbeddingBag, optim
emb = DiskEmbeddingBag(1_000_000, 32, path=sys.argv[1], cache_rows=256, memory_budget_bytes=256 << 10,
                       optimizer=optim.SGD(lr=0.1), cache_policy="lru")  # LRU admits all: dirty rows get evicted
start = emb.export_rows(torch.arange(20000))
expected = start.clone()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
for step in range(400):
    ids = torch.arange(50 * step, 50 * step + 200) % 20000
    try:
        emb(ids, torch.tensor([0])).sum().backward()
    except OSError as e:
        print("ERROR", e)
        break
    expected[ids] -= 0.1  # one rounding a step, as the fused rule's
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
torch.testing.assert_close(emb.export_rows(torch.arange(20000)), expected, rtol=0, atol=0)
print("INTACT")
sys.stdout.flush()
os._exit(0)
"""


def test_failed_write_back_on_eviction_loses_no_row(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", EVICTION_FAILURE_CHILD, str(tmp_path / "t")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "File too large" in result.stdout and "INTACT" in result.stdout, result.stdout


EXIT_CHILD = """
import sys, torch
from mlkv_torch import DiskEmbeddingBag, optim
emb = DiskEmbeddingBag(1000, 8, path=sys.argv[1], cache_rows=100, memory_budget_bytes=1 << 20, staleness=1,
                       optimizer=optim.SGD(lr=1.0))
emb(torch.tensor([3, 4]), torch.tensor([0])).sum().backward()
torch.save(emb.export_rows(torch.tensor([3, 4])), sys.argv[2])
emb(torch.tensor([3]), torch.tensor([0])).sum().backward()  # still queued at exit
"""


def test_exit_without_close_writes_the_cache_back(tmp_path):
    import subprocess
    import sys

    path, saved = str(tmp_path / "t"), str(tmp_path / "rows.pt")
    result = subprocess.run([sys.executable, "-c", EXIT_CHILD, path, saved], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "terminate" not in result.stderr, result.stderr
    emb = DiskEmbeddingBag(1000, 8, path=path, cache_rows=100, memory_budget_bytes=1 << 20, reopen=True)
    expected = torch.load(saved)
    expected[0] -= 1.0  # the update queued at exit was applied and written back
    torch.testing.assert_close(emb.export_rows(torch.tensor([3, 4])), expected, rtol=0, atol=0)


def test_a_billion_row_table_opens_at_once(tmp_path):
    emb = DiskEmbeddingBag(1_000_000_000, 16, path=tmp_path / "big", memory_budget_bytes=8 << 20)
    ids = torch.tensor([0, 999_999_999, 123_456_789])
    out = emb(ids, torch.tensor([0, 1]))
    bound = (1.0 / 1_000_000_000) ** 0.5
    assert out.shape == (2, 16) and float(out.detach().abs().max()) <= 2 * bound
    out.sum().backward()
    emb.flush()
    assert emb.stats()["rows"] == 3  # only the rows written take space


def test_rows_kept_out_of_the_cache_are_not_read_ahead_hits(tmp_path):
    """A row the policy keeps out waits in the staging area for its batch's update; taking it there
    is not a lookahead's hit (with no lookahead there are none)."""
    emb = make(tmp_path, cache_rows=8)
    ids, offsets = torch.arange(64), torch.tensor([0])  # more distinct rows than the cache holds
    for _ in range(3):
        emb(ids, offsets).sum().backward()
    emb.flush()
    stats = emb.stats()
    assert stats["rejected"] > 0 and stats["read_ahead_hits"] == stats["read_ahead_rows"] == 0
    emb.lookahead(torch.arange(64, 128))  # rows read ahead are, once a fetch takes them
    emb(torch.arange(64, 128), offsets).sum().backward()
    assert emb.stats()["read_ahead_hits"] > 0
    emb.close()


def test_a_fetch_reads_the_few_rows_a_later_lookahead_holds_itself(tmp_path):
    """A fetch whose batch shares a few rows with a look-ahead queued after its own (the next
    batch's) reads those rows itself instead of waiting for that whole request; the rows are right,
    and after their update (kept out of a full, hot cache, so read from outside it again) the next
    fetch gets the updated rows, never the look-ahead's older copies."""
    num = 200_000
    emb = DiskEmbeddingBag(num, 8, path=tmp_path / "t", mode="sum", cache_rows=64, memory_budget_bytes=4 << 20,
                           seed=0, optimizer=optim.SGD(lr=0.5))
    emb.populate()
    offsets = torch.tensor([0])
    for _ in range(4):  # the cache fills with rows seen four times: a row seen once is kept out
        emb(torch.arange(64), offsets).sum().backward()
    wanted = torch.tensor([101, 150_001])
    rows = emb.export_rows(wanted)
    expected = rows.sum(0, keepdim=True)
    rejected = emb.stats()["rejected"]
    emb.lookahead(torch.arange(0, num, 4))  # 50,000 rows, none of the batch's
    emb.lookahead(torch.arange(1, num, 4))  # queued behind it: 50,000 rows, 2 of them the batch's
    out = emb(wanted, offsets)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert emb.stats()["read_ahead_wait_ms"] == 0  # with the old rule it waited for 100,000 reads
    assert emb.stats()["rejected"] == rejected + 2
    out.sum().backward()  # each row: -0.5 per element, written back outside the cache
    torch.testing.assert_close(emb(wanted, offsets), (rows - 0.5).sum(0, keepdim=True), rtol=0, atol=0)
    emb.close()


def run_lifetime_worker(mode: str, path) -> None:
    import subprocess
    import sys

    worker = Path(__file__).parents[1] / "workers" / "cache_lifetime_worker.py"
    result = subprocess.run([sys.executable, worker, mode, str(path)], capture_output=True, text=True, timeout=300)
    # A child ended by a signal (an abort) has a negative return code.
    assert result.returncode == 0 and "terminate" not in result.stderr, (result.returncode, result.stderr[-3000:])


def test_a_thread_that_cannot_start_fails_the_cache_with_an_exception(tmp_path):
    # The threads started before the failing one are stopped and joined (none is left joinable to abort the process).
    run_lifetime_worker("thread_start_fails", tmp_path)


@pytest.mark.parametrize("mode", ["drop_in_thread", "drop_in_daemon_at_exit", "left_at_exit"])
def test_a_cache_dropped_on_any_thread_or_at_exit_writes_its_rows_back(tmp_path, mode):
    from mlkv_torch import KVStore

    path = tmp_path / "t"
    run_lifetime_worker(mode, path)
    rows, dim = 100_000, 16  # as the worker trains them: every row once, from 0 to -1
    with KVStore(path, dim, torch.float32, 64 << 20, expected_rows=rows) as store:
        torch.testing.assert_close(store.get(torch.arange(rows)), torch.full((rows, dim), -1.0), rtol=0, atol=0)
