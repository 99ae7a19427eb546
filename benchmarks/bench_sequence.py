#!/usr/bin/env python3
"""Benchmarks DiskEmbeddingCollection (one embedding per id) against TorchRec's EmbeddingCollection in
memory, training a sequence model, in one run on the same batches.

Workload: one table of `--rows` rows x `--dim` read by two features, a history of 1..`--history`
ids and one candidate per sample, ids Zipf(`--zipf`) over the rows scattered by a fixed
permutation; the model is examples/sequence.py's (the candidate attends over the history, an MLP
scores it), trained with SGD (lr 0.05) for the table (`torch.optim.SGD` over sparse gradients in
memory, the fused rule on disk) and Adagrad for the MLP. Configurations:

  memory    EmbeddingCollection (its nn.Embedding made sparse), the table in memory;
  disk-P%   DiskEmbeddingCollection with memory_budget_bytes = P% of the table's bytes (300%: every
            row fits in the cache), the rows populated on disk first (rows never written would be
            generated, not read): a row's first touch reads it from the store.

Each runs `--warmup` untimed batches, then `--batches` timed ones. Reported per configuration: ids a
second (history and candidates), ms a step, the ratio to memory, the timed steps' cache hit rate,
and their mean loss (the same model from the same weights: equal where every row is cached).

    python benchmarks/bench_sequence.py [--rows 1000000] [--dim 64] [--batch 1024] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

from common import MiB, markdown_table, write_json_report, zipf_cdf, zipf_ranks

BUDGETS = (300, 10)  # percent of the table's bytes (300: the cache holds every row)


def batches(args: argparse.Namespace, count: int) -> List[Any]:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(0)
    cdf = zipf_cdf(args.rows, args.zipf)
    permutation = torch.randperm(args.rows, generator=g)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, args.history + 1, (args.batch,), generator=g)
        uniform = torch.rand(int(lengths.sum()) + args.batch, generator=g, dtype=torch.float64).numpy()
        ids = permutation[torch.from_numpy(zipf_ranks(cdf, uniform))]
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=["history", "candidate"], values=ids,
            lengths=torch.cat([lengths, torch.ones(args.batch, dtype=torch.int64)]))
        out.append((features, torch.randint(0, 2, (args.batch,), generator=g).float()))
    return out


class ClickModel:
    """examples/sequence.py's model around an embedding collection (built per configuration)."""

    def __init__(self, embeddings: Any, dim: int, history: int) -> None:
        import torch

        torch.manual_seed(0)
        self.embeddings, self.history = embeddings, history
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def __call__(self, features: Any) -> Any:
        import torch

        looked_up = self.embeddings(features)
        candidate = looked_up["candidate"].values()
        history = looked_up["history"].to_padded_dense(desired_length=self.history)
        present = torch.arange(self.history) < looked_up["history"].lengths().unsqueeze(1)
        scores = (history @ candidate.unsqueeze(2)).squeeze(2).masked_fill(~present, float("-inf"))
        attended = (scores.softmax(dim=1).unsqueeze(2) * history).sum(dim=1)
        return self.mlp(torch.cat([candidate, attended, candidate * attended], dim=1)).squeeze(1)


def run(args: argparse.Namespace, name: str, embeddings: Any, table_opt: Any, data: List[Any]) -> Dict[str, Any]:
    import torch

    model = ClickModel(embeddings, args.dim, args.history)
    opts = [torch.optim.Adagrad(model.mlp.parameters(), lr=0.05)] + ([table_opt] if table_opt else [])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    def counts() -> Dict[str, int]:
        stats = embeddings.stats()["item"] if hasattr(embeddings, "stats") else {}
        return {k: stats.get(k, 0) for k in ("cache_hits", "cache_misses")}

    for i, (features, labels) in enumerate(data):
        if i == args.warmup:
            before, start = counts(), time.perf_counter()
        for o in opts:
            o.zero_grad()
        loss = loss_fn(model(features), labels)
        loss.backward()
        for o in opts:
            o.step()
        if i >= args.warmup:
            losses.append(loss.item())
    for table in embeddings.embeddings.values():  # the timed window ends when the last update is applied
        if hasattr(table, "synchronize"):
            table.synchronize()
    seconds = time.perf_counter() - start
    ids = sum(int(f.values().numel()) for f, _ in data[args.warmup:])
    after = counts()
    hits, misses = (after[k] - before[k] for k in ("cache_hits", "cache_misses"))
    return {"config": name, "ids_per_s": ids / seconds, "ms_per_step": seconds / args.batches * 1e3,
            "hit_rate": hits / (hits + misses) if hits + misses else None, "mean_loss": sum(losses) / len(losses)}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--history", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--out", default="bench-out/bench_sequence.json")
    ap.add_argument("--smoke", action="store_true", help="a quick check that the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.dim, args.batch, args.warmup, args.batches = 20_000, 16, 128, 2, 4

    import torch
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskEmbeddingCollection

    torch.set_num_threads(1)
    data = batches(args, args.warmup + args.batches)
    table = [EmbeddingConfig(name="item", embedding_dim=args.dim, num_embeddings=args.rows,
                             feature_names=["history", "candidate"])]
    torch.manual_seed(0)
    memory = EmbeddingCollection(table)
    memory.embeddings["item"].sparse = True
    initial = memory.embeddings["item"].weight.detach().clone()
    results = [run(args, "memory", memory, torch.optim.SGD(memory.parameters(), lr=0.05), data)]
    table_bytes = args.rows * args.dim * 4
    with tempfile.TemporaryDirectory(prefix="bench-sequence-") as work:
        for percent in BUDGETS:
            disk = DiskEmbeddingCollection(table, path=os.path.join(work, f"p{percent}"),
                                           optimizer=optim.SGD(lr=0.05),
                                           memory_budget_bytes=max(4 * MiB, table_bytes * percent // 100))
            for start in range(0, args.rows, 1 << 18):  # the same initial rows, written to the store
                rows = torch.arange(start, min(args.rows, start + (1 << 18)))
                disk.embeddings["item"].import_rows(rows, initial[rows])
            disk.checkpoint()
            results.append(run(args, f"disk-{percent}%", disk, None, data))
            disk.close()
    reference = results[0]["ids_per_s"]
    print(f"one table of {args.rows:,} rows x {args.dim} ({table_bytes / MiB:,.0f} MiB), batches of {args.batch} "
          f"samples (history 1..{args.history} + 1 candidate), {args.batches} timed steps after {args.warmup}")
    print("\n".join(markdown_table(
        ["config", "ids/s", "ms a step", "x memory", "hit rate", "mean loss"],
        [[r["config"], f"{r['ids_per_s']:,.0f}", f"{r['ms_per_step']:.1f}", f"{r['ids_per_s'] / reference:.2f}x",
          "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}", f"{r['mean_loss']:.6f}"] for r in results],
        align="l r r r r r")))
    write_json_report(args.out, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
