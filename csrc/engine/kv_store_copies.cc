// KVStore's background copies from disk to the tail of the log: lookahead (rows the caller will
// need) and promotion (hot rows a get read from disk twice, found by a doorkeeper filter).
#include "kv_store.h"

#include <cstring>
#include <exception>

#include "log_format.h"
#include "serial_executor.h"

namespace mlkv {

namespace {

constexpr size_t kMaxQueuedPromotions = 8;    // beyond this, promotions are dropped rather than queued

constexpr size_t kMaxQueuedLookaheads = 32;   // beyond this, the oldest queued lookahead is dropped

}  // namespace

bool KVStore::SeenRecently(int64_t key) {
  const uint64_t h = static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull;
  const uint64_t bit = (h >> 40) % (kDoorkeeperWords * 64);
  std::atomic<uint64_t>& word = doorkeeper_[bit / 64];
  const uint64_t mask = uint64_t{1} << (bit % 64);
  if (word.load(std::memory_order_relaxed) & mask) return true;
  word.fetch_or(mask, std::memory_order_relaxed);
  // Ages the filter: once a quarter of the bits were set, start afresh.
  if (doorkeeper_marks_.fetch_add(1, std::memory_order_relaxed) + 1 >= kDoorkeeperWords * 16) {
    doorkeeper_marks_ = 0;
    for (auto& w : doorkeeper_) w.store(0, std::memory_order_relaxed);
  }
  return false;
}

void KVStore::QueuePromotions(const int64_t* keys, const std::vector<DiskRecord>& reads, const uint8_t* values) {
  CopyJob job;
  for (const DiskRecord& r : reads) {
    if (!SeenRecently(keys[r.index])) continue;
    job.keys.push_back(keys[r.index]);
    job.slots.push_back(r.slot);
    job.values.insert(job.values.end(), values + r.index * value_bytes_, values + (r.index + 1) * value_bytes_);
  }
  if (job.keys.empty()) return;
  MutexLock lock(&lookahead_mu_);
  size_t queued_promotions = 0;
  for (const CopyJob& j : lookahead_queue_) queued_promotions += !j.slots.empty();
  if (queued_promotions >= kMaxQueuedPromotions || lookahead_stop_) return;
  lookahead_queue_.push_back(std::move(job));
  ScheduleCopiesLocked();
}

Status KVStore::Lookahead(const int64_t* keys, size_t n) {
  MLKV_RETURN_IF_ERROR(RefuseWrite("lookahead"));
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  {
    ReaderLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  }
  if (n == 0) return Status::OK();
  MutexLock lock(&lookahead_mu_);
  if (lookahead_stop_) return Status::InvalidArgument("store at " + path_ + " is closed");
  CopyJob job;
  job.keys.assign(keys, keys + n);
  lookahead_queue_.push_back(std::move(job));
  // A hint, not a promise: under a backlog the oldest lookahead (most likely
  // for a batch already past) goes, so flush() and checkpoint() never wait long.
  size_t queued = 0;
  for (const CopyJob& j : lookahead_queue_) queued += j.slots.empty();
  if (queued > kMaxQueuedLookaheads) {
    for (auto it = lookahead_queue_.begin(); it != lookahead_queue_.end(); ++it) {
      if (it->slots.empty()) {
        lookahead_dropped_rows_ += it->keys.size();
        lookahead_queue_.erase(it);
        break;
      }
    }
  }
  ScheduleCopiesLocked();
  return Status::OK();
}

void KVStore::ScheduleCopiesLocked() {
  if (lookahead_scheduled_) return;
  SerialExecutor::Of("mlkv-copy").Submit([this] { RunCopies(); });  // the task takes lookahead_mu_ first
  lookahead_scheduled_ = true;
}

void KVStore::RunCopies() {
  MutexLock lock(&lookahead_mu_);
  while (!lookahead_queue_.empty()) {
    CopyJob job = std::move(lookahead_queue_.front());
    lookahead_queue_.pop_front();
    lookahead_busy_ = true;
    lock.Unlock();
    Status st;
    try {
      if (job.slots.empty()) {
        st = LookaheadBatch(job.keys);
      } else {
        WriterLock store_lock(&mu_);
        if (!closed_) {
          st = ApplyCopies(job.keys.data(), job.slots.data(), job.values.data(), job.keys.size(), CopyKind::kPromotion);
        }
      }
    } catch (const std::exception& e) {  // e.g. bad_alloc: reported by the next flush, not fatal
      st = Status::IOError(std::string("lookahead: ") + e.what());
    }
    lock.Lock();
    lookahead_busy_ = false;
    if (!st.ok() && lookahead_error_.ok()) lookahead_error_ = st;
    lookahead_idle_.notify_all();
  }
  lookahead_scheduled_ = false;
  lookahead_idle_.notify_all();
}

// Reads the on-disk rows among `keys` and appends them at the tail, unless a
// newer version was written while the read was in flight.
Status KVStore::LookaheadBatch(const std::vector<int64_t>& keys) {
  std::vector<DiskRecord> reads;
  std::vector<int64_t> read_keys;
  {
    ReaderLock lock(&mu_);
    if (closed_) return Status::OK();
    const uint64_t head = HeadSlot();
    for (int64_t key : keys) {
      uint64_t slot = index_.Find(key);
      if (slot == kNone || IsDeletion(slot) || slot >= head) continue;  // rows of the base run are not looked ahead
      reads.push_back(DiskRecord{read_keys.size(), slot});
      read_keys.push_back(key);
    }
  }
  if (reads.empty()) return Status::OK();
  std::vector<uint8_t> values(reads.size() * value_bytes_);
  Status st = ReadFromDisk(read_keys.data(), reads, values.data());
  if (st.code() == Status::Code::kBusy) return Status::OK();  // compacted meanwhile: the hint lapses
  MLKV_RETURN_IF_ERROR(st);
  std::vector<uint64_t> slots(reads.size());
  for (const DiskRecord& r : reads) slots[r.index] = r.slot;
  WriterLock lock(&mu_);
  if (closed_) return Status::OK();
  return ApplyCopies(read_keys.data(), slots.data(), values.data(), read_keys.size(), CopyKind::kLookahead);
}

Status KVStore::ApplyCopies(const int64_t* keys, const uint64_t* slots, const uint8_t* rows, size_t n, CopyKind kind,
                            bool values_only) {
  const uint64_t head = HeadSlot();
  const size_t stride = values_only ? value_bytes_ : record_bytes_;
  uint64_t copied = 0;
  for (size_t i = 0; i < n; ++i) {
    // A row already in memory needs no lookahead; compaction copies it regardless.
    if (kind != CopyKind::kCompaction && slots[i] >= head) continue;
    // One index lookup: point the key at the slot the append will take, unless
    // it was superseded or deleted since it was read; undo if the append fails.
    const uint64_t fresh = tail_;
    if (!index_.UpdateIf(keys[i], slots[i], fresh)) continue;
    uint64_t appended;
    Status st =
        values_only ? Append(keys[i], 0, rows + i * stride, &appended) : AppendRecord(rows + i * stride, &appended);
    if (!st.ok()) {
      index_.UpdateIf(keys[i], fresh, slots[i]);
      return st;
    }
    MoveLive(slots[i], fresh);
    ++copied;
  }
  switch (kind) {
    case CopyKind::kLookahead: lookahead_rows_ += copied; break;
    case CopyKind::kPromotion: promoted_rows_ += copied; break;
    case CopyKind::kCompaction: compacted_rows_ += copied; break;
  }
  return MaybeAutoCompactLocked();
}

Status KVStore::Flush() {
  {
    ReaderLock store_lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  }
  Status st;
  {
    MutexLock lock(&lookahead_mu_);
    while (!lookahead_queue_.empty() || lookahead_busy_) lookahead_idle_.wait(lock.native());
    st = lookahead_error_;
    lookahead_error_ = Status::OK();
  }
  MutexLock lock(&compaction_state_mu_);
  while (compaction_running_ || compaction_requested_) compaction_idle_.wait(lock.native());
  if (st.ok()) st = compaction_error_;
  compaction_error_ = Status::OK();
  return st;
}

}  // namespace mlkv
