#include "kv_store.h"

#include <fcntl.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "crc32c.h"
#include "file_io.h"
#include "log_format.h"
#include "serial_executor.h"

namespace mlkv {
namespace {

constexpr uint64_t kHugePageBytes = 2ull << 20;
constexpr size_t kMaxUnitsPerRound = 4096;  // bounds the read buffer of one get
constexpr uint64_t kNone = HashIndex::kNoAddress;

}  // namespace

uint32_t ElementSize(ElementType t) {
  switch (t) {
    case ElementType::kFloat32: return 4;
    case ElementType::kFloat16: return 2;
    case ElementType::kBFloat16: return 2;
  }
  return 0;
}

constexpr size_t kDoorkeeperWords = 1 << 14;  // 1M bits
constexpr size_t kMaxQueuedPromotions = 8;    // beyond this, promotions are dropped rather than queued
constexpr size_t kMaxQueuedLookaheads = 32;   // beyond this, the oldest queued lookahead is dropped

KVStore::KVStore(const std::string& path, const StoreOptions& options)
    : path_(path),
      options_(options),
      segments_(path),
      flusher_(&segments_),
      index_(options.expected_keys),
      doorkeeper_(kDoorkeeperWords) {}

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
  std::lock_guard<std::mutex> lock(lookahead_mu_);
  size_t queued_promotions = 0;
  for (const CopyJob& j : lookahead_queue_) queued_promotions += !j.slots.empty();
  if (queued_promotions >= kMaxQueuedPromotions || lookahead_stop_) return;
  lookahead_queue_.push_back(std::move(job));
  ScheduleCopiesLocked();
}

Status KVStore::Open(const std::string& path, const StoreOptions& options, std::unique_ptr<KVStore>* out) {
  if (path.empty()) return Status::InvalidArgument("path is empty");
  if (options.dim == 0 || options.dim > (1u << 20)) {
    return Status::InvalidArgument("dim must be in [1, 1048576], got " + std::to_string(options.dim));
  }
  if (ElementSize(options.element_type) == 0) return Status::InvalidArgument("unknown element type");
  if (options.expected_keys > HashIndex::kMaxExpectedKeys) {  // its index could not be sized
    return Status::InvalidArgument("expected_rows must be at most " + std::to_string(HashIndex::kMaxExpectedKeys) +
                                   ", got " + std::to_string(options.expected_keys));
  }
  if (!(options.mutable_fraction > 0.0 && options.mutable_fraction < 1.0)) {
    return Status::InvalidArgument("mutable_fraction must be in (0, 1)");
  }
  if (options.compaction_ratio != 0.0 && options.compaction_ratio < 1.2) {
    return Status::InvalidArgument("compaction_ratio must be 0 (off) or at least 1.2, got " +
                                   std::to_string(options.compaction_ratio));
  }
  std::unique_ptr<KVStore> store(new KVStore(path, options));
  MLKV_RETURN_IF_ERROR(store->Init());
  *out = std::move(store);
  return Status::OK();
}

Status KVStore::Init() {
  struct stat st;
  if (stat(path_.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("path " + path_ + " exists and is not a directory");
  }
  MLKV_RETURN_IF_ERROR(MakeDirectories(path_));
  if (access(path_.c_str(), W_OK) != 0) return Status::InvalidArgument("store directory " + path_ + " is not writable");
  const std::string lock_path = path_ + "/LOCK";
  lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) return Status::InvalidArgument("cannot create " + lock_path + ": " + ErrnoText(errno));
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    close(lock_fd_);
    lock_fd_ = -1;
    return Status::Busy("store at " + path_ + " is already open (in this or another process)");
  }
  // O_DIRECT works on most file systems but not on tmpfs; probe once.
  direct_io_ = false;
  if (options_.direct_io) {
    const std::string probe = path_ + "/.direct_probe";
    int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      direct_io_ = true;
      close(fd);
    }
    unlink(probe.c_str());
  }
  // A quarter of the descriptor limit for segment files, the rest for the process.
  size_t max_open_files = 256;
  struct rlimit files_limit;
  if (getrlimit(RLIMIT_NOFILE, &files_limit) == 0 && files_limit.rlim_cur != RLIM_INFINITY) {
    max_open_files = std::min<size_t>(1024, std::max<size_t>(4, files_limit.rlim_cur / 4));
  }
  segments_.Configure(direct_io_, max_open_files);
  MLKV_RETURN_IF_ERROR(BlockReader::Create(options_.io_engine, options_.io_depth, options_.io_threads, &reader_));
  MLKV_RETURN_IF_ERROR(FileExists(path_ + "/CHECKPOINT") ? Recover() : CreateFresh());
  closed_ = false;
  return Status::OK();
}

Status KVStore::ComputeLayout(uint64_t page_bytes, uint64_t pages_per_segment) {
  value_bytes_ = options_.dim * ElementSize(options_.element_type);
  record_bytes_ = static_cast<uint32_t>(RoundUp(sizeof(RecordHeader) + value_bytes_, 8));
  unit_bytes_ = record_bytes_ <= kBlockBytes ? kBlockBytes : RoundUp(record_bytes_, kBlockBytes);
  records_per_unit_ = unit_bytes_ / record_bytes_;
  if (page_bytes == 0) {
    page_bytes = std::min<uint64_t>(1ull << 20, options_.memory_budget_bytes / 16) / unit_bytes_ * unit_bytes_;
    page_bytes = std::max(page_bytes, unit_bytes_);
  }
  if (page_bytes % unit_bytes_ != 0) {
    return Status::InvalidArgument("page_bytes must be a multiple of " + std::to_string(unit_bytes_));
  }
  page_bytes_ = page_bytes;
  records_per_page_ = page_bytes_ / unit_bytes_ * records_per_unit_;
  num_frames_ = options_.memory_budget_bytes / page_bytes_;
  if (num_frames_ < kMinLogPages) {
    return Status::InvalidArgument("memory_budget_bytes=" + std::to_string(options_.memory_budget_bytes) +
                                   " holds fewer than " + std::to_string(kMinLogPages) + " log pages of " +
                                   std::to_string(page_bytes_) + " bytes; use at least " +
                                   std::to_string(kMinLogPages * page_bytes_));
  }
  mutable_pages_ = static_cast<uint64_t>(static_cast<double>(num_frames_) * options_.mutable_fraction);
  mutable_pages_ = std::min(std::max<uint64_t>(mutable_pages_, 1), num_frames_ - 1);
  div_records_per_page_ = FastDivisor(records_per_page_);
  div_records_per_unit_ = FastDivisor(records_per_unit_);
  div_num_frames_ = FastDivisor(num_frames_);
  pages_per_segment_ =
      pages_per_segment ? pages_per_segment : std::max<uint64_t>(1, options_.segment_bytes / page_bytes_);
  // Anonymous memory: zeroed, resident only once touched, and 2 MiB-aligned so
  // the kernel can use huge pages (random row reads would otherwise miss the
  // TLB on almost every row).
  const uint64_t frame_bytes = RoundUp(num_frames_ * page_bytes_, kHugePageBytes);
  frames_mapped_bytes_ = frame_bytes + kHugePageBytes;
  void* mapping =
      mmap(nullptr, frames_mapped_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping == MAP_FAILED) {
    return Status::IOError("cannot map " + std::to_string(frame_bytes) + " bytes of log pages: " + ErrnoText(errno));
  }
  frames_mapping_ = mapping;
  frames_ = reinterpret_cast<uint8_t*>(RoundUp(reinterpret_cast<uintptr_t>(mapping), kHugePageBytes));
  madvise(frames_, frame_bytes, MADV_HUGEPAGE);
  LogFlusher::Layout flush_layout;
  flush_layout.frames = frames_;
  flush_layout.page_bytes = page_bytes_;
  flush_layout.pages_per_segment = pages_per_segment_;
  flush_layout.num_frames = num_frames_;
  // Half the read-only frames, at most one write: the other half keeps a put from waiting.
  flush_layout.batch_pages =
      std::max<uint64_t>(1, std::min((num_frames_ - mutable_pages_) / 2, LogFlusher::kWriteBytes / page_bytes_));
  flusher_.Configure(flush_layout);
  return Status::OK();
}

Status KVStore::CreateFresh() {
  MLKV_RETURN_IF_ERROR(ComputeLayout(options_.page_bytes, 0));
  // The first checkpoint fixes dim and dtype on disk, so a reopen can check them.
  std::lock_guard<std::mutex> one_checkpoint(checkpoint_mu_);
  std::unique_lock<std::shared_mutex> lock(mu_);
  return CheckpointExclusively();
}

uint64_t KVStore::OffsetInPage(uint64_t slot) const {
  const uint64_t i = div_records_per_page_.Mod(slot);
  const uint64_t unit = div_records_per_unit_.Div(i);
  return unit * unit_bytes_ + (i - unit * records_per_unit_) * record_bytes_;
}

uint32_t KVStore::RecordChecksum(const uint8_t* rec) const {
  uint32_t crc = Crc32c(0, rec, 8);                                   // key
  crc = Crc32c(crc, rec + 12, 4);                                     // magic, flags
  return Crc32c(crc, rec + sizeof(RecordHeader), value_bytes_);       // value
}

void KVStore::WriteRecord(uint8_t* rec, int64_t key, uint16_t flags, const uint8_t* value) const {
  RecordHeader h{key, 0, kRecordMagic, flags};
  std::memcpy(rec, &h, sizeof(h));
  if (value == rec + sizeof(RecordHeader)) {
    // the value stays where it is
  } else if (value) {
    std::memcpy(rec + sizeof(RecordHeader), value, value_bytes_);
  } else {
    std::memset(rec + sizeof(RecordHeader), 0, value_bytes_);
  }
  uint32_t crc = RecordChecksum(rec);
  std::memcpy(rec + 8, &crc, 4);
}

Status KVStore::VerifyRecord(const uint8_t* rec, const std::string& file, uint64_t offset) const {
  RecordHeader h;
  std::memcpy(&h, rec, sizeof(h));
  if (h.magic != kRecordMagic) {
    return Status::Corruption(file + ": no record at byte offset " + std::to_string(offset) + " (bad magic)");
  }
  if (h.checksum != RecordChecksum(rec)) {
    return Status::Corruption(file + ": record at byte offset " + std::to_string(offset) + " (key " +
                              std::to_string(h.key) + ") fails its checksum");
  }
  if (h.key < 0)
    return Status::Corruption(file + ": record at byte offset " + std::to_string(offset) + " has a negative key");
  return Status::OK();
}

Status KVStore::CheckKeys(const int64_t* keys, size_t n) const {
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0) {
      return Status::InvalidArgument("keys must be non-negative; keys[" + std::to_string(i) +
                                     "] = " + std::to_string(keys[i]));
    }
  }
  return Status::OK();
}

void KVStore::MoveLive(uint64_t old_slot, uint64_t new_slot) {
  if (old_slot != kNone) --live_per_segment_[SegmentOfSlot(old_slot)];
  if (new_slot != kNone) {
    uint64_t s = SegmentOfSlot(new_slot);
    if (s >= live_per_segment_.size()) live_per_segment_.resize(s + 1, 0);
    ++live_per_segment_[s];
  }
}

// Makes room for `page` at the tail: pages that leave the mutable region are
// queued for writing, and the oldest page leaves memory once it is written.
Status KVStore::StartPage(uint64_t page) {
  if (read_only_page_ + mutable_pages_ < page + 1) {
    read_only_page_ = page + 1 - mutable_pages_;
    flusher_.MarkReadOnly(read_only_page_);
  }
  const uint64_t head = HeadPageWith(page);
  if (head_page_ < head) {
    // The frame to reuse holds a page not yet written: every reader of the store waits with us.
    if (flusher_.flushed_page() < head) {
      const auto began = std::chrono::steady_clock::now();
      MLKV_RETURN_IF_ERROR(flusher_.WaitFlushed(head));
      ++frame_waits_;
      frame_wait_ns_ += static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began).count());
    }
    head_page_ = head;
  }
  return Status::OK();
}

Status KVStore::ReserveSlot(uint64_t* slot, uint8_t** record) {
  if (tail_ > HashIndex::kMaxAddress) return Status::IOError("log address space exhausted at " + path_);
  if (tail_ % records_per_page_ == 0) MLKV_RETURN_IF_ERROR(StartPage(PageOf(tail_)));
  *slot = tail_;
  *record = RecordInMemory(tail_);
  ++tail_;
  ++appends_;
  ++changes_;
  return Status::OK();
}

Status KVStore::Append(int64_t key, uint16_t flags, const uint8_t* value, uint64_t* slot) {
  uint8_t* record;
  MLKV_RETURN_IF_ERROR(ReserveSlot(slot, &record));
  WriteRecord(record, key, flags, value);
  return Status::OK();
}

Status KVStore::AppendRecord(const uint8_t* record, uint64_t* slot) {
  uint8_t* target;
  MLKV_RETURN_IF_ERROR(ReserveSlot(slot, &target));
  std::memcpy(target, record, record_bytes_);
  return Status::OK();
}

size_t KVStore::MakeAppendRoom(size_t wanted) {
  uint64_t flush_to = 0;
  size_t room = 1;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return 1;  // the caller's locked part reports it
    // Pages below read_only_page_ can be written now; appends up to page read_only_page_ +
    // num_frames_ - 1 reuse only their frames.
    const uint64_t end_slot = (read_only_page_ + num_frames_) * records_per_page_;
    room = static_cast<size_t>(std::min<uint64_t>(wanted, end_slot > tail_ ? end_slot - tail_ : 1));
    room = std::max<size_t>(room, 1);
    flush_to = std::min(read_only_page_, HeadPageWith(PageOf(tail_ + room - 1)));
  }
  if (flush_to > flusher_.flushed_page())
    flusher_.WaitFlushed(flush_to);  // an error shows again where the append waits
  return room;
}

Status KVStore::Put(const int64_t* keys, size_t n, const void* values) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  const auto* vals = static_cast<const uint8_t*>(values);
  StallForCompaction();
  // In chunks whose appends reuse only frames already written: the wait for the disk happens
  // without the lock, not in StartPage under it, where every get of the store would wait too.
  for (size_t done = 0; done < n;) {
    const size_t end = done + MakeAppendRoom(n - done);
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    constexpr size_t kAhead = 8;
    HashIndex::Where ring[kAhead];
    for (size_t i = done; i < std::min(end, done + kAhead); ++i)
      index_.Prefetch(ring[i % kAhead] = index_.Locate(keys[i]));
    for (size_t i = done; i < end; ++i) {
      const HashIndex::Where where = ring[i % kAhead];
      if (i + kAhead < end) index_.Prefetch(ring[i % kAhead] = index_.Locate(keys[i + kAhead]));
      const uint8_t* value = vals + i * value_bytes_;
      uint64_t slot = index_.Find(where);
      if (slot != kNone && slot >= ReadOnlySlot()) {
        WriteRecord(RecordInMemory(slot), keys[i], 0, value);
        ++in_place_updates_;
        ++changes_;
        continue;
      }
      uint64_t fresh;
      MLKV_RETURN_IF_ERROR(Append(keys[i], 0, value, &fresh));
      MoveLive(index_.Upsert(keys[i], fresh), fresh);
    }
    done = end;
    if (done == n) return MaybeAutoCompactLocked();
  }
  return Status::OK();
}

Status KVStore::Delete(const int64_t* keys, size_t n, uint64_t* deleted) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  StallForCompaction();
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  *deleted = 0;
  for (size_t i = 0; i < n; ++i) {
    uint64_t slot = index_.Find(keys[i]);
    if (slot == kNone) continue;
    if (slot >= ReadOnlySlot()) {
      // The record is not on disk yet: turn it into a tombstone where it lies.
      uint8_t* rec = RecordInMemory(slot);
      WriteRecord(rec, keys[i], kFlagTombstone, rec + sizeof(RecordHeader));
      ++changes_;
    } else {
      uint64_t tomb;
      MLKV_RETURN_IF_ERROR(Append(keys[i], kFlagTombstone, nullptr, &tomb));
    }
    MoveLive(index_.Erase(keys[i]), kNone);
    ++*deleted;
  }
  return MaybeAutoCompactLocked();
}

Status KVStore::Contains(const int64_t* keys, size_t n, bool* found) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  for (size_t i = 0; i < n; ++i) found[i] = index_.Find(keys[i]) != kNone;
  return Status::OK();
}

Status KVStore::Get(const int64_t* keys, size_t n, void* values, std::vector<int64_t>* missing) {
  return ReadRows(keys, n, static_cast<uint8_t*>(values), missing, nullptr);
}

Status KVStore::Lookup(const int64_t* keys, size_t n, void* values, bool* found) {
  return ReadRows(keys, n, static_cast<uint8_t*>(values), nullptr, found);
}

Status KVStore::ReadRows(const int64_t* keys, size_t n, uint8_t* out, std::vector<int64_t>* missing, bool* found) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  // A compaction can delete a segment between the index lookup and the read;
  // the rows have moved by then, so looking them up again finds them.
  for (int attempt = 0;; ++attempt) {
    if (missing) missing->clear();
    Status st = GetOnce(keys, n, out, missing, found);
    if (st.code() != Status::Code::kBusy) return st;
    if (attempt == 8) return Status::IOError(st.message());
  }
}

Status KVStore::GetOnce(const int64_t* keys, size_t n, uint8_t* out, std::vector<int64_t>* missing, bool* found) {
  std::vector<DiskRecord> reads;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    const uint64_t head = HeadSlot();
    uint64_t hits = 0;
    // A three-stage pipeline: locate key i+2D and prefetch its buckets, find
    // key i+D and prefetch its record, copy row i; the cache misses overlap.
    constexpr size_t kD = 8;
    HashIndex::Where where[2 * kD];
    uint64_t slot_of[2 * kD];
    auto stage_locate = [&](size_t j) { index_.Prefetch(where[j % (2 * kD)] = index_.Locate(keys[j])); };
    auto stage_find = [&](size_t j) {
      const uint64_t slot = index_.Find(where[j % (2 * kD)]);
      slot_of[j % (2 * kD)] = slot;
      if (slot != kNone && slot >= head) {
        const uint8_t* rec = RecordInMemory(slot);
        for (uint32_t line = 0; line < record_bytes_ && line < 1024; line += 64) __builtin_prefetch(rec + line);
      }
    };
    for (size_t j = 0; j < std::min(n, 2 * kD); ++j) stage_locate(j);
    for (size_t j = 0; j < std::min(n, kD); ++j) stage_find(j);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t slot = slot_of[i % (2 * kD)];
      if (i + kD < n) stage_find(i + kD);          // reads where[(i + kD) % 2kD]
      if (i + 2 * kD < n) stage_locate(i + 2 * kD);  // overwrites where[i % 2kD], no longer needed
      if (found) found[i] = slot != kNone;
      if (slot == kNone) {
        if (missing) missing->push_back(keys[i]);
      } else if (slot >= head) {
        std::memcpy(out + i * value_bytes_, RecordInMemory(slot) + sizeof(RecordHeader), value_bytes_);
        ++hits;
      } else {
        reads.push_back(DiskRecord{i, slot});
      }
    }
    memory_hits_ += hits;
    if (missing && !missing->empty())
      return Status::NotFound(std::to_string(missing->size()) + " keys not in store " + path_);
  }
  MLKV_RETURN_IF_ERROR(ReadFromDisk(keys, reads, out));
  if (options_.promote_hot_reads) QueuePromotions(keys, reads, out);
  return Status::OK();
}

Status KVStore::ReadFromDisk(const int64_t* keys, std::vector<DiskRecord>& reads, uint8_t* out) {
  if (reads.empty()) return Status::OK();
  std::sort(reads.begin(), reads.end(), [](const DiskRecord& a, const DiskRecord& b) { return a.slot < b.slot; });
  const size_t max_units = std::min(reads.size(), kMaxUnitsPerRound);
  AlignedBuffer buffer(max_units * unit_bytes_);
  if (!buffer.data) return Status::IOError("cannot allocate a read buffer");
  std::vector<ReadRequest> requests;
  std::vector<size_t> request_of;  // per read in this round: its request
  std::vector<std::shared_ptr<SegmentFiles::File>> files;  // this round's, open until its reads finish
  std::vector<size_t> file_of;                      // per request: its file
  const size_t max_files = std::max<size_t>(1, segments_.max_open() / 2);
  size_t pos = 0;
  uint64_t units_read = 0;
  while (pos < reads.size()) {
    requests.clear();
    request_of.clear();
    files.clear();
    file_of.clear();
    size_t end = pos;
    uint64_t last_unit = kNone, last_segment = kNone;
    while (end < reads.size()) {
      const uint64_t slot = reads[end].slot;
      const uint64_t unit = slot / records_per_unit_;
      if (unit != last_unit) {
        if (requests.size() == max_units) break;
        const uint64_t segment = SegmentOfSlot(slot);
        if (segment != last_segment) {
          if (files.size() == max_files) break;
          std::shared_ptr<SegmentFiles::File> file;
          MLKV_RETURN_IF_ERROR(segments_.Open(segment, SegmentFiles::OpenMode::kMayVanish, &file));
          files.push_back(std::move(file));
          last_segment = segment;
        }
        ReadRequest req;
        req.fd = files.back()->fd;
        req.offset = (PageOf(slot) % pages_per_segment_) * page_bytes_ + OffsetInPage(slot) / unit_bytes_ * unit_bytes_;
        req.length = static_cast<uint32_t>(unit_bytes_);
        req.buffer = buffer.data + requests.size() * unit_bytes_;
        requests.push_back(req);
        file_of.push_back(files.size() - 1);
        last_unit = unit;
      }
      request_of.push_back(requests.size() - 1);
      ++end;
    }
    MLKV_RETURN_IF_ERROR(reader_->ReadAll(requests.data(), requests.size()));
    units_read += requests.size();
    for (size_t k = pos; k < end; ++k) {
      const DiskRecord& r = reads[k];
      const ReadRequest& req = requests[request_of[k - pos]];
      const std::string& file = files[file_of[request_of[k - pos]]]->path;
      if (req.result < 0) return Status::IOError("reading " + file + ": " + ErrnoText(static_cast<int>(-req.result)));
      if (static_cast<uint64_t>(req.result) < req.length) {
        return Status::Corruption(file + " is truncated: a read at byte offset " + std::to_string(req.offset) +
                                  " returned " + std::to_string(req.result) + " of " + std::to_string(req.length) +
                                  " bytes");
      }
      const uint64_t in_unit = (r.slot % records_per_unit_) * record_bytes_;
      const uint8_t* rec = req.buffer + in_unit;
      MLKV_RETURN_IF_ERROR(VerifyRecord(rec, file, req.offset + in_unit));
      RecordHeader h;
      std::memcpy(&h, rec, sizeof(h));
      if (h.key != keys[r.index] || (h.flags & kFlagTombstone)) {
        return Status::Corruption(file + ": record at byte offset " + std::to_string(req.offset + in_unit) +
                                  " holds key " + std::to_string(h.key) + ", the index expected live key " +
                                  std::to_string(keys[r.index]));
      }
      std::memcpy(out + r.index * value_bytes_, rec + sizeof(RecordHeader), value_bytes_);
    }
    pos = end;
  }
  disk_reads_ += units_read;
  disk_rows_ += reads.size();
  return Status::OK();
}

Status KVStore::Lookahead(const int64_t* keys, size_t n) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  }
  if (n == 0) return Status::OK();
  std::lock_guard<std::mutex> lock(lookahead_mu_);
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
  std::unique_lock<std::mutex> lock(lookahead_mu_);
  while (!lookahead_queue_.empty()) {
    CopyJob job = std::move(lookahead_queue_.front());
    lookahead_queue_.pop_front();
    lookahead_busy_ = true;
    lock.unlock();
    Status st;
    try {
      if (job.slots.empty()) {
        st = LookaheadBatch(job.keys);
      } else {
        std::unique_lock<std::shared_mutex> store_lock(mu_);
        if (!closed_) {
          st = ApplyCopies(job.keys.data(), job.slots.data(), job.values.data(), job.keys.size(), CopyKind::kPromotion);
        }
      }
    } catch (const std::exception& e) {  // e.g. bad_alloc: reported by the next flush, not fatal
      st = Status::IOError(std::string("lookahead: ") + e.what());
    }
    lock.lock();
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
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::OK();
    const uint64_t head = HeadSlot();
    for (int64_t key : keys) {
      uint64_t slot = index_.Find(key);
      if (slot == kNone || slot >= head) continue;
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
  std::unique_lock<std::shared_mutex> lock(mu_);
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
    std::shared_lock<std::shared_mutex> store_lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  }
  Status st;
  {
    std::unique_lock<std::mutex> lock(lookahead_mu_);
    lookahead_idle_.wait(lock, [&] { return lookahead_queue_.empty() && !lookahead_busy_; });
    st = lookahead_error_;
    lookahead_error_ = Status::OK();
  }
  std::unique_lock<std::mutex> lock(compaction_state_mu_);
  compaction_idle_.wait(lock, [&] { return !compaction_running_ && !compaction_requested_; });
  if (st.ok()) st = compaction_error_;
  compaction_error_ = Status::OK();
  return st;
}

Status KVStore::ScanRows(uint64_t* cursor, size_t max_rows, std::vector<int64_t>* keys, std::vector<uint8_t>* values) {
  constexpr uint64_t kReadBytes = 4ull << 20;  // one sequential read
  if (*cursor == kScanDone) return Status::OK();
  const size_t first_row = keys->size();
  // Takes the live rows of `pages` consecutive pages from `data` (page `first_page` first); mu_ held.
  auto take_live = [&](const uint8_t* data, uint64_t first_page, uint64_t pages, uint64_t tail, const std::string& file,
                       uint64_t file_offset) -> Status {
    for (uint64_t p = 0; p < pages; ++p) {
      const uint8_t* page = data + p * page_bytes_;
      const uint64_t first_slot = (first_page + p) * records_per_page_;
      const uint64_t end_slot = std::min(tail, first_slot + records_per_page_);
      for (uint64_t slot = std::max(first_slot, *cursor); slot < end_slot; ++slot) {
        const uint8_t* rec = page + OffsetInPage(slot);
        MLKV_RETURN_IF_ERROR(VerifyRecord(rec, file, file_offset + p * page_bytes_ + OffsetInPage(slot)));
        RecordHeader h;
        std::memcpy(&h, rec, sizeof(h));
        if ((h.flags & kFlagTombstone) || index_.Find(h.key) != slot) continue;  // superseded or deleted
        keys->push_back(h.key);
        values->insert(values->end(), rec + sizeof(RecordHeader), rec + sizeof(RecordHeader) + value_bytes_);
      }
    }
    return Status::OK();
  };
  const uint64_t buffer_pages = std::max<uint64_t>(1, kReadBytes / page_bytes_);
  AlignedBuffer buffer(buffer_pages * page_bytes_);
  while (keys->size() - first_row < max_rows) {
    uint64_t page, pages, segment;
    {
      std::shared_lock<std::shared_mutex> lock(mu_);
      if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
      *cursor = std::max(*cursor, begin_);  // compacted past: its rows are further on
      if (*cursor >= tail_) {
        *cursor = kScanDone;
        return Status::OK();
      }
      page = PageOf(*cursor);
      if (page >= head_page_) {  // in memory: the rest of the log, under the lock
        const uint64_t end_page = (tail_ + records_per_page_ - 1) / records_per_page_;
        for (; page < end_page && keys->size() - first_row < max_rows; ++page) {
          MLKV_RETURN_IF_ERROR(take_live(FrameOf(page), page, 1, tail_, path_ + " (memory)", 0));
          *cursor = (page + 1) * records_per_page_;
        }
        if (*cursor >= tail_) *cursor = kScanDone;
        return Status::OK();
      }
      // On disk: whole pages of one segment, up to the head, read below without the lock.
      segment = SegmentOfPage(page);
      pages = std::min({head_page_ - page, (segment + 1) * pages_per_segment_ - page, buffer_pages});
    }
    std::shared_ptr<SegmentFiles::File> file;
    Status st = segments_.Open(segment, SegmentFiles::OpenMode::kMayVanish, &file);
    if (st.code() == Status::Code::kBusy) continue;  // compacted away since: begin_ has moved past it
    MLKV_RETURN_IF_ERROR(st);
    const uint64_t offset = (page % pages_per_segment_) * page_bytes_;
    MLKV_RETURN_IF_ERROR(ReadExactly(file->fd, buffer.data, pages * page_bytes_, offset, file->path));
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    MLKV_RETURN_IF_ERROR(take_live(buffer.data, page, pages, tail_, file->path, offset));
    *cursor = (page + pages) * records_per_page_;
  }
  return Status::OK();
}

Status KVStore::Destroy(const std::string& path) {
  DIR* dir = opendir(path.c_str());
  if (!dir) return errno == ENOENT ? Status::OK() : Status::IOError("opening " + path + ": " + ErrnoText(errno));
  const std::string lock_path = path + "/LOCK";
  const int lock_fd = open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
  if (lock_fd >= 0 && flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    close(lock_fd);
    closedir(dir);
    return Status::Busy("store at " + path + " is open: close it before destroying it");
  }
  std::vector<std::string> doomed;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    unsigned long long number = 0;
    char tail[8] = {0};
    if ((std::sscanf(name.c_str(), "segment-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "log") == 0) ||
        (std::sscanf(name.c_str(), "snapshot-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "dat") == 0) ||
        (std::sscanf(name.c_str(), "index-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "dat") == 0) ||
        name == "CHECKPOINT" || name == "CHECKPOINT.tmp" || name == "CHECKPOINT.previous") {
      doomed.push_back(name);
    }
  }
  closedir(dir);
  Status st;
  // CHECKPOINT goes first: a crash part-way leaves no checkpoint naming files already gone.
  std::sort(doomed.begin(), doomed.end(),
            [](const std::string& a, const std::string& b) { return (a == "CHECKPOINT") > (b == "CHECKPOINT"); });
  for (const std::string& name : doomed) {
    if (unlink((path + "/" + name).c_str()) != 0 && errno != ENOENT && st.ok()) {
      st = Status::IOError("removing " + path + "/" + name + ": " + ErrnoText(errno));
    }
  }
  if (lock_fd >= 0) {
    if (st.ok()) unlink(lock_path.c_str());
    close(lock_fd);
  }
  return st;
}

Status KVStore::Compact() {
  MLKV_RETURN_IF_ERROR(RefuseIfBegun("compact"));
  Status background = Flush();
  if (background.code() == Status::Code::kInvalidArgument) return background;  // closed
  std::lock_guard<std::mutex> one_at_a_time(compaction_mu_);
  bool compacted = false;
  MLKV_RETURN_IF_ERROR(CompactSegments(/*all=*/true, &compacted));
  if (!compacted) MLKV_RETURN_IF_ERROR(CheckpointConcurrently());  // nothing to copy: it still ends with one
  return background;
}

bool KVStore::CompactionDueLocked(double ratio) const {
  if (options_.compaction_ratio == 0.0) return false;
  const uint64_t on_disk_slots = ReadOnlySlot() - begin_;
  if (on_disk_slots < 2 * pages_per_segment_ * records_per_page_) return false;
  return static_cast<double>(on_disk_slots) > ratio * static_cast<double>(index_.size());
}

// Writers can append faster than compaction reclaims; past 1.25x the
// compaction threshold a write waits for it (holding no lock), as an LSM
// tree stalls writes, so disk use stays bounded.
void KVStore::StallForCompaction() {
  if (options_.compaction_ratio == 0.0) return;
  for (int round = 0; round < 64; ++round) {
    {
      std::shared_lock<std::shared_mutex> lock(mu_);
      if (closed_ || !CompactionDueLocked(options_.compaction_ratio * 1.25)) return;
    }
    {
      std::unique_lock<std::shared_mutex> lock(mu_);
      if (!MaybeAutoCompactLocked().ok()) return;
    }
    std::unique_lock<std::mutex> state(compaction_state_mu_);
    if (compaction_stop_ || !compaction_error_.ok()) return;
    compaction_idle_.wait(state, [&] { return compaction_stop_ || (!compaction_running_ && !compaction_requested_); });
    ++write_stalls_;
  }
}

Status KVStore::MaybeAutoCompactLocked() {
  if (!CompactionDueLocked(options_.compaction_ratio)) return Status::OK();
  std::lock_guard<std::mutex> lock(compaction_state_mu_);
  if (compaction_stop_ || compaction_requested_) return Status::OK();
  compaction_requested_ = true;
  if (!compaction_scheduled_) {
    SerialExecutor::Of("mlkv-compact").Submit([this] { RunCompactions(); });  // takes compaction_state_mu_ first
    compaction_scheduled_ = true;
  }
  return Status::OK();
}

void KVStore::RunCompactions() {
  std::unique_lock<std::mutex> state(compaction_state_mu_);
  while (compaction_requested_ && !compaction_stop_) {
    compaction_requested_ = false;
    compaction_running_ = true;
    state.unlock();
    Status st;
    {
      std::lock_guard<std::mutex> one_at_a_time(compaction_mu_);
      bool due;
      {
        std::shared_lock<std::shared_mutex> lock(mu_);
        due = !closed_ && CompactionDueLocked(options_.compaction_ratio);
      }
      bool compacted = false;
      try {
        if (due) st = CompactSegments(/*all=*/false, &compacted);
      } catch (const std::exception& e) {
        st = Status::IOError(std::string("compaction: ") + e.what());
      }
    }
    state.lock();
    compaction_running_ = false;
    if (!st.ok() && compaction_error_.ok()) compaction_error_ = st;
    compaction_idle_.notify_all();
  }
  compaction_requested_ = false;
  compaction_scheduled_ = false;
  compaction_idle_.notify_all();
}

Status KVStore::CompactSegments(bool all, bool* compacted) {
  *compacted = false;
  const uint64_t slots_per_segment = pages_per_segment_ * records_per_page_;
  uint64_t first, end;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    first = begin_ / slots_per_segment;
    const uint64_t full_end = flusher_.flushed_page() / pages_per_segment_;  // segments wholly written
    auto live = [&](uint64_t s) { return s < live_per_segment_.size() ? live_per_segment_[s] : 0; };
    end = full_end;
    if (!all) {
      int64_t garbage = 0;
      for (uint64_t s = first; s < full_end; ++s) garbage += static_cast<int64_t>(slots_per_segment) - live(s);
      int64_t reclaimed = 0;
      end = first;
      while (end < full_end && 2 * reclaimed < garbage)
        reclaimed += static_cast<int64_t>(slots_per_segment) - live(end++);
    }
  }
  if (end <= first) return Status::OK();

  constexpr size_t kChunkRows = 4096;
  std::vector<int64_t> keys;
  std::vector<uint64_t> slots;
  std::vector<uint8_t> values;
  auto copy_chunk = [&]() -> Status {
    if (keys.empty()) return Status::OK();
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    Status st = ApplyCopies(keys.data(), slots.data(), values.data(), keys.size(), CopyKind::kCompaction,
                            /*values_only=*/false);
    keys.clear();
    slots.clear();
    values.clear();
    return st;
  };
  AlignedBuffer page_buffer(page_bytes_);
  for (uint64_t s = first; s < end; ++s) {
    std::shared_ptr<SegmentFiles::File> file;
    MLKV_RETURN_IF_ERROR(segments_.Open(s, SegmentFiles::OpenMode::kMustExist, &file));
    for (uint64_t page = s * pages_per_segment_; page < (s + 1) * pages_per_segment_; ++page) {
      // Segment pages below read-only never change: read and verify them unlocked.
      const uint64_t offset = (page % pages_per_segment_) * page_bytes_;
      MLKV_RETURN_IF_ERROR(ReadExactly(file->fd, page_buffer.data, page_bytes_, offset, file->path));
      const uint64_t first_slot = page * records_per_page_;
      for (uint64_t slot = first_slot; slot < first_slot + records_per_page_; ++slot) {
        // Verify before the liveness check: a damaged key must not make a live row look dead.
        MLKV_RETURN_IF_ERROR(
            VerifyRecord(page_buffer.data + OffsetInPage(slot), file->path, offset + OffsetInPage(slot)));
      }
      {
        std::shared_lock<std::shared_mutex> lock(mu_);
        constexpr uint64_t kAhead = 8;  // prefetch the index ahead: these lookups are random
        auto key_at = [&](uint64_t slot) {
          int64_t key;
          std::memcpy(&key, page_buffer.data + OffsetInPage(slot), sizeof(key));
          return key;
        };
        HashIndex::Where ring[kAhead];
        const uint64_t end_slot = first_slot + records_per_page_;
        for (uint64_t s = first_slot; s < std::min(end_slot, first_slot + kAhead); ++s) {
          index_.Prefetch(ring[s % kAhead] = index_.Locate(key_at(s)));
        }
        for (uint64_t slot = first_slot; slot < end_slot; ++slot) {
          const HashIndex::Where where = ring[slot % kAhead];
          if (slot + kAhead < end_slot) index_.Prefetch(ring[slot % kAhead] = index_.Locate(key_at(slot + kAhead)));
          const uint8_t* rec = page_buffer.data + OffsetInPage(slot);
          RecordHeader h;
          std::memcpy(&h, rec, sizeof(h));
          if ((h.flags & kFlagTombstone) || index_.Find(where) != slot) continue;  // superseded or deleted
          keys.push_back(h.key);
          slots.push_back(slot);
          values.insert(values.end(), rec, rec + record_bytes_);
        }
      }
      if (keys.size() >= kChunkRows) MLKV_RETURN_IF_ERROR(copy_chunk());
    }
  }
  MLKV_RETURN_IF_ERROR(copy_chunk());
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    begin_ = end * slots_per_segment;
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

Status KVStore::Close() {
  std::lock_guard<std::mutex> one_close(close_mu_);
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (closed_) return Status::OK();
  }
  Status flushed = Flush();
  StopThreads();
  // A checkpoint begun and not finished is finished first; the closing checkpoint covers it.
  std::unique_lock<std::mutex> one_checkpoint(checkpoint_mu_);
  FinishOrWaitBegunCheckpoint(one_checkpoint);
  std::unique_lock<std::shared_mutex> lock(mu_);
  Status st = CheckpointExclusively();
  const bool never = flusher_.SyncFailed();  // no checkpoint can succeed any more: closing without one is all there is
  if (!st.ok() && !never) {
    // The store stays open: let the background workers start again on demand.
    {
      std::lock_guard<std::mutex> l(lookahead_mu_);
      lookahead_stop_ = false;
    }
    std::lock_guard<std::mutex> l(compaction_state_mu_);
    compaction_stop_ = false;
    return st;
  }
  closed_ = true;
  segments_.ForgetAll();
  if (lock_fd_ >= 0) {
    flock(lock_fd_, LOCK_UN);
    close(lock_fd_);
    lock_fd_ = -1;
  }
  return st.ok() ? flushed : st;
}

// Stops the store's copies and compactions (after the ones queued or running); the flushes stay
// for the last checkpoint.
void KVStore::StopThreads() {
  {
    std::unique_lock<std::mutex> lock(lookahead_mu_);
    lookahead_stop_ = true;
    lookahead_idle_.wait(lock, [&] { return !lookahead_scheduled_; });
  }
  std::unique_lock<std::mutex> lock(compaction_state_mu_);
  compaction_stop_ = true;
  compaction_idle_.wait(lock, [&] { return !compaction_scheduled_; });
}

KVStore::~KVStore() {
  if (!closed_) {
    Status st = Close();
    if (!st.ok()) std::fprintf(stderr, "mlkv: closing %s: %s\n", path_.c_str(), st.ToString().c_str());
  }
  StopThreads();
  flusher_.WaitIdle();  // the flush tasks read the frames unmapped below
  if (lock_fd_ >= 0) close(lock_fd_);
  if (frames_mapping_) munmap(frames_mapping_, frames_mapped_bytes_);
}

uint64_t KVStore::Size() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return index_.size();
}

StoreStats KVStore::Stats() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  StoreStats s;
  s.rows = index_.size();
  s.index_bytes = index_.MemoryBytes();
  s.log_memory_bytes = num_frames_ * page_bytes_;
  s.memory_bytes = s.index_bytes + s.log_memory_bytes;
  struct stat st;
  const uint64_t slots_per_segment = pages_per_segment_ * records_per_page_;
  if (slots_per_segment) {
    for (uint64_t seg = std::min(begin_, previous_begin_) / slots_per_segment; seg <= SegmentOfPage(read_only_page_);
         ++seg) {
      if (stat(segments_.PathOf(seg).c_str(), &st) == 0) s.disk_bytes += static_cast<uint64_t>(st.st_size);
    }
  }
  if (stat(SnapshotPath(checkpoint_sequence_).c_str(), &st) == 0) s.disk_bytes += static_cast<uint64_t>(st.st_size);
  if (previous_sequence_ != checkpoint_sequence_ && stat(SnapshotPath(previous_sequence_).c_str(), &st) == 0) {
    s.disk_bytes += static_cast<uint64_t>(st.st_size);
  }
  for (uint64_t image : {image_sequence_, previous_image_sequence_ != image_sequence_ ? previous_image_sequence_ : 0}) {
    if (image && stat(IndexImagePath(image).c_str(), &st) == 0) s.disk_bytes += static_cast<uint64_t>(st.st_size);
  }
  s.memory_hits = memory_hits_;
  s.disk_reads = disk_reads_;
  s.disk_rows = disk_rows_;
  s.lookahead_rows = lookahead_rows_;
  s.promoted_rows = promoted_rows_;
  s.lookahead_dropped_rows = lookahead_dropped_rows_;
  s.write_stalls = write_stalls_;
  s.frame_waits = frame_waits_;
  s.frame_wait_seconds = static_cast<double>(frame_wait_ns_) * 1e-9;
  s.in_place_updates = in_place_updates_;
  s.appends = appends_;
  s.compactions = compactions_;
  s.compacted_rows = compacted_rows_;
  s.checkpoints = checkpoints_;
  s.recovered_from_index_image = recovered_from_index_image_;
  s.begin_address = begin_;
  s.head_address = HeadSlot();
  s.read_only_address = ReadOnlySlot();
  s.tail_address = tail_;
  s.page_bytes = page_bytes_;
  s.record_bytes = record_bytes_;
  s.direct_io = direct_io_;
  s.io_engine = reader_ ? reader_->name() : "";
  return s;
}

}  // namespace mlkv
