"""DiskEmbeddingBag against torch.nn.EmbeddingBag and the matching torch optimizer, staleness 0:
modes x per_sample_weights x optimizers x cache sizes x devices (CUDA skips without a GPU)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from mlkv_torch import DiskEmbeddingBag, optim
from mlkv_torch.memory_budget import host_memory_for_cache, least_host_memory
from mlkv_torch.row_layout import row_bytes

from conftest import rounding_tolerance

NUM, DIM = 300, 32
CACHES = {"none": 0, "tiny": 8, "medium": 100, "whole": NUM}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def row_bytes_of(optimizer, dim: int = DIM, itemsize: int = 4) -> int:
    if not isinstance(optimizer, optim.SparseOptimizer):  # a bad one, which the table refuses: sized as SGD
        optimizer = optim.SGD()
    return row_bytes(dim, {2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize], optimizer)


def budget_for(cache_rows: int, optimizer, dim: int = DIM, itemsize: int = 4) -> int:
    """The smallest memory budget that holds a cache of `cache_rows` rows (with its index), the
    staging area and write-back buffer, and the store's smallest log: the disk path runs."""
    return host_memory_for_cache(1, NUM, row_bytes_of(optimizer, dim, itemsize), cache_rows)


def make(tmp_path, name="t", cache_rows=0, device="cpu", **kwargs):
    itemsize = kwargs.get("dtype", torch.float32).itemsize
    optimizer = kwargs.get("optimizer") or optim.SGD()
    # On a GPU the cache is in device memory: the least host budget leaves the store its smallest
    # log (4 pages, far below the touched rows), so the disk path runs there too.
    kwargs.setdefault("memory_budget_bytes", least_host_memory(1, NUM, row_bytes_of(optimizer, itemsize=itemsize))
                      if device != "cpu" else budget_for(cache_rows, optimizer, itemsize=itemsize))
    kwargs.setdefault("seed", 0)  # bags built alike start alike
    return DiskEmbeddingBag(NUM, DIM, path=tmp_path / name, cache_rows=cache_rows, device=device, **kwargs)


def reference_like(emb: DiskEmbeddingBag, **kwargs) -> torch.nn.EmbeddingBag:
    weight = emb.export_rows(torch.arange(NUM)).to(emb.device)
    return torch.nn.EmbeddingBag(NUM, DIM, mode=emb.mode, _weight=weight, device=emb.device, **kwargs)


def batch(step, bags=16, max_len=6):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, max_len + 1, (bags,), generator=g)  # some bags empty
    ids = torch.randint(0, NUM, (int(lengths.sum()),), generator=g)
    if ids.numel() > 3:
        ids[:3] = 7  # repeated ids
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return ids, offsets, torch.randn(bags, DIM, generator=g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", ["none", "medium"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_forward_equals_embedding_bag(tmp_path, mode, cache, device):
    emb = make(tmp_path, mode=mode, cache_rows=CACHES[cache], device=device)
    ref = reference_like(emb)
    for step in range(5):
        ids, offsets, _ = batch(step)
        torch.testing.assert_close(emb(ids, offsets), ref(ids.to(device), offsets.to(device)), rtol=0, atol=0)
    two_d = torch.randint(0, NUM, (5, 3))
    torch.testing.assert_close(emb(two_d), ref(two_d.to(device)), rtol=0, atol=0)


def test_forward_per_sample_weights_and_include_last_offset(tmp_path):
    emb = make(tmp_path, include_last_offset=True)
    ref = reference_like(emb, include_last_offset=True)
    ids, offsets, _ = batch(1)
    offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
    psw = torch.rand(ids.numel())
    torch.testing.assert_close(emb(ids, offsets, psw), ref(ids, offsets, psw), rtol=0, atol=0)


class RowWiseAdagradReference(torch.optim.Optimizer):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD on a coalesced sparse gradient, in plain torch."""

    def __init__(self, params, lr, eps=1e-8):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                acc = self.state[p].setdefault("sum", torch.zeros(p.shape[0], device=p.device, dtype=p.dtype))
                acc.index_add_(0, rows, values.pow(2).mean(dim=1))
                p.index_add_(0, rows, -group["lr"] * values / (acc[rows].sqrt() + group["eps"]).unsqueeze(1))


OPTIMIZERS = {
    "sgd": (optim.SGD(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "adagrad": (optim.Adagrad(lr=0.2, initial_accumulator_value=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.1)),
    "rowwise_adagrad": (optim.RowWiseAdagrad(lr=0.2), lambda p: RowWiseAdagradReference(p, lr=0.2)),
    "adam": (optim.Adam(lr=0.05), lambda p: torch.optim.SparseAdam(p, lr=0.05)),
}
# Per optimizer, a bound on one step's update over lr: SGD's gradient row (at most 5 ids of a batch x
# |target| <= 5), Adagrad's g / sqrt(sum g^2) <= 1, row-wise Adagrad's <= sqrt(DIM), Adam's bias-corrected
# m / sqrt(v) <= (1 - beta1) / sqrt(1 - beta2) < 4.
STEP_BOUNDS = {"sgd": 25.0, "adagrad": 1.0, "rowwise_adagrad": DIM ** 0.5, "adam": 4.0}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)],
                         ids=["sum", "sum-weighted", "mean"])
def test_training_reaches_the_reference_weights(tmp_path, mode, weighted, optimizer, cache, device):
    ours, reference = OPTIMIZERS[optimizer]
    emb = make(tmp_path, mode=mode, optimizer=ours, cache_rows=CACHES[cache], device=device)
    ref = reference_like(emb, sparse=True)
    ref_opt = reference(list(ref.parameters()))
    for step in range(12):
        ids, offsets, target = batch(step)
        psw = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(100 + step)) if weighted else None
        target = target.to(device)
        (emb(ids, offsets, psw) * target).sum().backward()
        ref_opt.zero_grad()
        on_device = [t.to(device) if t is not None else None for t in (ids, offsets, psw)]
        (ref(*on_device) * target).sum().backward()
        ref_opt.step()
        assert emb.stats()["cached_rows"] <= CACHES[cache]
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), ref.weight.detach().cpu(),
                               **rounding_tolerance(12, ours.lr, STEP_BOUNDS[optimizer]))
    stats = emb.stats()
    if cache in ("none", "tiny"):
        assert stats["disk_rows"] > 0, "the store's budget was meant to push rows to disk"
    if cache == "tiny":
        assert stats["evictions"] > 0 and stats["written_back"] > 0, "dirty rows should leave the cache"
    assert stats["max_staleness"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_float64_rows_of_an_odd_number_of_words(tmp_path, optimizer, device):
    # Row-wise Adagrad's one state word (or Adagrad's, at an odd dim) leaves float64 weights of
    # every other cached row 4-byte aligned only: the GPU's update must still read them.
    ours, reference = OPTIMIZERS[optimizer]
    dim = 5
    emb = DiskEmbeddingBag(NUM, dim, path=tmp_path / "t", optimizer=ours, dtype=torch.float64, cache_rows=100,
                           memory_budget_bytes=1 << 20, device=device)
    ref = torch.nn.EmbeddingBag(NUM, dim, mode="sum", sparse=True, dtype=torch.float64, device=device,
                                _weight=emb.export_rows(torch.arange(NUM)).to(device))
    ref_opt = reference(list(ref.parameters()))
    for step in range(6):
        ids, offsets, target = batch(step)
        target = target[:, :dim].to(device, torch.float64)
        (emb(ids, offsets) * target).sum().backward()
        ref_opt.zero_grad()
        (ref(ids.to(device), offsets.to(device)) * target).sum().backward()
        ref_opt.step()
    # The rules compute in float32 (as for 16-bit weights): agreement to float32 rounding.
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), ref.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    emb.close()


def test_gradient_of_per_sample_weights(tmp_path):
    emb = make(tmp_path, optimizer=optim.SGD(lr=0.1))
    ref = reference_like(emb)
    ids, offsets, target = batch(3)
    psw = torch.rand(ids.numel(), requires_grad=True)
    psw_ref = psw.detach().clone().requires_grad_(True)
    (emb(ids, offsets, psw) * target).sum().backward()
    (ref(ids, offsets, psw_ref) * target).sum().backward()
    # Each is a dot product of the bag's output gradient and the id's row, which torch's BLAS sums in
    # another order: at most DIM roundings of the sum of the terms' magnitudes apart.
    bag_of = torch.searchsorted(offsets, torch.arange(ids.numel()), right=True) - 1
    magnitude = (target[bag_of].abs() * ref.weight.detach()[ids].abs()).sum(1)
    assert ((psw.grad - psw_ref.grad).abs() <= DIM * 2**-24 * magnitude).all()


def test_no_grad_updates_nothing_and_rows_are_deterministic(tmp_path):
    emb = make(tmp_path, seed=3)
    before = emb.export_rows(torch.arange(NUM))
    with torch.no_grad():
        emb(torch.tensor([1, 2, 3]), torch.tensor([0]))
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), before, rtol=0, atol=0)
    other = DiskEmbeddingBag(NUM, DIM, path=tmp_path / "other", seed=3)
    torch.testing.assert_close(other.export_rows(torch.arange(NUM)), before, rtol=0, atol=0)


def test_reopen_and_independent_tables(tmp_path):
    a = make(tmp_path, "a", optimizer=optim.Adagrad(lr=0.5))
    b = make(tmp_path, "b", optimizer=optim.Adagrad(lr=0.5))
    ids, offsets, target = batch(4)
    (a(ids, offsets) * target).sum().backward()
    trained = a.export_rows(torch.arange(NUM))
    assert not torch.equal(trained, b.export_rows(torch.arange(NUM)))
    a.close()
    again = make(tmp_path, "a", optimizer=optim.Adagrad(lr=0.5), reopen=True)
    torch.testing.assert_close(again.export_rows(torch.arange(NUM)), trained, rtol=0, atol=0)


def test_a_table_reopens_with_a_smaller_budget_than_it_was_created_with(tmp_path):
    from mlkv_torch import KVStore
    from mlkv_torch.memory_budget import cache_host_bytes, buffer_host_bytes

    # Created with 64 MiB: the store's log has 1 MiB pages and keeps four in memory, whatever the budget after.
    big = make(tmp_path, optimizer=optim.Adagrad(lr=0.5), memory_budget_bytes=64 << 20)
    ref = reference_like(big)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.5)
    for step in range(3):
        ids, offsets, target = batch(step)
        (big(ids, offsets) * target).sum().backward()
        ref_opt.zero_grad()
        (ref(ids, offsets) * target).sum().backward()
        ref_opt.step()
    big.close()
    least = KVStore.minimum_memory_bytes(tmp_path / "t")
    assert least == 4 << 20
    # Reopened with 6 MiB, where a new store's log would get an eighth: this one keeps its four pages,
    # within the budget.
    budget = 6 << 20
    small = make(tmp_path, optimizer=optim.Adagrad(lr=0.5), memory_budget_bytes=budget, reopen=True)
    log_bytes = small.stats()["log_memory_bytes"]
    row = 4 * (DIM + optim.Adagrad().state_dim(DIM))
    assert least <= log_bytes
    assert log_bytes + cache_host_bytes(small.cache_rows, row) + \
        buffer_host_bytes(small._batch.staging_rows, small._batch.write_back_rows, row) <= budget
    for step in range(3, 8):  # training goes on exactly where it stopped
        ids, offsets, target = batch(step)
        out = small(ids, offsets)
        # torch's Adagrad rounds its sqrt differently (see rounding_tolerance)
        torch.testing.assert_close(out, ref(ids, offsets), **rounding_tolerance(step, 0.5 * 6, 1.0))
        (out * target).sum().backward()
        ref_opt.zero_grad()
        (ref(ids, offsets) * target).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(small.export_rows(torch.arange(NUM)), ref.weight.detach(),
                               **rounding_tolerance(8, 0.5, 1.0))
    small.close()
    with pytest.raises(ValueError, match="log pages of the budget it was created with.*use at least"):
        make(tmp_path, optimizer=optim.Adagrad(lr=0.5), memory_budget_bytes=least, reopen=True)


def test_import_rows(tmp_path):
    emb = make(tmp_path)
    weights = torch.randn(4, DIM)
    emb.import_rows(torch.tensor([0, 5, 9, 299]), weights)
    torch.testing.assert_close(emb.export_rows(torch.tensor([9, 0])), weights[[2, 0]], rtol=0, atol=0)


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e(torch.tensor([0, 300]), torch.tensor([0])), ValueError, "out of range"),
    (lambda e: e(torch.tensor([-1]), torch.tensor([0])), ValueError, "out of range"),
    (lambda e: e(torch.tensor([0.5]), torch.tensor([0])), TypeError, "int64"),
    (lambda e: e(torch.tensor([1, 2]), torch.tensor([0, 3])), ValueError, "offsets"),
    (lambda e: e(torch.tensor([1, 2]), torch.tensor([1, 0])), ValueError, "offsets"),
    (lambda e: e(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3)), ValueError, "per_sample_weights"),
    (lambda e: e(torch.tensor([1, 2])), ValueError, "offsets are required"),
])
def test_bad_input_is_refused_and_writes_nothing(tmp_path, call, error, match):
    emb = make(tmp_path)
    before = emb.export_rows(torch.arange(NUM))
    with pytest.raises(error, match=match):
        call(emb)
    torch.testing.assert_close(emb.export_rows(torch.arange(NUM)), before, rtol=0, atol=0)


def test_a_closed_table_refuses_every_operation_by_name(tmp_path):
    # Rows still cached were once read after close (and imported rows lost with a line on stderr).
    emb = make(tmp_path, name="closed_t", cache_rows=NUM)
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    out = emb(ids, offsets)  # cached now
    emb.close()
    for call in (lambda: emb(ids, offsets), lambda: emb.import_rows(ids, torch.zeros(3, DIM)),
                 lambda: emb.export_rows(ids), lambda: emb.lookahead(ids)):
        with pytest.raises(ValueError, match="table 'closed_t' is closed"):
            call()
    with pytest.raises(ValueError, match="table 'closed_t' is closed"):  # the step of a batch pooled before
        out.sum().backward()


def test_bad_configuration(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        make(tmp_path, mode="max")
    with pytest.raises(ValueError, match="per_sample_weights"):
        make(tmp_path, "m", mode="mean")(torch.tensor([1]), torch.tensor([0]), torch.ones(1))
    with pytest.raises(TypeError, match="optimizer"):
        make(tmp_path, "o", optimizer=torch.optim.SGD)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike .* got NoneType"):
        DiskEmbeddingBag(NUM, DIM, path=None)
    # A cache asked for beyond the table's rows holds the table, and takes no memory for more.
    assert DiskEmbeddingBag(NUM, DIM, path=tmp_path / "big", cache_rows=10 * NUM).cache_rows == NUM


def test_the_budget_holds_the_staging_area_and_the_write_back_buffer(tmp_path):
    from mlkv_torch.memory_budget import buffer_host_bytes, split_host_memory

    row = 4 * (DIM + optim.Adagrad().state_dim(DIM))
    smallest = budget_for(0, optim.Adagrad())
    with pytest.raises(ValueError, match=f"stores' logs .* staging area and write-back buffer .* at least {smallest}$"):
        make(tmp_path, "small", optimizer=optim.Adagrad(), memory_budget_bytes=smallest - 1)
    make(tmp_path, "fits", optimizer=optim.Adagrad(), memory_budget_bytes=smallest).close()
    # staging_bytes sets both buffers' rows, inside the budget: the cache gets what is left.
    budget = 1 << 20
    default, explicit = (split_host_memory(budget, 1, NUM, row, True, staging_bytes=staging)
                         for staging in (None, 200 * row))
    assert explicit.staging_rows == 200 and default.staging_rows > 200
    assert explicit.write_back_rows == default.write_back_rows
    assert buffer_host_bytes(default.staging_rows, 0, row) <= budget // 8 < \
        buffer_host_bytes(default.staging_rows + 1, 0, row)
    assert explicit.cache_rows >= default.cache_rows
    emb = DiskEmbeddingBag(NUM, DIM, path=tmp_path / "explicit", optimizer=optim.Adagrad(), memory_budget_bytes=budget,
                           staging_bytes=200 * row)
    assert emb.cache_rows == explicit.cache_rows == NUM  # every row still fits
    emb.close()


def test_empty_batch(tmp_path):
    emb = make(tmp_path)
    out = emb(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]))
    torch.testing.assert_close(out, torch.zeros(2, DIM), rtol=0, atol=0)
    out.sum().backward()  # nothing to update, nothing fails


@pytest.mark.parametrize("backend", ["mlkv", pytest.param("rocksdb", marks=pytest.mark.skipif(
    not __import__("mlkv_torch")._C.with_rocksdb, reason="built without RocksDB"))])
def test_populate_writes_every_row_and_changes_none(tmp_path, backend):
    emb = make(tmp_path, optimizer=optim.Adagrad(lr=0.2), backend=backend)
    ids, offsets, target = batch(0)
    (emb(ids, offsets) * target).sum().backward()  # some rows trained, the rest never written
    before = emb.export_rows(torch.arange(NUM), include_state=True)
    emb.populate()
    stats = emb.stats()
    assert stats.get("rows", stats.get("rows_written")) >= NUM
    for got, expected in zip(emb.export_rows(torch.arange(NUM), include_state=True), before):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    fresh_before = emb.stats()["fresh_rows"]
    emb.export_rows(torch.arange(NUM))
    assert emb.stats()["fresh_rows"] == fresh_before, "after populate no row is generated: all come from the store"


def test_populate_leaves_the_process_within_its_budget(tmp_path):
    # In a fresh process: a suite's earlier tests leave free heap that a populate would reuse unseen.
    # 2M rows of 68 bytes (136 MiB on disk) through a 4 MiB budget: the chunks a populate passes and
    # what its merges free must not stay with the process (they did: +117 MiB).
    script = textwrap.dedent(f"""
        import torch
        from mlkv_torch import DiskEmbeddingBag, optim

        def anon():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

        emb = DiskEmbeddingBag(2_000_000, 16, path={str(tmp_path / "t")!r}, optimizer=optim.RowWiseAdagrad(lr=0.1),
                               memory_budget_bytes=4 << 20, seed=1)
        before = anon()
        emb.populate()
        print((anon() - before) >> 20, emb.stats()["base_merges"])
        emb.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    grown_mib, merges = (int(v) for v in out.stdout.split())
    assert merges > 0, "the rows must have gone through merges into the base"
    assert grown_mib < 4 + 32, f"populate left {grown_mib} MiB of anonymous memory (budget 4 MiB)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_reset_parameters_returns_every_row_to_a_fresh_tables(tmp_path, dtype):
    emb = make(tmp_path, "a", optimizer=optim.Adagrad(lr=0.5), cache_rows=20, dtype=dtype, seed=9)
    fresh = make(tmp_path, "b", optimizer=optim.Adagrad(lr=0.5), dtype=dtype, seed=9)
    for step in range(3):
        ids, offsets, target = batch(step)
        (emb(ids, offsets) * target.to(dtype)).sum().backward()
    emb.reset_parameters()
    everything = torch.arange(NUM)
    for ours, start in zip(emb.export_rows(everything, include_state=True),
                           fresh.export_rows(everything, include_state=True)):
        torch.testing.assert_close(ours, start, rtol=0, atol=0)
