"""A first look at mlkv-torch: a store 20x larger than its memory budget.

Writes 1M embedding rows (dim 32) with a 6 MiB memory budget, reads them back
with skewed and uniform keys, reads ahead with lookahead, checkpoints, reopens,
and prints what each step did.
"""
import argparse
import tempfile
import time

import torch

from mlkv_torch import KVStore


def zipf_keys(n: int, rows: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    return torch.multinomial(probs / probs.sum(), n, replacement=True, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dir", default=None, help="store directory (default: a temporary one)")
    args = parser.parse_args()
    if args.dir is not None:
        demo(f"{args.dir}/table", args.rows, args.dim)
        return
    with tempfile.TemporaryDirectory(prefix="mlkv-quickstart-") as root:  # removed when the demo ends
        demo(f"{root}/table", args.rows, args.dim)


def demo(path: str, rows: int, dim: int) -> None:
    """The store at `path` with `rows` rows of `dim` floats, through each of its operations."""
    g = torch.Generator().manual_seed(0)
    data_bytes = rows * (16 + 4 * dim)
    budget = max(data_bytes // 20, 1 << 20)
    print(f"store at {path}: {rows:,} rows x dim {dim} (~{data_bytes / 2**20:.0f} MiB), "
          f"memory budget {budget / 2**20:.1f} MiB (1/20 of the data)")

    with KVStore(path, dim=dim, memory_budget_bytes=budget, expected_rows=rows) as store:
        keys = torch.arange(rows)
        values = torch.randn(rows, dim, generator=g)
        t = time.perf_counter()
        for lo in range(0, rows, 65536):
            store.put(keys[lo:lo + 65536], values[lo:lo + 65536])
        dt = time.perf_counter() - t
        s = store.stats()
        print(f"put     {rows:,} rows in {dt:.2f} s ({rows / dt / 1e6:.2f} M rows/s); "
              f"{s['disk_bytes'] / 2**20:.0f} MiB on disk, {s['log_memory_bytes'] / 2**20:.1f} MiB of log in memory")

        # Hot rows read from disk twice are promoted to memory in the background.
        batches = [(f"zipf #{i}", zipf_keys(65536, rows, 1.05, g)) for i in (1, 2, 3)]
        batches.append(("uniform", torch.randint(0, rows, (65536,), generator=g)))
        for name, batch in batches:
            store.flush()
            before = store.stats()
            t = time.perf_counter()
            got = store.get(batch)
            dt = time.perf_counter() - t
            after = store.stats()
            torch.testing.assert_close(got, values[batch], rtol=0, atol=0)
            print(f"get     65,536 {name:8s} keys in {dt * 1e3:6.1f} ms: "
                  f"{after['memory_hits'] - before['memory_hits']:,} "
                  f"from memory, {after['disk_rows'] - before['disk_rows']:,} from disk; all equal to what was written")

        batch = torch.randint(0, rows, (4096,), generator=g)
        store.lookahead(batch)
        store.flush()
        before = store.stats()
        got = store.get(batch)
        after = store.stats()
        torch.testing.assert_close(got, values[batch], rtol=0, atol=0)
        print(f"lookahead brought {after['lookahead_rows']:,} rows "
              f"into memory; the get that followed read {after['disk_rows'] - before['disk_rows']} rows from disk")

        store.put(keys[:10], torch.zeros(10, dim))
        store.delete(keys[10:20])
        store.checkpoint()
        print(f"checkpoint: 10 rows zeroed, 10 deleted, {len(store):,} rows durable")

    with KVStore(path, dim=dim, memory_budget_bytes=budget) as store:
        assert len(store) == rows - 10
        torch.testing.assert_close(store.get(keys[:10]), torch.zeros(10, dim))
        torch.testing.assert_close(store.get(keys[20:30]), values[20:30])
        print(f"reopened: {len(store):,} rows recovered, contents as checkpointed; "
              f"deleted keys absent: {not store.contains(keys[10:20]).any().item()}")
    print("quickstart done")


if __name__ == "__main__":
    main()
