// KVStore's base run: reads of the rows the log does not hold, the count of live rows across the
// two, and the merge that moves the log's written rows into a new run so the index stays within
// its budget.
#include "kv_store.h"

#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "file_io.h"
#include "log_format.h"

namespace mlkv {

std::string KVStore::BasePath(uint64_t generation) const { return NumberedPath("base", generation, "runs"); }
std::string KVStore::RunPath(uint64_t id) const { return NumberedPath("run", id, "run"); }

Status KVStore::OpenBase(uint64_t generation) {
  base_.reset();
  base_generation_ = generation;
  if (generation == 0) return Status::OK();
  std::vector<uint64_t> ids;
  MLKV_RETURN_IF_ERROR(ReadBaseManifest(BasePath(generation), generation, &ids));
  std::vector<std::shared_ptr<const BaseRun>> runs;
  for (uint64_t id : ids) {
    std::unique_ptr<BaseRun> run;
    MLKV_RETURN_IF_ERROR(BaseRun::Open(RunPath(id), value_bytes_, id, direct_io_, &run));
    runs.push_back(std::move(run));
    next_run_id_ = std::max(next_run_id_, id + 1);
  }
  base_runs_of_[generation] = ids;
  base_ = std::make_shared<const BaseRuns>(std::move(runs), std::move(ids));
  return Status::OK();
}

uint64_t KVStore::LiveLogKeysLocked() const {
  if (!deletions_indexed_) return index_.size();
  uint64_t live = 0;
  index_.ForEachAddress([&](uint64_t address) { live += !IsDeletion(address); });
  return live;
}

Status KVStore::ReadFromBase(const BaseRuns& base, const int64_t* keys, const std::vector<size_t>& wanted, uint8_t* out,
                             bool* found) const {
  if (wanted.empty()) return Status::OK();
  std::vector<int64_t> wanted_keys(wanted.size());
  for (size_t j = 0; j < wanted.size(); ++j) wanted_keys[j] = keys[wanted[j]];
  std::vector<uint8_t> rows(wanted.size() * value_bytes_);
  std::unique_ptr<bool[]> hit(new bool[wanted.size()]);
  uint64_t blocks = 0;
  MLKV_RETURN_IF_ERROR(base.Lookup(wanted_keys.data(), wanted.size(), rows.data(), hit.get(), reader_.get(), &blocks));
  base_reads_ += blocks;
  disk_reads_ += blocks;
  for (size_t j = 0; j < wanted.size(); ++j) {
    found[wanted[j]] = hit[j];
    if (hit[j]) std::memcpy(out + wanted[j] * value_bytes_, rows.data() + j * value_bytes_, value_bytes_);
  }
  return Status::OK();
}

Status KVStore::CountRows(uint64_t* rows) const {
  std::shared_ptr<const BaseRuns> base;
  std::vector<int64_t> unknown;      // keys whose presence in the base only a read tells
  std::vector<bool> unknown_deleted;  // ... and whether the log deletes or holds them
  int64_t count = 0;
  uint64_t changes, generation;
  {
    ReaderLock lock(&mu_);
    changes = changes_;
    generation = base_generation_;
    {
      MutexLock cached(&rows_mu_);
      if (counted_changes_ == changes && counted_base_ == generation) {
        *rows = counted_rows_;
        return Status::OK();
      }
    }
    if (!base_ || closed_) {  // a closed store's count stands as it was (no read of a closed store)
      MutexLock cached(&rows_mu_);
      *rows = base_ && counted_base_ == generation ? counted_rows_ : LiveLogKeysLocked();
      return Status::OK();
    }
    base = base_;
    count = static_cast<int64_t>(base->rows());
    // Unchecked: ForEachEntry calls it while mu_ is held here, which the analysis cannot see through the template.
    index_.ForEachEntry([&](int64_t key, uint64_t address) NO_THREAD_SAFETY_ANALYSIS {
      const bool deleted = IsDeletion(address);
      switch (base->PresenceOf(key)) {
        case BaseRun::Presence::kAbsent: count += deleted ? 0 : 1; break;
        case BaseRun::Presence::kPresent: count -= deleted ? 1 : 0; break;
        case BaseRun::Presence::kMaybe:
          unknown.push_back(key);
          unknown_deleted.push_back(deleted);
          break;
      }
    });
  }
  std::vector<size_t> all(unknown.size());
  std::iota(all.begin(), all.end(), 0);
  std::vector<uint8_t> values(unknown.size() * value_bytes_);
  std::unique_ptr<bool[]> held(new bool[unknown.size() + 1]);
  MLKV_RETURN_IF_ERROR(ReadFromBase(*base, unknown.data(), all, values.data(), held.get()));
  for (size_t i = 0; i < unknown.size(); ++i) {
    if (held[i])
      count -= unknown_deleted[i] ? 1 : 0;
    else
      count += unknown_deleted[i] ? 0 : 1;
  }
  *rows = static_cast<uint64_t>(count);
  MutexLock cached(&rows_mu_);
  counted_rows_ = *rows;
  counted_changes_ = changes;
  counted_base_ = generation;
  return Status::OK();
}

Status KVStore::CollectLogRows(uint64_t first_page, uint64_t end_page, LiveRecords* live) {
  AlignedBuffer page_buffer(page_bytes_);
  for (uint64_t page = first_page; page < end_page; ++page) {
    MLKV_RETURN_IF_ERROR(ReadWrittenPage(page, page_buffer.data));
    const uint64_t first_slot = page * records_per_page_;
    ReaderLock lock(&mu_);
    for (uint64_t slot = first_slot; slot < first_slot + records_per_page_; ++slot) {
      const uint8_t* rec = page_buffer.data + OffsetInPage(slot);
      RecordHeader h;
      std::memcpy(&h, rec, sizeof(h));
      // Live: the index names this record (a deletion names its tombstone with the bit).
      const uint64_t address = (h.flags & kFlagTombstone) ? slot | kDeletionBit : slot;
      if (index_.Find(h.key) != address) continue;
      live->keys.push_back(h.key);
      live->slots.push_back(address);
      live->values.insert(live->values.end(), rec, rec + record_bytes_);
    }
  }
  return Status::OK();
}

namespace {

constexpr size_t kTailRunsPerLevel = 4;     // runs of one size at the tail before they are joined
constexpr uint64_t kRunLevelRows = 4096;    // the rows of a run at level 0, and 4x that a level up
constexpr uint64_t kRunIdsPerMerge = 64;    // run numbers a merge takes: its run and the joined ones

int RunLevel(uint64_t rows) {
  int level = 0;
  for (rows /= kRunLevelRows; rows >= 4; rows /= 4) ++level;
  return level;
}

}  // namespace

Status KVStore::JoinTailRuns(std::vector<std::shared_ptr<const BaseRun>>* runs, std::vector<uint64_t>* ids,
                             uint64_t* next_id, uint64_t end_id) {
  for (;;) {
    const size_t n = runs->size();
    const int level = n ? RunLevel(runs->back()->rows()) : 0;
    size_t same = 0;
    while (same < n && RunLevel((*runs)[n - 1 - same]->rows()) == level) ++same;
    if (same < kTailRunsPerLevel || *next_id == end_id) return Status::OK();
    // Disjoint and in key order: the runs' rows one after another are the joined run's.
    const uint64_t id = (*next_id)++;
    std::unique_ptr<BaseRunWriter> writer;
    MLKV_RETURN_IF_ERROR(BaseRunWriter::Create(RunPath(id), value_bytes_, id, &writer));
    std::vector<int64_t> keys;
    std::vector<uint8_t> values;
    for (size_t r = n - same; r < n; ++r) {
      BaseRun::Cursor cursor(*(*runs)[r]);
      for (bool more = true; more;) {
        keys.clear();
        values.clear();
        MLKV_RETURN_IF_ERROR(cursor.Next(&keys, &values, &more));
        for (size_t j = 0; j < keys.size(); ++j)
          MLKV_RETURN_IF_ERROR(writer->Add(keys[j], values.data() + j * value_bytes_));
      }
    }
    base_rows_written_ += writer->rows();
    MLKV_RETURN_IF_ERROR(writer->Finish());
    std::unique_ptr<BaseRun> joined;
    MLKV_RETURN_IF_ERROR(BaseRun::Open(RunPath(id), value_bytes_, id, direct_io_, &joined));
    runs->resize(n - same);
    ids->resize(n - same);
    runs->push_back(std::move(joined));
    ids->push_back(id);
  }
}

Status KVStore::WriteBase(uint64_t generation, uint64_t run_id, const std::shared_ptr<const BaseRuns>& old_base,
                          const LiveRecords& moved, std::vector<size_t>& order, std::shared_ptr<const BaseRuns>* out) {
  const uint64_t end_id = run_id + kRunIdsPerMerge;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return moved.keys[a] < moved.keys[b]; });
  // Rows written in key order (a table filled front to back) lie past the old runs: they add a run.
  const bool append = !old_base || order.empty() || moved.keys[order.front()] > old_base->last_key();
  std::unique_ptr<BaseRunWriter> writer;
  MLKV_RETURN_IF_ERROR(BaseRunWriter::Create(RunPath(run_id), value_bytes_, run_id, &writer));
  uint64_t next_id = run_id + 1;
  auto add_moved = [&](size_t i) -> Status {
    if (IsDeletion(moved.slots[i])) return Status::OK();  // the deletion drops the base row
    return writer->Add(moved.keys[i], moved.values.data() + i * record_bytes_ + sizeof(RecordHeader));
  };
  size_t next = 0;  // the next moved row, in key order
  if (old_base && !append) {
    std::vector<int64_t> keys;
    std::vector<uint8_t> values;
    for (const auto& run : old_base->runs()) {
      BaseRun::Cursor cursor(*run);
      for (bool more = true; more;) {
        keys.clear();
        values.clear();
        MLKV_RETURN_IF_ERROR(cursor.Next(&keys, &values, &more));
        for (size_t j = 0; j < keys.size(); ++j) {
          for (; next < order.size() && moved.keys[order[next]] < keys[j]; ++next) {
            MLKV_RETURN_IF_ERROR(add_moved(order[next]));
          }
          if (next < order.size() && moved.keys[order[next]] == keys[j]) {  // the log's row supersedes it
            MLKV_RETURN_IF_ERROR(add_moved(order[next++]));
            continue;
          }
          MLKV_RETURN_IF_ERROR(writer->Add(keys[j], values.data() + j * value_bytes_));
        }
      }
    }
  }
  for (; next < order.size(); ++next) MLKV_RETURN_IF_ERROR(add_moved(order[next]));
  const bool empty = writer->rows() == 0;
  base_rows_written_ += writer->rows();
  MLKV_RETURN_IF_ERROR(writer->Finish());
  std::vector<std::shared_ptr<const BaseRun>> runs;
  std::vector<uint64_t> ids;
  if (append && old_base) {
    runs = old_base->runs();
    ids = old_base->ids();
  }
  if (empty) {
    unlink(RunPath(run_id).c_str());  // nothing left to hold (every row deleted, or none moved)
  } else {
    std::unique_ptr<BaseRun> run;
    MLKV_RETURN_IF_ERROR(BaseRun::Open(RunPath(run_id), value_bytes_, run_id, direct_io_, &run));
    runs.push_back(std::move(run));
    ids.push_back(run_id);
  }
  if (append) MLKV_RETURN_IF_ERROR(JoinTailRuns(&runs, &ids, &next_id, end_id));
  MLKV_RETURN_IF_ERROR(WriteBaseManifest(BasePath(generation), generation, ids));
  *out = std::make_shared<const BaseRuns>(std::move(runs), std::move(ids));
  return Status::OK();
}

Status KVStore::MergeIntoBase(uint64_t end_slot, bool* merged) {
  *merged = false;
  uint64_t first_page, end_page, generation, run_id;
  std::shared_ptr<const BaseRuns> old_base;
  {
    WriterLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    first_page = PageOf(begin_);
    end_page = std::min(end_slot / records_per_page_, flusher_.flushed_page());
    if (end_page <= first_page) return Status::OK();
    old_base = base_;
    generation = base_generation_ + 1;
    run_id = next_run_id_;
    next_run_id_ += kRunIdsPerMerge;
    merging_ = true;  // from here, a deletion stays in the index: the row may be moving into the new run
  }
  LiveRecords moved;
  Status st = CollectLogRows(first_page, end_page, &moved);
  std::vector<size_t> order(moved.keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::shared_ptr<const BaseRuns> base;
  if (st.ok()) st = WriteBase(generation, run_id, old_base, moved, order, &base);
  ObsoleteFiles obsolete;
  MLKV_RETURN_IF_ERROR(CommitMerge(st, generation, run_id, end_page, moved, std::move(base), &obsolete, merged));
  RemoveObsoleteFiles(obsolete);  // the bases no checkpoint names, and their runs, outside the lock
#ifdef __GLIBC__
  malloc_trim(0);  // the merge's rows, freed: malloc's arenas would keep them, outside the budget
#endif
  return Status::OK();
}

Status KVStore::CommitMerge(const Status& written, uint64_t generation, uint64_t run_id, uint64_t end_page,
                            const LiveRecords& moved, std::shared_ptr<const BaseRuns> base, ObsoleteFiles* obsolete,
                            bool* merged) {
  WriterLock lock(&mu_);
  merging_ = false;
  if (!written.ok()) {
    for (uint64_t id = run_id; id < run_id + kRunIdsPerMerge; ++id) unlink(RunPath(id).c_str());
    unlink(BasePath(generation).c_str());
    return written;
  }
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  for (size_t i = 0; i < moved.keys.size(); ++i) {
    // A key written or deleted since has a newer record, which supersedes what moved.
    if (index_.Find(moved.keys[i]) != moved.slots[i]) continue;
    MoveLive(index_.Erase(moved.keys[i]), kNone);
  }
  if (base_) unnamed_bases_.push_back(base_generation_);
  base_runs_of_[generation] = base->ids();
  base_ = std::move(base);
  base_generation_ = generation;
  const uint64_t slots_per_segment = pages_per_segment_ * records_per_page_;
  const uint64_t new_begin = end_page * records_per_page_;
  for (uint64_t s = begin_ / slots_per_segment; s < new_begin / slots_per_segment; ++s) {
    segments_.Forget(s);  // readers holding the file keep its descriptor
    compacted_segments_.push_back(s);
  }
  begin_ = new_begin;
  image_sound_ = false;  // an image names keys that have moved: the next checkpoint writes its own
  index_.ShrinkToFit();
  compacted_rows_ += moved.keys.size();
  ++base_merges_;
  ++compactions_;
  *merged = true;
  CollectObsoleteBases(obsolete);  // the replaced base goes now unless a kept checkpoint names it
  return Status::OK();
}

void KVStore::CollectObsoleteBases(ObsoleteFiles* obsolete) {
  std::sort(unnamed_bases_.begin(), unnamed_bases_.end());
  unnamed_bases_.erase(std::unique(unnamed_bases_.begin(), unnamed_bases_.end()), unnamed_bases_.end());
  std::vector<uint64_t> kept, gone;
  for (uint64_t g : unnamed_bases_) {
    if (g == 0 || g == base_generation_) continue;
    (g == checkpointed_base_ || g == previous_base_ || g == begun_base_ ? kept : gone).push_back(g);
  }
  unnamed_bases_.swap(kept);
  // A run goes with the last base that names it (a base that added a run keeps the old ones).
  std::vector<uint64_t> in_use;
  for (const auto& [g, ids] : base_runs_of_) {
    if (std::find(gone.begin(), gone.end(), g) == gone.end()) in_use.insert(in_use.end(), ids.begin(), ids.end());
  }
  for (uint64_t g : gone) {
    obsolete->files.push_back(BasePath(g));
    for (uint64_t id : base_runs_of_[g]) {
      if (std::find(in_use.begin(), in_use.end(), id) == in_use.end()) obsolete->files.push_back(RunPath(id));
    }
    base_runs_of_.erase(g);
  }
}

}  // namespace mlkv
