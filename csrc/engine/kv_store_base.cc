// KVStore's base run: reads of the rows the log does not hold, the count of live rows across the
// two, and the merge that moves the log's written rows into a new run so the index stays within
// its budget.
#include "kv_store.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "base_merge.h"
#include "file_io.h"
#include "log_format.h"

namespace mlkv {

std::string KVStore::BasePath(uint64_t generation) const { return NumberedPath("base", generation, "runs"); }
std::string KVStore::RunPath(uint64_t id) const { return NumberedPath("run", id, "run"); }

Status KVStore::OpenBase(uint64_t generation) {
  base_.reset();
  base_generation_ = generation;
  if (generation == 0) return Status::OK();
  BaseManifest manifest;
  MLKV_RETURN_IF_ERROR(ReadBaseManifest(BasePath(generation), generation, &manifest));
  std::vector<std::shared_ptr<const BaseRun>> runs, overlays;
  for (const auto& [ids, opened] : {std::pair{&manifest.runs, &runs}, std::pair{&manifest.overlays, &overlays}}) {
    for (uint64_t id : *ids) {
      std::unique_ptr<BaseRun> run;
      MLKV_RETURN_IF_ERROR(BaseRun::Open(RunPath(id), value_bytes_, id, direct_io_, &run));
      opened->push_back(std::move(run));
      next_run_id_ = std::max(next_run_id_, id + 1);
    }
  }
  base_ = std::make_shared<const BaseRuns>(std::move(runs), std::move(overlays), std::move(manifest));
  base_runs_of_[generation] = base_->all_ids();
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

Status KVStore::CountRows(uint64_t* rows, bool read_unknown) const {
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
          if (!read_unknown) {
            count -= deleted ? 1 : 0;  // held by the base, as if read
            break;
          }
          unknown.push_back(key);
          unknown_deleted.push_back(deleted);
          break;
      }
    });
  }
  if (!read_unknown) {  // not kept: a count that read would be exact where this one guessed
    *rows = static_cast<uint64_t>(count);
    return Status::OK();
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
  {
    // Room for every row the pages could hold, reserved once: malloc reuses the last merge's.
    ReaderLock lock(&mu_);
    const uint64_t most = std::min<uint64_t>((end_page - first_page) * records_per_page_, index_.size());
    live->keys.reserve(most);
    live->slots.reserve(most);
    live->values.reserve(most * record_bytes_);
  }
  return ForEachWrittenPage(first_page, end_page, [&](uint64_t page, const uint8_t* data) {
    CollectLiveRecords(data, page * records_per_page_, /*with_deletions=*/true, live);
    return Status::OK();
  });
}

namespace {

constexpr size_t kTailRunsPerLevel = 4;     // runs of one size at the tail before they are joined
constexpr uint64_t kRunLevelRows = 4096;    // the rows of a run at level 0, and 4x that a level up
constexpr uint64_t kRunIdsPerMerge = 64;    // run numbers a merge takes: its run and the joined ones
// Overlays hold at most a quarter of the bottom's rows: past that, rewriting the bottom costs at
// most 4 rows written a row moved, and reads through the overlays stay few.
constexpr uint64_t kBottomRowsPerOverlayEntry = 4;

int RunLevel(uint64_t rows) {
  int level = 0;
  for (rows /= kRunLevelRows; rows >= 4; rows /= 4) ++level;
  return level;
}

}  // namespace

uint64_t KVStore::OverlayCapacity(uint64_t bottom_rows) const {
  uint64_t capacity = bottom_rows / kBottomRowsPerOverlayEntry;
  // The overlays' filters take no more memory than the index's budget.
  if (options_.index_budget_bytes) {
    capacity = std::min(capacity, options_.index_budget_bytes * 8 / BloomFilter::kBitsPerKey);
  }
  return capacity;
}

FilterSize KVStore::BottomFilter(uint64_t run_rows, uint64_t bottom_rows) const {
  // The bottom's filters take no more memory than the index's budget: fewer bits a key as it grows.
  const uint64_t bits =
      options_.index_budget_bytes
          ? std::min(BloomFilter::kBitsPerKey, options_.index_budget_bytes * 8 / std::max<uint64_t>(1, bottom_rows))
          : BloomFilter::kBitsPerKey;
  return FilterSize{run_rows, bits};
}

Status KVStore::WriteRun(uint64_t id, const FilterSize& filter, const std::vector<EntrySource*>& newest_first,
                         bool keep_deletions, std::shared_ptr<const BaseRun>* out) {
  out->reset();
  std::unique_ptr<BaseRunWriter> writer;
  MLKV_RETURN_IF_ERROR(BaseRunWriter::Create(RunPath(id), value_bytes_, id, filter, &writer));
  MLKV_RETURN_IF_ERROR(MergeEntries(newest_first, keep_deletions, writer.get()));
  base_rows_written_ += writer->entries();
  MLKV_RETURN_IF_ERROR(writer->Finish());
  if (writer->entries() == 0) {
    unlink(RunPath(id).c_str());  // nothing to hold (every row deleted, or none moved)
    return Status::OK();
  }
  std::unique_ptr<BaseRun> run;
  MLKV_RETURN_IF_ERROR(BaseRun::Open(RunPath(id), value_bytes_, id, direct_io_, &run));
  *out = std::move(run);
  return Status::OK();
}

Status KVStore::JoinTailRuns(std::vector<std::shared_ptr<const BaseRun>>* runs, std::vector<uint64_t>* ids,
                             uint64_t* next_id, uint64_t end_id) {
  uint64_t bottom_rows = 0;
  for (const auto& run : *runs) bottom_rows += run->rows();
  for (;;) {
    const size_t n = runs->size();
    const int level = n ? RunLevel(runs->back()->rows()) : 0;
    size_t same = 0;
    while (same < n && RunLevel((*runs)[n - 1 - same]->rows()) == level) ++same;
    if (same < kTailRunsPerLevel || *next_id == end_id) return Status::OK();
    // Disjoint and in key order: the runs' rows one after another are the joined run's.
    const uint64_t id = (*next_id)++;
    RunsSource tail({runs->end() - static_cast<std::ptrdiff_t>(same), runs->end()});
    uint64_t rows = 0;
    for (size_t r = n - same; r < n; ++r) rows += (*runs)[r]->rows();
    std::shared_ptr<const BaseRun> joined;
    MLKV_RETURN_IF_ERROR(WriteRun(id, BottomFilter(rows, bottom_rows), {&tail}, /*keep_deletions=*/false, &joined));
    runs->resize(n - same);
    ids->resize(n - same);
    runs->push_back(std::move(joined));
    ids->push_back(id);
  }
}

Status KVStore::JoinOverlays(std::vector<std::shared_ptr<const BaseRun>>* overlays, std::vector<uint64_t>* ids,
                             uint64_t* next_id, uint64_t end_id) {
  // As a binary counter carries: an overlay joins the one before it when it holds half as much or more.
  while (overlays->size() >= 2 && *next_id != end_id) {
    const size_t n = overlays->size();
    const BaseRun& newer = *(*overlays)[n - 1];
    const BaseRun& older = *(*overlays)[n - 2];
    if (newer.entries() * 2 < older.entries()) return Status::OK();
    const uint64_t id = (*next_id)++;
    RunsSource newer_source({(*overlays)[n - 1]}), older_source({(*overlays)[n - 2]});
    std::shared_ptr<const BaseRun> joined;
    MLKV_RETURN_IF_ERROR(WriteRun(id, FilterSize{newer.rows() + older.rows()}, {&newer_source, &older_source},
                                  /*keep_deletions=*/true, &joined));
    overlays->resize(n - 2);
    ids->resize(n - 2);
    if (joined) {
      overlays->push_back(std::move(joined));
      ids->push_back(id);
    }
  }
  return Status::OK();
}

Status KVStore::AddOverlay(const BaseRuns& old_base, const std::vector<BaseEntry>& moved, uint64_t run_id,
                           uint64_t end_id, BaseRunsParts* next) {
  // Whether the base held each key before: a deletion of a key it did not hold needs no record,
  // and the count of its rows changes by the keys it gains and loses.
  std::vector<int64_t> keys(moved.size());
  std::unique_ptr<bool[]> held(new bool[moved.size() + 1]);
  std::vector<size_t> unknown;
  for (size_t i = 0; i < moved.size(); ++i) {
    keys[i] = moved[i].key;
    const BaseRun::Presence presence = old_base.PresenceOf(keys[i]);
    held[i] = presence == BaseRun::Presence::kPresent;
    if (presence == BaseRun::Presence::kMaybe) unknown.push_back(i);
  }
  if (!unknown.empty()) {  // read outside the gets' counters: the merge's I/O, not theirs
    std::vector<int64_t> unknown_keys;
    for (size_t i : unknown) unknown_keys.push_back(keys[i]);
    std::vector<uint8_t> values(unknown.size() * value_bytes_);
    std::unique_ptr<bool[]> found(new bool[unknown.size()]);
    MLKV_RETURN_IF_ERROR(
        old_base.Lookup(unknown_keys.data(), unknown.size(), values.data(), found.get(), reader_.get(), nullptr));
    for (size_t j = 0; j < unknown.size(); ++j) held[unknown[j]] = found[j];
  }
  std::vector<BaseEntry> entries;
  uint64_t rows = old_base.rows(), filter_keys = 0;
  for (size_t i = 0; i < moved.size(); ++i) {
    const bool row = moved[i].value != nullptr;
    if (!row && !held[i]) continue;
    entries.push_back(moved[i]);
    filter_keys += row;
    rows += row && !held[i];
    rows -= !row && held[i];
  }
  VectorSource source(entries);
  std::shared_ptr<const BaseRun> run;
  MLKV_RETURN_IF_ERROR(WriteRun(run_id, FilterSize{filter_keys}, {&source}, /*keep_deletions=*/true, &run));
  next->runs = old_base.runs();
  next->overlays = old_base.overlays();
  next->manifest.runs = old_base.manifest().runs;
  next->manifest.overlays = old_base.manifest().overlays;
  next->manifest.rows = rows;
  if (run) {
    next->overlays.push_back(std::move(run));
    next->manifest.overlays.push_back(run_id);
  }
  uint64_t next_id = run_id + 1;
  return JoinOverlays(&next->overlays, &next->manifest.overlays, &next_id, end_id);
}

Status KVStore::WriteBase(uint64_t generation, uint64_t run_id, const std::shared_ptr<const BaseRuns>& old_base,
                          const LiveRecords& moved, std::vector<size_t>& order, std::shared_ptr<const BaseRuns>* out) {
  const uint64_t end_id = run_id + kRunIdsPerMerge;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return moved.keys[a] < moved.keys[b]; });
  std::vector<BaseEntry> entries;  // the moved rows and deletions, in key order
  entries.reserve(order.size());
  for (size_t i : order) {
    const uint8_t* value = moved.values.data() + i * record_bytes_ + sizeof(RecordHeader);
    entries.push_back({moved.keys[i], IsDeletion(moved.slots[i]) ? nullptr : value});
  }
  VectorSource moved_source(entries);
  BaseRunsParts next;
  const uint64_t old_rows = old_base ? old_base->rows() : 0;
  std::shared_ptr<const BaseRun> run;
  // Rows written in key order (a table filled front to back) lie past the bottom: they add a run.
  if (!old_base || entries.empty() || (old_base->overlays().empty() && entries.front().key > old_base->last_key())) {
    if (old_base) {
      next.runs = old_base->runs();
      next.overlays = old_base->overlays();
      next.manifest = old_base->manifest();
    }
    const uint64_t bottom_rows = (old_base ? old_base->bottom_rows() : 0) + entries.size();
    MLKV_RETURN_IF_ERROR(WriteRun(run_id, BottomFilter(entries.size(), bottom_rows), {&moved_source},
                                  /*keep_deletions=*/false, &run));
    next.manifest.rows = old_rows + (run ? run->rows() : 0);
    if (run) {
      next.runs.push_back(std::move(run));
      next.manifest.runs.push_back(run_id);
    }
    uint64_t next_id = run_id + 1;
    MLKV_RETURN_IF_ERROR(JoinTailRuns(&next.runs, &next.manifest.runs, &next_id, end_id));
  } else if (old_base->bottom_rows() > 0 &&
             old_base->overlay_entries() + entries.size() <= OverlayCapacity(old_base->bottom_rows())) {
    MLKV_RETURN_IF_ERROR(AddOverlay(*old_base, entries, run_id, end_id, &next));
  } else {  // the overlays are full: one bottom run of every row, newest first
    std::vector<std::unique_ptr<RunsSource>> overlay_sources;
    std::vector<EntrySource*> sources{&moved_source};
    for (auto it = old_base->overlays().rbegin(); it != old_base->overlays().rend(); ++it) {
      overlay_sources.push_back(std::make_unique<RunsSource>(std::vector<std::shared_ptr<const BaseRun>>{*it}));
      sources.push_back(overlay_sources.back().get());
    }
    RunsSource bottom(old_base->runs());
    sources.push_back(&bottom);
    const uint64_t most_rows = old_base->bottom_rows() + old_base->overlay_entries() + entries.size();
    MLKV_RETURN_IF_ERROR(WriteRun(run_id, BottomFilter(most_rows, most_rows), sources, /*keep_deletions=*/false, &run));
    next.manifest.rows = run ? run->rows() : 0;
    if (run) {
      next.runs.push_back(std::move(run));
      next.manifest.runs.push_back(run_id);
    }
  }
  MLKV_RETURN_IF_ERROR(WriteBaseManifest(BasePath(generation), generation, next.manifest));
  *out = std::make_shared<const BaseRuns>(std::move(next.runs), std::move(next.overlays), std::move(next.manifest));
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
  // (The analysis cannot see that the lambda runs under this function's lock.)
  index_.ForEachLocated(
      moved.keys.size(), [&](size_t i) { return moved.keys[i]; },
      [&](size_t i, const HashIndex::Where& w) NO_THREAD_SAFETY_ANALYSIS {
        // A key written or deleted since has a newer record, which supersedes what moved.
        if (index_.EraseIf(w, moved.slots[i])) MoveLive(moved.slots[i], kNone);
      });
  if (base_) unnamed_bases_.push_back(base_generation_);
  base_runs_of_[generation] = base->all_ids();
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
