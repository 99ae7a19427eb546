"""bench_store.py's systems: mlkv_torch.KVStore, RocksDB (rocksdict) and LMDB behind one batched
interface (a [B] int64 tensor of keys in, a [B, 64] float32 tensor of rows out or in), the keys and
values every system is given, and the check of the rows read back."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from common import MiB, zipf_cdf, zipf_ranks

DIM = 64
VALUE_BYTES = DIM * 4
ZIPF_S = 1.1
BASE_ROWS = 4093  # the value table row i draws from; see values_for()


class Workload:
    """Keys and values shared by every system (same seed, same batches)."""

    def __init__(self, rows: int, batch: int, pool_batches: int, seed: int):
        import numpy as np
        import torch

        self.rows, self.batch = rows, batch
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        self.base = torch.randn(BASE_ROWS, DIM, generator=gen, dtype=torch.float32)
        n = batch * pool_batches
        self.uniform = torch.from_numpy(rng.integers(0, rows, size=n, dtype=np.int64)).view(pool_batches, batch)
        # Zipf(s) over ranks 1..rows, bounded: inverse CDF by searchsorted; the ranks go
        # through a fixed random permutation so that the hot keys are scattered over the
        # key space (and over the load order).
        ranks = zipf_ranks(zipf_cdf(rows, ZIPF_S), rng.random(n))
        perm = rng.permutation(rows).astype(np.int64)
        self.zipf = torch.from_numpy(perm[ranks]).view(pool_batches, batch)
        self.hot_share = float(np.mean(ranks < max(1, rows // 100)))  # share of draws on the top 1% keys
        del perm, ranks
        self.sample = torch.from_numpy(rng.choice(rows, size=min(rows, 4096), replace=False).astype(np.int64))
        self.buf = torch.empty(batch, DIM, dtype=torch.float32)  # reused value buffer for puts
        self.buf.fill_(0)

    def values_for(self, keys, version: int, out=None):
        """Row for key k: base[k % BASE_ROWS] with column 0 = k and column 1 = version."""
        import torch

        if out is None:
            out = torch.empty(keys.numel(), DIM, dtype=torch.float32)
        out = out[: keys.numel()]
        torch.index_select(self.base, 0, torch.remainder(keys, BASE_ROWS), out=out)
        out[:, 0] = keys.to(torch.float32)
        out[:, 1] = float(version)
        return out


class MlkvSystem:
    def __init__(self, path: str, rows: int, budget: int, spec: Dict[str, Any]):
        import inspect

        from mlkv_torch import KVStore

        self.kw = dict(dim=DIM, memory_budget_bytes=budget, expected_rows=max(rows, 1),
                       direct_io=spec.get("direct_io", True), io_engine=spec.get("io_engine", "auto"),
                       io_depth=spec.get("io_depth", 64))
        self.accepts = set(inspect.signature(KVStore.__init__).parameters)
        for opt in ("promote_hot_reads",):  # options only some versions of the store have
            if opt in spec and opt in self.accepts:
                self.kw[opt] = spec[opt]
        self.path = path
        self.store = KVStore(path, **self.kw)

    def put(self, keys, values) -> None:
        self.store.put(keys, values)

    def get(self, keys):
        return self.store.get(keys)

    def finish_load(self) -> None:
        pass

    def reopen(self, **overrides) -> None:
        from mlkv_torch import KVStore

        self.store.close()
        kw = dict(self.kw)
        kw.update(overrides)
        self.store = KVStore(self.path, **kw)

    def stats(self) -> Dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()


class RocksSystem:
    """rocksdict in raw mode: 8-byte big-endian keys, 256-byte values, WriteBatch puts, multi-get."""

    def __init__(self, path: str, rows: int, budget: int, spec: Dict[str, Any]):
        import rocksdict as rd

        self.rd = rd
        opt = rd.Options(raw_mode=True)
        opt.create_if_missing(True)
        opt.set_compression_type(rd.DBCompressionType.none())  # random floats do not compress
        opt.increase_parallelism(os.cpu_count() or 2)
        opt.set_max_background_jobs(os.cpu_count() or 2)
        opt.set_write_buffer_size(64 * MiB)
        opt.set_max_write_buffer_number(2)
        opt.set_target_file_size_base(64 * MiB)
        opt.set_level_compaction_dynamic_level_bytes(True)
        opt.set_advise_random_on_open(True)
        if spec.get("direct_reads"):
            opt.set_use_direct_reads(True)
            opt.set_use_direct_io_for_flush_and_compaction(True)
        bbo = rd.BlockBasedOptions()
        bbo.set_block_cache(rd.Cache(budget))
        bbo.set_block_size(4096)
        bbo.set_bloom_filter(10, False)
        bbo.set_data_block_index_type(rd.DataBlockIndexType.binary_and_hash())
        bbo.set_data_block_hash_ratio(0.75)
        bbo.set_format_version(5)
        opt.set_block_based_table_factory(bbo)
        self.db = rd.Rdict(path, opt)
        wo = rd.WriteOptions()
        wo.disable_wal = True  # mlkv has no write-ahead log either (durable at checkpoint)
        wo.sync = False
        self.db.set_write_options(wo)
        self.path = path
        self.sort = spec.get("sort_keys", True)

    def put(self, keys, values) -> None:
        order, kl = _prep_keys(keys, self.sort)
        vl = _value_list(values, order)
        wb = self.rd.WriteBatch(raw_mode=True)
        put = wb.put
        for k, v in zip(kl, vl):
            put(k, v)
        self.db.write(wb)

    def get(self, keys):
        order, kl = _prep_keys(keys, self.sort)
        vals = self.db[kl]  # one MultiGet
        return _rows_from_bytes(b"".join(vals), order)  # join raises TypeError on a missing key (None)

    def finish_load(self) -> None:
        # What a careful user does after a bulk load: flush the memtable and compact once.
        self.db.flush()
        self.db.compact_range(None, None)

    def stats(self) -> Dict[str, Any]:
        out = {}
        for prop in ("rocksdb.block-cache-usage", "rocksdb.estimate-table-readers-mem",
                     "rocksdb.cur-size-all-mem-tables", "rocksdb.num-running-compactions"):
            try:
                out[prop] = self.db.property_int_value(prop)
            except Exception:  # noqa: BLE001
                pass
        return out

    def close(self) -> None:
        self.db.close()


class LmdbSystem:
    """LMDB: 8-byte big-endian keys, writemap, one write txn per batch (putmulti), one read txn per batch."""

    def __init__(self, path: str, rows: int, budget: int, spec: Dict[str, Any]):
        import lmdb

        os.makedirs(path, exist_ok=True)
        map_size = max(1 << 30, rows * (VALUE_BYTES + 64) * 4)
        self._open = lambda: lmdb.open(path, map_size=map_size, writemap=True, sync=False, metasync=False,
                                       map_async=True, readahead=False, max_dbs=0, lock=True)
        self.env = self._open()
        self.get_mode = spec.get("lmdb_get", "get")
        self.sort = spec.get("sort_keys", True)

    def _put(self, keys, values, append: bool) -> None:
        order, kl = _prep_keys(keys, self.sort)
        vl = _value_list(values, order)
        with self.env.begin(write=True) as txn:
            consumed, added = txn.cursor().putmulti(zip(kl, vl), dupdata=False, overwrite=True, append=append)
        if consumed != len(kl):
            raise RuntimeError(f"lmdb putmulti consumed {consumed} of {len(kl)}")

    def put(self, keys, values) -> None:
        self._put(keys, values, append=False)

    def load(self, keys, values) -> None:
        # Keys arrive in increasing order during the load: MDB_APPEND is the fast path.
        self._put(keys, values, append=True)

    def get(self, keys):
        order, kl = _prep_keys(keys, self.sort)
        # buffers=False measured faster than memoryviews into the map (fewer Python objects' overhead)
        with self.env.begin(buffers=False) as txn:
            if self.get_mode == "getmulti":
                pairs = txn.cursor().getmulti(kl)
                if len(pairs) != len(kl):
                    raise KeyError(f"lmdb getmulti found {len(pairs)} of {len(kl)} keys")
                buf = b"".join([v for _, v in pairs])
            else:
                get = txn.get
                buf = b"".join([get(k) for k in kl])  # join raises TypeError on a missing key (None)
        return _rows_from_bytes(buf, order)

    def finish_load(self) -> None:
        self.env.sync(True)

    def suspend(self) -> None:
        # drop_caches cannot evict pages mapped into a process: unmap the file first.
        self.env.sync(True)
        self.env.close()

    def resume(self) -> None:
        self.env = self._open()

    def stats(self) -> Dict[str, Any]:
        s = self.env.stat()
        return {"depth": s["depth"], "leaf_pages": s["leaf_pages"], "overflow_pages": s["overflow_pages"]}

    def close(self) -> None:
        self.env.close()


def _prep_keys(keys, sort: bool):
    """int64 tensor -> (order or None, list of 8-byte big-endian keys in the order to issue them)."""
    import numpy as np

    kn = keys.numpy()
    order = np.argsort(kn, kind="stable") if sort else None  # stable: with duplicates the last put still wins
    if order is not None:
        kn = kn[order]
    return order, kn.astype(">i8").view("V8").tolist()


def _rows_from_bytes(buf: bytes, order):
    """Concatenated values (in issue order) -> [n, DIM] float32 tensor in the caller's order."""
    import numpy as np
    import torch

    arr = np.frombuffer(buf, dtype=np.float32).reshape(-1, DIM)
    if order is None:
        return torch.from_numpy(arr.copy())  # frombuffer is read-only; a tensor must own writable memory
    out = np.empty_like(arr)
    out[order] = arr
    return torch.from_numpy(out)


def _value_list(values, order):
    import numpy as np

    v = values.numpy()
    if order is not None:
        v = v[order]
    return v.view(np.dtype((np.void, VALUE_BYTES))).ravel().tolist()


SYSTEMS = {"mlkv": MlkvSystem, "rocksdb": RocksSystem, "lmdb": LmdbSystem}


def check_rows(got, keys, wl: Workload, versions: List[int], what: str) -> Dict[str, Any]:
    """Compares rows read back with what was written; versions: the allowed column-1 values."""
    import torch

    want = wl.values_for(keys, versions[0])
    if tuple(got.shape) != tuple(want.shape) or got.dtype != torch.float32:
        return {"ok": False, "what": what, "error": f"shape/dtype {tuple(got.shape)} {got.dtype}"}
    ver_ok = torch.zeros(keys.numel(), dtype=torch.bool)
    for v in versions:
        ver_ok |= got[:, 1] == float(v)
    body_ok = torch.equal(got[:, 0], want[:, 0]) and torch.equal(got[:, 2:], want[:, 2:])
    ok = bool(body_ok and bool(ver_ok.all()))
    res = {"ok": ok, "what": what, "rows": int(keys.numel())}
    if not ok:
        bad = (~ver_ok) | (got[:, 0] != want[:, 0]) | (got[:, 2:] != want[:, 2:]).any(dim=1)
        idx = bad.nonzero().flatten()[:5]
        res["error"] = (f"{int(bad.sum())} of {keys.numel()} rows differ; e.g. keys {keys[idx].tolist()}: "
                        f"got col0/col1 {got[idx, :2].tolist()}, want col0 {want[idx, 0].tolist()} "
                        f"col1 in {versions}")
    return res

