"""HET across ranks: replicas of the globally hottest rows of sharded tables on every rank, read and
written within per-row bounds, so that most lookups skip TorchRec's all-to-alls.

`replicate_hot_rows(sharded_collection, ReplicaSettings(...))` hooks a ShardedEmbeddingBagCollection
(TorchRec's or the disk sharder's) under DistributedModelParallel. Each training step:

- **Split.** A bag of a replicated table whose ids are all hot is a *hit*: it is pooled on the rank
  from the replica. The other bags (*misses*) go through TorchRec's input and output distribution
  as a variable-batch KeyedJaggedTensor (VBE), so the output all-to-all carries only them; the
  output is gathered back in batch order from theirs and the hits (`VariableOutputLayout`).
- **Push and refresh in one.** Each row the step must send to its owner travels as one extra
  single-id bag of the same distribution (a *push bag*): its forward output is the owner's current
  row (the refresh), its gradient is what the rank accumulated for the row plus this step's (the
  push). The owner's fused optimizer sums it with the step's other gradients of the row, as
  without replicas. A row goes when a hit reads it more than `pull_bound` steps after its value
  was read (the owner updates a row at most once a step, so it then misses at most `pull_bound`
  of the owner's updates), when its oldest unpushed gradient is `push_bound` steps old, and every
  row with an unpushed gradient before the hot rows are chosen again or a checkpoint is cut.
  At bounds 0 every row a step reads goes in that step: training is exact.
- **Choice.** The lookups of the replicated tables are counted; after `warmup_steps` steps and
  then every `refresh_every` steps, every rank offers its most frequent rows and all choose the
  same ones: the `fraction` of the sharded tables' rows (all together) with the most lookups over
  the ranks. So a small table whose rows are all hot may be replicated whole, and a large one gets
  less than its share (docs/benchmarks.md has what that gains over a share of each table).

A virtual table (TorchRec's ``use_virtual_table``) counts by the ids its ranks keep, not its id
space: each shard at most its eviction trigger (`mlkv_torch.virtual_tables.rows_held`).

A rank replicates only the tables other ranks own part of: its own table's rows are pooled where
they are, so a replica of them would save no byte and cost the split. A table is so counted only
on the ranks that replicate it; its counts are scaled by all ranks over those, so that a table
one rank owns competes on equal terms with one they all share. Tables that are data-parallel in the
plan are left alone (every rank holds them whole), as are evaluations (no gradient): they read the
owners' rows.
"""

from __future__ import annotations

from .hot_rows import HotRowReplicas, replicate_hot_rows
from .settings import ReplicaSettings, replica_memory_bytes

__all__ = ["ReplicaSettings", "HotRowReplicas", "replicate_hot_rows", "replica_memory_bytes"]
