"""Virtual tables: tables of raw ids whose rows come and go (Monolith's collisionless tables with
expirable embeddings and a frequency filter; TorchRec's ``use_virtual_table`` with its eviction
policies). `IdPolicy` says how a table's ids get rows and lose them; `KernelIds` keeps, for the
tables of one kernel, each id's lookups and age (`_C.IdActivity`) and runs the eviction rounds.

The clock of a time-to-live: TorchRec gives it in minutes of wall time, and so does a policy by
default; with ``minute_steps`` set, a minute is that many training steps of the kernel, which
makes eviction a function of the batches alone (two runs of the same batches, or a run resumed
from a cut, evict the same ids)."""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _C
from .cache_keys import TABLE_SHIFT, row_of, table_of
from .checks import is_int

RULES = tuple(_C.IdActivity.rules)  # the eviction rules, in the order the C++ engine numbers them

# The largest id a disk table holds: a kernel keys a row by its table above this many bits.
MAX_VIRTUAL_ROWS = 1 << TABLE_SHIFT


class IdsActivity(NamedTuple):
    """A table's ids' activity, as another world reads it (`saved_activity`)."""

    ids: torch.Tensor  # [n] int64
    counts: torch.Tensor  # [n] float32: lookups counted
    last: torch.Tensor  # [n] int64: when each was last looked up, on the policy's clock
    holds_row: torch.Tensor  # [n] bool
    evicted: torch.Tensor  # 0-dim int64: the ids its eviction rounds removed so far, over all its shards


@dataclass(frozen=True)
class IdPolicy:
    """How a virtual table's ids get rows and lose them.

    Args:
        rule: which ids an eviction round removes: "count" (looked up in fewer than
            `count_threshold` batches, counts decayed by `decay_rate` at each round, as FBGEMM's
            count-based eviction), "timestamp" (not looked up for more than `ttl_minutes`),
            "count_and_timestamp" (both at once, as TorchRec's mixed policy), or "none".
        trigger_ids: a round runs before a batch when more ids than this hold rows in the table
            (TorchRec's training_id_eviction_trigger_count, per rank); 0: rounds run only when
            asked for (`evict`).
        keep_ids: after the rule, the weakest ids (lowest count, then least recently looked up)
            go too until at most this many hold rows: the table's cap. 0: no cap.
        admit_after: the frequency filter: an id gets a row at the `admit_after`-th batch that
            looks it up; before that it reads zeros and its gradients are dropped. 1: at once.
        minute_steps: the clock of `ttl_minutes`: None, wall minutes; else training steps.
    """

    rule: str = "none"
    count_threshold: float = 0.0
    decay_rate: float = 1.0
    ttl_minutes: float = 0.0
    trigger_ids: int = 0
    keep_ids: int = 0
    admit_after: int = 1
    minute_steps: Optional[int] = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> Optional[str]:
        """What makes the policy impossible, or None."""
        if self.rule not in RULES:
            return f"rule must be one of {RULES}, got {self.rule!r}"
        if not (isinstance(self.count_threshold, (int, float)) and self.count_threshold >= 0):
            return f"count threshold must be >= 0, got {self.count_threshold!r}"
        if not (isinstance(self.decay_rate, (int, float)) and 0 < self.decay_rate <= 1):
            return f"decay_rate must be in (0, 1], got {self.decay_rate!r}"
        if not (isinstance(self.ttl_minutes, (int, float)) and self.ttl_minutes >= 0):
            return f"eviction ttl must be >= 0 minutes, got {self.ttl_minutes!r}"
        for name in ("trigger_ids", "keep_ids"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                return f"{name} must be a non-negative int, got {getattr(self, name)!r}"
        if not is_int(self.admit_after) or self.admit_after < 1:
            return f"admit_after must be an int >= 1, got {self.admit_after!r}"
        if self.minute_steps is not None and (not is_int(self.minute_steps) or self.minute_steps < 1):
            return f"minute_steps must be None (wall minutes) or an int >= 1, got {self.minute_steps!r}"
        if self.rule in ("count", "count_and_timestamp") and self.count_threshold == 0:
            return f"rule {self.rule!r} with count threshold 0 evicts nothing by count (use rule 'timestamp' or 'none')"
        if self.rule in ("timestamp", "count_and_timestamp") and self.ttl_minutes == 0:
            return f"rule {self.rule!r} with a ttl of 0 minutes evicts nothing by age (use rule 'count' or 'none')"
        if self.keep_ids and self.trigger_ids and self.keep_ids > self.trigger_ids:
            return f"keep_ids ({self.keep_ids}) must not exceed trigger_ids ({self.trigger_ids})"
        return None

    @property
    def tracked(self) -> bool:
        """Whether the table's ids must be followed (a filter, a rule or a cap)."""
        return self.admit_after > 1 or self.rule != "none" or self.keep_ids > 0

    @property
    def cap(self) -> Optional[int]:
        """The ids the table is sized by (its trigger: rounds bring it back under), or None."""
        return self.trigger_ids or self.keep_ids or None

    def ttl(self) -> int:
        """The time-to-live on the policy's clock (steps, or wall seconds)."""
        per_minute = 60 if self.minute_steps is None else self.minute_steps
        return int(math.ceil(self.ttl_minutes * per_minute))

    def now(self, step: int) -> int:
        """The time on the policy's clock at training step `step`."""
        return step if self.minute_steps is not None else int(time.time())


@dataclass(frozen=True)
class VirtualTableOptions:
    """What a virtual table needs beyond TorchRec's config (applied to every virtual table of a
    collection or a sharder).

    Args:
        admit_after: the frequency filter (`IdPolicy.admit_after`); 1: none.
        minute_steps: the clock of TorchRec's eviction_ttl_mins: None, wall minutes; else this
            many training steps make a minute (reproducible eviction).
        keep_fraction: after a round triggered by training_id_eviction_trigger_count, at most this
            fraction of it hold rows (the weakest go beyond the policy's rule), so rows stay under
            the trigger and rounds do not follow each other every step.
    """

    admit_after: int = 1
    minute_steps: Optional[int] = None
    keep_fraction: float = 0.9

    def __post_init__(self) -> None:
        if not (isinstance(self.keep_fraction, (int, float)) and 0 < self.keep_fraction <= 1):
            raise ValueError(f"keep_fraction must be in (0, 1], got {self.keep_fraction!r}")
        IdPolicy(admit_after=self.admit_after, minute_steps=self.minute_steps)  # checks them


def id_policy_of(config: Any, options: Optional[VirtualTableOptions] = None) -> Optional[IdPolicy]:
    """The IdPolicy of a TorchRec table config (or a shard of one): its
    ``virtual_table_eviction_policy`` (CountBased, TimestampBased, CountTimestampMixed,
    NoEviction; FeatureScoreBased and FeatureL2NormBased need scores the disk kernel does not
    compute, and are refused) with `options`. None for a table that is not virtual. ValueError
    names the table and what is impossible."""
    options = options or VirtualTableOptions()
    if not getattr(config, "use_virtual_table", False):
        return None
    name = getattr(config, "name", "?")
    policy = getattr(config, "virtual_table_eviction_policy", None)
    kind = type(policy).__name__ if policy is not None else "NoEvictionPolicy"
    fields: Dict[str, Any] = {}
    if kind == "CountBasedEvictionPolicy":
        fields = dict(rule="count", count_threshold=policy.eviction_threshold, decay_rate=policy.decay_rate)
    elif kind == "TimestampBasedEvictionPolicy":
        fields = dict(rule="timestamp", ttl_minutes=policy.eviction_ttl_mins)
    elif kind == "CountTimestampMixedEvictionPolicy":
        fields = dict(rule="count_and_timestamp", count_threshold=policy.eviction_threshold,
                      decay_rate=policy.decay_rate, ttl_minutes=policy.eviction_ttl_mins)
    elif kind != "NoEvictionPolicy":
        raise ValueError(f"table {name!r}: {kind} is not supported on disk (CountBasedEvictionPolicy, "
                         f"TimestampBasedEvictionPolicy, CountTimestampMixedEvictionPolicy or NoEvictionPolicy)")
    trigger = int(getattr(policy, "training_id_eviction_trigger_count", 0) or 0) if policy is not None else 0
    check_virtual_size(name, config.num_embeddings)
    try:
        return IdPolicy(trigger_ids=trigger, keep_ids=max(1, int(trigger * options.keep_fraction)) if trigger else 0,
                        admit_after=options.admit_after, minute_steps=options.minute_steps, **fields)
    except ValueError as e:
        raise ValueError(f"table {name!r}: its virtual table eviction policy: {e}") from None


def activity_bytes(policy: Optional[IdPolicy]) -> int:
    """Host memory a table's tracked ids take at its cap (its trigger; the memory budget reserves
    it); 0 for a table without a tracked policy. Without a cap they grow with the ids seen."""
    if policy is None or not policy.tracked:
        return 0
    return _C.IdActivity.bytes_per_id * (policy.cap or 0)


def rows_held(config: Any, shard_rows: Sequence[int]) -> int:
    """The most rows a table holds whose shards span `shard_rows` rows each: all of them, but at
    most a virtual table's cap on each shard (its trigger: a rank evicts beyond it)."""
    policy = id_policy_of(config)
    cap = policy.cap if policy is not None else None
    return sum(rows if cap is None else min(rows, cap) for rows in shard_rows)


def check_virtual_size(name: str, num_embeddings: int) -> None:
    """ValueError naming the table when its id space is larger than a disk table holds."""
    if num_embeddings > MAX_VIRTUAL_ROWS:
        raise ValueError(f"table {name!r}: num_embeddings {num_embeddings} (2**{math.log2(num_embeddings):.1f}) is "
                         f"larger than a disk table's id space, 2**{TABLE_SHIFT}: hash ids into it "
                         f"(collisions stay negligible below a few million live ids a table)")


class KernelIds:
    """The ids of one kernel's tables that have an IdPolicy: which hold rows, each one's lookups
    and age, and the eviction rounds (rows deleted from the cache and the stores through
    `cache.delete_rows`). Its state travels with cuts (`save`, `load`); `blocks` names each table's
    block of its full table, (name, first row, first column), which the saved state records so that
    another world can read it (`saved_activity`)."""

    def __init__(self, policies: Sequence[Optional[IdPolicy]],
                 blocks: Optional[Sequence[Tuple[str, int, int]]] = None) -> None:
        self.policies = list(policies)
        self.blocks = [list(block) for block in blocks or []]
        args = []
        for p in self.policies:
            p = p or IdPolicy()
            rule = RULES.index(p.rule)
            args.append((p.tracked, p.admit_after, rule, float(p.count_threshold), float(p.decay_rate), p.ttl(),
                         p.trigger_ids, p.keep_ids))
        clocks = {p.minute_steps is None for p in self.policies if p is not None and p.tracked}
        if len(clocks) > 1:
            raise ValueError("the virtual tables of one kernel must keep one clock: all with minute_steps or none")
        self._clock = next((p for p in self.policies if p is not None and p.tracked), IdPolicy(minute_steps=1))
        self.activity = _C.IdActivity(args)
        self.evicted = [0] * len(self.policies)  # ids evicted so far, per table
        self.rounds = [0] * len(self.policies)
        self.peak_live = [0] * len(self.policies)  # the most ids holding rows after a batch, per table

    @property
    def filters(self) -> bool:
        """Whether some table's ids read zeros until admitted."""
        return any(p is not None and p.admit_after > 1 for p in self.policies)

    def _now(self, step: int) -> int:
        return self._clock.now(step)

    def evict_due(self, cache: Any, step: int) -> None:
        """Runs a round in each table over its trigger (before a batch's lookup)."""
        for table, policy in enumerate(self.policies):
            if policy is not None and self.activity.due(table):
                self.evict(cache, table, step)

    def evict(self, cache: Any, table: int, step: int) -> int:
        """One eviction round of `table` at training step `step`: the ids its policy picks lose their
        rows (and optimizer state); returns how many rows went."""
        with_rows, without_rows = self.activity.pick(table, self._now(step))
        deleted = cache.delete_rows(with_rows) if with_rows.numel() else torch.zeros(0, dtype=torch.bool)
        gone = with_rows[deleted]
        self.activity.forget(torch.cat([gone, without_rows]))
        self.evicted[table] += int(gone.numel())
        self.rounds[table] += 1
        return int(gone.numel())

    def observe(self, unique: torch.Tensor, step: int) -> Optional[torch.Tensor]:
        """Records a batch's distinct keys; returns which hold rows (None: every one)."""
        holds = self.activity.observe(unique, self._now(step))
        for table, policy in enumerate(self.policies):
            if policy is not None and policy.tracked:
                self.peak_live[table] = max(self.peak_live[table], self.activity.live(table))
        return holds if self.filters and not bool(holds.all()) else None

    def read(self, unique: torch.Tensor) -> Optional[torch.Tensor]:
        """An evaluation's batch: which of its distinct keys hold rows (None: every one), nothing
        counted, admitted or evicted."""
        holds = self.activity.holds(unique)
        return None if bool(holds.all()) else holds

    def mark(self) -> None:
        """A cut's boundary: changes are followed from here."""
        self.activity.mark()

    def changes(self, keys_of_table: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """The keys of one table (`keys_of_table(keys) -> mask`) looked up since the mark that hold
        rows, and those that held rows at the mark and hold none now (each sorted)."""
        looked_up, gone = self.activity.changes()
        return looked_up[keys_of_table(looked_up)], gone[keys_of_table(gone)]

    def live(self, table: int) -> int:
        """Ids of `table` that hold rows."""
        return self.activity.live(table)

    def stats(self, table: int) -> Dict[str, Any]:
        return {"live_ids": self.activity.live(table), "peak_live_ids": self.peak_live[table],
                "evicted_ids": self.evicted[table], "eviction_rounds": self.rounds[table]}

    def adopt(self, keys: torch.Tensor, looked_up: int, step: int) -> None:
        """Counts `keys` (of ids that hold rows) as looked up `looked_up` times, now: a table
        reopened without its saved activity."""
        for _ in range(looked_up):
            self.activity.observe(keys.contiguous(), self._now(step))

    def replace(self, table: int, keys: torch.Tensor, counts: torch.Tensor, last: torch.Tensor,
                holds_row: torch.Tensor, evicted: int) -> None:
        """Sets the activity of `table`'s ids to the given (keys of the table; the other tables'
        kept), and the ids its rounds evicted so far: a table filled from another world's tables (a
        reshard)."""
        self.evicted[table] = evicted
        state = self.activity.state()
        others = table_of(state[0]) != table
        self.activity.restore(*(torch.cat([old[others], new.contiguous()])
                                for old, new in zip(state, (keys, counts, last, holds_row))))

    # ---- with cuts: one file per cut boundary, named by the kernel's step there ---------------------
    def saved(self, directory: str, step: int) -> bool:
        return os.path.exists(activity_file(directory, step))

    def save(self, directory: str, step: int) -> None:
        """Writes the state at the cut boundary `step` (atomically: a crash leaves those before)."""
        keys, counts, last, holds = self.activity.state()
        path = activity_file(directory, step)
        torch.save({"keys": keys, "counts": counts, "last": last, "holds_row": holds, "tables": self.blocks,
                    "evicted": list(self.evicted), "rounds": list(self.rounds)}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def prune(self, directory: str, step: int) -> None:
        """Removes the states of boundaries other than `step`, once its cut is committed."""
        for name in os.listdir(directory):
            if name.startswith(_ACTIVITY_PREFIX) and name != os.path.basename(activity_file(directory, step)):
                os.remove(os.path.join(directory, name))

    def load(self, directory: str, step: int) -> None:
        """Restores the state saved at the cut boundary `step`."""
        state = torch.load(activity_file(directory, step), weights_only=True)
        self.activity.restore(state["keys"], state["counts"], state["last"], state["holds_row"])
        self.evicted, self.rounds = list(state["evicted"]), list(state["rounds"])


_ACTIVITY_PREFIX = "ID_ACTIVITY."


def activity_file(directory: str, step: int) -> str:
    """Where a kernel saves its ids' activity at `step` (in its first table's directory)."""
    return os.path.join(directory, f"{_ACTIVITY_PREFIX}{step}.pt")


def saved_activity(kernels: Iterable[Tuple[str, int]]) -> Dict[str, IdsActivity]:
    """The activity of the ids of every table that the kernels of a cut saved, by table name, in
    the full table's ids (sorted; each id once: a table's column shards follow the same ids).
    `kernels`: the (directory, step) of each stored table of the cut; a kernel saved its state in
    its first table's directory at its step. A state saved without its tables' blocks (by an
    earlier version) is skipped: its tables' ids count as looked up afresh where they are loaded."""
    parts: Dict[str, List[Tuple[torch.Tensor, ...]]] = defaultdict(list)
    evicted: Dict[str, int] = defaultdict(int)
    for directory, step in kernels:
        path = activity_file(directory, step)
        if not os.path.exists(path):
            continue
        state = torch.load(path, weights_only=True)
        tables = table_of(state["keys"])
        for index, (name, first_row, first_column) in enumerate(state.get("tables", [])):
            mine = tables == index
            if first_column == 0:
                evicted[name] += int(state["evicted"][index])
                parts[name].append((row_of(state["keys"][mine]) + first_row, state["counts"][mine],
                                    state["last"][mine], state["holds_row"][mine]))
    activity = {}
    for name, chunks in parts.items():
        ids, counts, last, holds_row = (torch.cat(column) for column in zip(*chunks))
        order = ids.argsort()
        activity[name] = IdsActivity(ids[order], counts[order], last[order], holds_row[order],
                                     torch.tensor(evicted[name]))
    return activity
