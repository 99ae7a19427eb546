// KVStore's compaction: live rows of the oldest segments copied to the tail so their files can go,
// run in the background when the on-disk log outgrows the live rows, and the write stall that
// keeps writers from outrunning it.
#include "kv_store.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include "file_io.h"
#include "log_format.h"
#include "serial_executor.h"

namespace mlkv {

Status KVStore::Compact() {
  MLKV_RETURN_IF_ERROR(RefuseWrite("compact"));
  MLKV_RETURN_IF_ERROR(RefuseIfBegun("compact"));
  Status background = Flush();
  if (background.code() == Status::Code::kInvalidArgument) return background;  // closed
  MutexLock one_at_a_time(&compaction_mu_);
  bool compacted = false;
  MLKV_RETURN_IF_ERROR(CompactSegments(/*all=*/true, &compacted));
  if (!compacted) MLKV_RETURN_IF_ERROR(CheckpointConcurrently());  // nothing to copy: it still ends with one
  return background;
}

bool KVStore::CompactionDueLocked(double ratio, bool stalling) const {
  // The index past its budget (twice it, for a writer to wait): its written keys move into the base run.
  if (IndexOverBudgetLocked(stalling ? 2 : 1) && flusher_.flushed_page() > PageOf(begin_)) return true;
  if (options_.compaction_ratio == 0.0) return false;
  const uint64_t on_disk_slots = ReadOnlySlot() - begin_;
  if (on_disk_slots < 2 * pages_per_segment_ * records_per_page_) return false;
  // Live rows are the base's too: a log that holds only the rows written since the last merge is
  // short of them, and would merge (rewriting base runs) each time a few hot keys were rewritten.
  const uint64_t live = index_.size() + (base_ ? base_->rows() : 0);
  return static_cast<double>(on_disk_slots) > ratio * static_cast<double>(live);
}

// Writers can append faster than compaction reclaims; past 1.25x the
// compaction threshold a write waits for it (holding no lock), as an LSM
// tree stalls writes, so disk use stays bounded.
void KVStore::StallForCompaction() {
  if (options_.compaction_ratio == 0.0 && options_.index_budget_bytes == 0) return;
  for (int round = 0; round < 64; ++round) {
    {
      ReaderLock lock(&mu_);
      if (closed_ || !CompactionDueLocked(options_.compaction_ratio * 1.25, /*stalling=*/true)) return;
    }
    {
      WriterLock lock(&mu_);
      if (!MaybeAutoCompactLocked().ok()) return;
    }
    MutexLock state(&compaction_state_mu_);
    if (compaction_stop_ || !compaction_error_.ok()) return;
    while (!compaction_stop_ && (compaction_running_ || compaction_requested_)) compaction_idle_.wait(state.native());
    ++write_stalls_;
  }
}

Status KVStore::MaybeAutoCompactLocked() {
  if (!CompactionDueLocked(options_.compaction_ratio)) return Status::OK();
  MutexLock lock(&compaction_state_mu_);
  if (compaction_stop_ || compaction_requested_) return Status::OK();
  compaction_requested_ = true;
  if (!compaction_scheduled_) {
    SerialExecutor::Of("mlkv-compact").Submit([this] { RunCompactions(); });  // takes compaction_state_mu_ first
    compaction_scheduled_ = true;
  }
  return Status::OK();
}

void KVStore::RunCompactions() {
  MutexLock state(&compaction_state_mu_);
  while (compaction_requested_ && !compaction_stop_) {
    compaction_requested_ = false;
    compaction_running_ = true;
    state.Unlock();
    Status st;
    {
      MutexLock one_at_a_time(&compaction_mu_);
      bool due;
      {
        ReaderLock lock(&mu_);
        due = !closed_ && CompactionDueLocked(options_.compaction_ratio);
      }
      bool compacted = false;
      try {
        if (due) st = CompactSegments(/*all=*/false, &compacted);
      } catch (const std::exception& e) {
        st = Status::IOError(std::string("compaction: ") + e.what());
      }
    }
    state.Lock();
    compaction_running_ = false;
    if (!st.ok() && compaction_error_.ok()) compaction_error_ = st;
    compaction_idle_.notify_all();
  }
  compaction_requested_ = false;
  compaction_scheduled_ = false;
  compaction_idle_.notify_all();
}

Status KVStore::SegmentsToCompact(bool all, uint64_t* first, uint64_t* end) {
  const uint64_t slots_per_segment = pages_per_segment_ * records_per_page_;
  ReaderLock lock(&mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  *first = begin_ / slots_per_segment;
  const uint64_t full_end = flusher_.flushed_page() / pages_per_segment_;  // segments wholly written
  auto live = [&](uint64_t s) REQUIRES_SHARED(mu_) { return s < live_per_segment_.size() ? live_per_segment_[s] : 0; };
  *end = full_end;
  if (all) return Status::OK();
  int64_t garbage = 0;
  for (uint64_t s = *first; s < full_end; ++s) garbage += static_cast<int64_t>(slots_per_segment) - live(s);
  int64_t reclaimed = 0;
  *end = *first;
  while (*end < full_end && 2 * reclaimed < garbage)
    reclaimed += static_cast<int64_t>(slots_per_segment) - live((*end)++);
  return Status::OK();
}

void KVStore::CollectLiveRecords(const uint8_t* page, uint64_t first_slot, bool with_deletions, LiveRecords* live) {
  ReaderLock lock(&mu_);
  auto key_at = [&](size_t i) { return KeyInPage(page, first_slot + i); };
  index_.ForEachLocated(records_per_page_, key_at,
                        [&](size_t i, const HashIndex::Where& where) NO_THREAD_SAFETY_ANALYSIS {
                          const uint64_t slot = first_slot + i;
                          const uint8_t* rec = page + OffsetInPage(slot);
                          RecordHeader h;
                          std::memcpy(&h, rec, sizeof(h));
                          const bool deletion = (h.flags & kFlagTombstone) != 0;
                          if (deletion && !with_deletions) return;
                          // Live: the index names this record (a deletion names its tombstone with the bit).
                          const uint64_t address = deletion ? slot | kDeletionBit : slot;
                          if (index_.Find(where) != address) return;  // superseded
                          live->keys.push_back(h.key);
                          live->slots.push_back(address);
                          live->values.insert(live->values.end(), rec, rec + record_bytes_);
                        });
}

Status KVStore::CopyLiveRecords(LiveRecords* live) {
  if (live->keys.empty()) return Status::OK();
  WriterLock lock(&mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  Status st = ApplyCopies(live->keys.data(), live->slots.data(), live->values.data(), live->keys.size(),
                          CopyKind::kCompaction, /*values_only=*/false);
  live->keys.clear();
  live->slots.clear();
  live->values.clear();
  return st;
}

Status KVStore::CopyLiveRecordsOfSegment(uint64_t segment, LiveRecords* live) {
  constexpr size_t kChunkRows = 4096;
  return ForEachWrittenPage(segment * pages_per_segment_, (segment + 1) * pages_per_segment_,
                            [&](uint64_t page, const uint8_t* data) {
                              CollectLiveRecords(data, page * records_per_page_, /*with_deletions=*/false, live);
                              return live->keys.size() >= kChunkRows ? CopyLiveRecords(live) : Status::OK();
                            });
}

Status KVStore::ForEachWrittenPage(uint64_t first_page, uint64_t end_page,
                                   const std::function<Status(uint64_t page, const uint8_t* data)>& each) {
  constexpr uint64_t kReadBytes = 1 << 20;
  const uint64_t most = std::max<uint64_t>(1, std::min(kReadBytes / page_bytes_, end_page - first_page));
  AlignedBuffer buffer(most * page_bytes_);
  for (uint64_t page = first_page; page < end_page;) {
    const uint64_t segment_end = (SegmentOfPage(page) + 1) * pages_per_segment_;
    const uint64_t count = std::min({most, end_page - page, segment_end - page});
    MLKV_RETURN_IF_ERROR(ReadWrittenPages(page, count, buffer.data));
    for (uint64_t p = 0; p < count; ++p) MLKV_RETURN_IF_ERROR(each(page + p, buffer.data + p * page_bytes_));
    page += count;
  }
  return Status::OK();
}

Status KVStore::ReadWrittenPages(uint64_t first_page, uint64_t count, uint8_t* buffer) {
  std::shared_ptr<SegmentFiles::File> file;
  MLKV_RETURN_IF_ERROR(segments_.Open(SegmentOfPage(first_page), SegmentFiles::OpenMode::kMustExist, &file));
  const uint64_t offset = (first_page % pages_per_segment_) * page_bytes_;
  MLKV_RETURN_IF_ERROR(ReadExactly(file->fd, buffer, count * page_bytes_, offset, file->path));
  for (uint64_t p = 0; p < count; ++p) {
    const uint64_t first_slot = (first_page + p) * records_per_page_;
    for (uint64_t slot = first_slot; slot < first_slot + records_per_page_; ++slot) {
      const uint64_t at = p * page_bytes_ + OffsetInPage(slot);
      MLKV_RETURN_IF_ERROR(VerifyRecord(buffer + at, file->path, offset + at));
    }
  }
  return Status::OK();
}

Status KVStore::CompactSegments(bool all, bool* compacted) {
  *compacted = false;
  bool into_base, whole_log;
  {
    ReaderLock lock(&mu_);
    into_base = options_.index_budget_bytes > 0 || base_;
    whole_log = all || IndexOverBudgetLocked();
  }
  if (into_base) {  // the log's written pages into the base run: the merge is the compaction
    uint64_t end_slot = ~0ull;
    if (!whole_log) {
      uint64_t first, end;
      MLKV_RETURN_IF_ERROR(SegmentsToCompact(false, &first, &end));
      end_slot = end * pages_per_segment_ * records_per_page_;
    }
    MLKV_RETURN_IF_ERROR(MergeIntoBase(end_slot, compacted));
    if (!*compacted) return Status::OK();
    return all || !options_.cut_checkpoints ? CheckpointConcurrently(nullptr, /*unless_owner_begun=*/!all)
                                            : Status::OK();
  }
  uint64_t first, end;
  MLKV_RETURN_IF_ERROR(SegmentsToCompact(all, &first, &end));
  if (end <= first) return Status::OK();
  LiveRecords live;
  for (uint64_t s = first; s < end; ++s) MLKV_RETURN_IF_ERROR(CopyLiveRecordsOfSegment(s, &live));
  MLKV_RETURN_IF_ERROR(CopyLiveRecords(&live));
  {
    WriterLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    begin_ = end * pages_per_segment_ * records_per_page_;
    for (uint64_t s = first; s < end; ++s) {
      segments_.Forget(s);  // readers holding the file keep its descriptor
      compacted_segments_.push_back(s);
    }
    ++compactions_;
    *compacted = true;
  }
  // On failure, or when the store's owner takes the checkpoints, the segments go at the next one.
  return all || !options_.cut_checkpoints ? CheckpointConcurrently(nullptr, /*unless_owner_begun=*/!all) : Status::OK();
}

}  // namespace mlkv
