// KVStore's life cycle (open, close, destroy), its writes (put, delete) and its statistics; the
// rest of the store lives in the kv_store_*.cc files, one concern each.
#include "kv_store.h"

#include <fcntl.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "file_io.h"
#include "log_format.h"

namespace mlkv {

uint32_t ElementSize(ElementType t) {
  switch (t) {
    case ElementType::kFloat32: return 4;
    case ElementType::kFloat16: return 2;
    case ElementType::kBFloat16: return 2;
  }
  return 0;
}

KVStore::KVStore(const std::string& path, const StoreOptions& options)
    : path_(path),
      options_(options),
      segments_(path),
      flusher_(&segments_),
      index_(options.expected_keys, HashIndex::KeyBitsBelow(options.key_limit)),
      doorkeeper_(kDoorkeeperWords) {
  if (options.index_budget_bytes) {
    index_.set_bucket_limit(std::max<uint64_t>(1, options.index_budget_bytes / HashIndex::kBucketBytes));
  }
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
  if (options.key_limit > (1ull << HashIndex::kMaxKeyBits)) {
    return Status::InvalidArgument("key_limit must be at most 2^63, got " + std::to_string(options.key_limit));
  }
  if (!(options.mutable_fraction > 0.0 && options.mutable_fraction < 1.0)) {
    return Status::InvalidArgument("mutable_fraction must be in (0, 1)");
  }
  if (options.compaction_ratio != 0.0 && options.compaction_ratio < 1.2) {
    return Status::InvalidArgument("compaction_ratio must be 0 (off) or at least 1.2, got " +
                                   std::to_string(options.compaction_ratio));
  }
  StoreOptions opened = options;
  if (opened.read_only) opened.promote_hot_reads = false;  // a promotion writes the row to the log
  std::unique_ptr<KVStore> store(new KVStore(path, opened));
  MLKV_RETURN_IF_ERROR(store->Init());
  *out = std::move(store);
  return Status::OK();
}

Status KVStore::Init() {
  MutexLock one_open(&close_mu_);
  struct stat st;
  if (stat(path_.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("path " + path_ + " exists and is not a directory");
  }
  const bool read_only = options_.read_only;
  if (read_only && !FileExists(path_ + "/CHECKPOINT")) {
    return Status::InvalidArgument("no store at " + path_ + " (no CHECKPOINT file) to open read-only");
  }
  if (!read_only) {
    MLKV_RETURN_IF_ERROR(MakeDirectories(path_));
    if (access(path_.c_str(), W_OK) != 0)
      return Status::InvalidArgument("store directory " + path_ + " is not writable");
  }
  MLKV_RETURN_IF_ERROR(LockPath(read_only));
  // O_DIRECT works on most file systems but not on tmpfs; probe once (read-only: on a file it has).
  direct_io_ = false;
  if (options_.direct_io) {
    const std::string probe = path_ + (read_only ? "/CHECKPOINT" : "/.direct_probe");
    int fd = open(probe.c_str(), (read_only ? O_RDONLY : O_RDWR | O_CREAT) | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      direct_io_ = true;
      close(fd);
    }
    if (!read_only) unlink(probe.c_str());
  }
  // A quarter of the descriptor limit for segment files, the rest for the process.
  size_t max_open_files = 256;
  struct rlimit files_limit;
  if (getrlimit(RLIMIT_NOFILE, &files_limit) == 0 && files_limit.rlim_cur != RLIM_INFINITY) {
    max_open_files = std::min<size_t>(1024, std::max<size_t>(4, files_limit.rlim_cur / 4));
  }
  segments_.Configure(direct_io_, max_open_files, read_only);
  MLKV_RETURN_IF_ERROR(BlockReader::Create(options_.io_engine, options_.io_depth, options_.io_threads,
                                           InMemoryFileSystem(path_), &reader_));
  MLKV_RETURN_IF_ERROR(FileExists(path_ + "/CHECKPOINT") ? Recover() : CreateFresh());
  WriterLock lock(&mu_);
  closed_ = false;
  return Status::OK();
}

// Writers hold the LOCK file exclusively, read-only opens shared: any number of readers, or one writer.
Status KVStore::LockPath(bool read_only) {
  const std::string lock_path = path_ + "/LOCK";
  lock_fd_ = open(lock_path.c_str(), read_only ? O_RDONLY | O_CLOEXEC : O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0 && read_only && errno == ENOENT) return Status::OK();  // a copied store: no writer has it open
  if (lock_fd_ < 0) return Status::InvalidArgument("cannot open " + lock_path + ": " + ErrnoText(errno));
  if (flock(lock_fd_, (read_only ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    close(lock_fd_);
    lock_fd_ = -1;
    return Status::Busy("store at " + path_ + (read_only ? " is open for writing" : " is already open") +
                        " (in this or another process)");
  }
  return Status::OK();
}

Status KVStore::RefuseWrite(const char* what) const {
  if (options_.read_only)
    return Status::InvalidArgument("store at " + path_ + " is open read-only: " + what + " refused");
  if (loading_) {
    return Status::InvalidArgument("store at " + path_ + " is loading rows (end the load first): " + what + " refused");
  }
  return Status::OK();
}

Status KVStore::CreateFresh() {
  MLKV_RETURN_IF_ERROR(ComputeLayout(options_.page_bytes, 0));
  // The first checkpoint fixes dim and dtype on disk, so a reopen can check them.
  MutexLock one_checkpoint(&checkpoint_mu_);
  WriterLock lock(&mu_);
  return CheckpointExclusively();
}

Status KVStore::CheckKeys(const int64_t* keys, size_t n) const {
  const uint64_t limit = options_.key_limit ? options_.key_limit : 1ull << HashIndex::kMaxKeyBits;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0 || static_cast<uint64_t>(keys[i]) >= limit) {
      return Status::InvalidArgument(KeyRangeText() + "; keys[" + std::to_string(i) + "] = " + std::to_string(keys[i]));
    }
  }
  return Status::OK();
}

std::string KVStore::KeyRangeText() const {
  return options_.key_limit ? "keys must be in [0, " + std::to_string(options_.key_limit) + ") (the store's key_limit)"
                            : "keys must be non-negative";
}

Status KVStore::Put(const int64_t* keys, size_t n, const void* values) {
  MLKV_RETURN_IF_ERROR(RefuseWrite("put"));
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  const auto* vals = static_cast<const uint8_t*>(values);
  StallForCompaction();
  // In chunks whose appends reuse only frames already written: the wait for the disk happens
  // without the lock, not in StartPage under it, where every get of the store would wait too.
  for (size_t done = 0; done < n;) {
    const size_t end = done + MakeAppendRoom(n - done);
    WriterLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    constexpr size_t kAhead = 8;
    HashIndex::Where ring[kAhead];
    for (size_t i = done; i < std::min(end, done + kAhead); ++i)
      index_.Prefetch(ring[i % kAhead] = index_.Locate(keys[i]));
    for (size_t i = done; i < end; ++i) {
      const HashIndex::Where where = ring[i % kAhead];
      if (i + kAhead < end) index_.Prefetch(ring[i % kAhead] = index_.Locate(keys[i + kAhead]));
      const uint8_t* value = vals + i * value_bytes_;
      const uint64_t address = index_.Find(where);
      const uint64_t slot = SlotOf(address);
      if (slot != kNone && slot >= ReadOnlySlot()) {
        WriteRecord(RecordInMemory(slot), keys[i], 0, value);
        if (IsDeletion(address)) index_.Upsert(keys[i], slot);  // its tombstone, live again
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
  MLKV_RETURN_IF_ERROR(RefuseWrite("delete"));
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  StallForCompaction();
  std::unique_ptr<bool[]> in_base(new bool[n + 1]);
  for (;;) {
    // Which of the keys the log does not hold the base run does: read first, without the lock.
    uint64_t generation;
    MLKV_RETURN_IF_ERROR(ContainsOnce(keys, n, in_base.get(), /*log_too=*/false, &generation));
    WriterLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    if (generation != base_generation_) continue;  // a merge moved rows meanwhile: read again
    *deleted = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t address = index_.Find(keys[i]);
      if (IsDeletion(address) || (address == kNone && !in_base[i])) continue;  // not there
      uint64_t tomb;
      if (address != kNone && address >= ReadOnlySlot()) {
        // The record is not on disk yet: turn it into a tombstone where it lies.
        uint8_t* rec = RecordInMemory(address);
        WriteRecord(rec, keys[i], kFlagTombstone, rec + sizeof(RecordHeader));
        ++changes_;
        tomb = address;
      } else {
        MLKV_RETURN_IF_ERROR(Append(keys[i], kFlagTombstone, nullptr, &tomb));
      }
      // A base row stays deleted by an index entry until the next merge drops it.
      if (KeepsDeletion(keys[i])) {
        deletions_indexed_ = true;
        MoveLive(index_.Upsert(keys[i], tomb | kDeletionBit), tomb);
      } else {
        MoveLive(index_.Erase(keys[i]), kNone);
      }
      ++*deleted;
    }
    return MaybeAutoCompactLocked();
  }
}

Status KVStore::Contains(const int64_t* keys, size_t n, bool* found) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  uint64_t generation;
  return ContainsOnce(keys, n, found, /*log_too=*/true, &generation);
}

Status KVStore::ContainsOnce(const int64_t* keys, size_t n, bool* found, bool log_too, uint64_t* generation) {
  std::vector<size_t> unknown;
  std::shared_ptr<const BaseRuns> base;
  {
    ReaderLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    *generation = base_generation_;
    base = base_;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t address = index_.Find(keys[i]);
      found[i] = log_too && address != kNone && !IsDeletion(address);
      if (address != kNone || !base) continue;
      const BaseRun::Presence presence = base->PresenceOf(keys[i]);
      found[i] = presence == BaseRun::Presence::kPresent;
      if (presence == BaseRun::Presence::kMaybe) unknown.push_back(i);
    }
  }
  if (unknown.empty()) return Status::OK();
  std::vector<uint8_t> values(n * value_bytes_);
  return ReadFromBase(*base, keys, unknown, values.data(), found);
}

Status KVStore::Close() {
  MutexLock one_close(&close_mu_);
  {
    ReaderLock lock(&mu_);
    if (closed_) return Status::OK();
  }
  if (options_.read_only) return CloseReadOnly();
  DropLoad();
  Status flushed = Flush();
  StopThreads();
  // A checkpoint begun and not finished is finished first; the closing checkpoint covers it.
  MutexLock one_checkpoint(&checkpoint_mu_);
  FinishOrWaitBegunCheckpoint(one_checkpoint);
  WriterLock lock(&mu_);
  Status st = CheckpointExclusively();
  const bool never = flusher_.SyncFailed();  // no checkpoint can succeed any more: closing without one is all there is
  if (!st.ok() && !never) {
    // The store stays open: let the background workers start again on demand.
    {
      MutexLock l(&lookahead_mu_);
      lookahead_stop_ = false;
    }
    MutexLock l(&compaction_state_mu_);
    compaction_stop_ = false;
    return st;
  }
  ReleasePath();
  return st.ok() ? flushed : st;
}

// Nothing to write: the threads stop (none wrote) and the path is released.
Status KVStore::CloseReadOnly() {
  StopThreads();
  WriterLock lock(&mu_);
  ReleasePath();
  return Status::OK();
}

void KVStore::ReleasePath() {
  closed_ = true;
  segments_.ForgetAll();
  if (lock_fd_ >= 0) {
    flock(lock_fd_, LOCK_UN);
    close(lock_fd_);
    lock_fd_ = -1;
  }
}

// Stops the store's copies and compactions (after the ones queued or running); the flushes stay
// for the last checkpoint.
void KVStore::StopThreads() {
  {
    MutexLock lock(&lookahead_mu_);
    lookahead_stop_ = true;
    while (lookahead_scheduled_) lookahead_idle_.wait(lock.native());
  }
  MutexLock lock(&compaction_state_mu_);
  compaction_stop_ = true;
  while (compaction_scheduled_) compaction_idle_.wait(lock.native());
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
        (std::sscanf(name.c_str(), "base-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "runs") == 0) ||
        (std::sscanf(name.c_str(), "run-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "run") == 0) ||
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

Status KVStore::Size(uint64_t* rows) const { return CountRows(rows); }

Status KVStore::Stats(StoreStats* stats) const {
  StoreStats& s = *stats;
  MLKV_RETURN_IF_ERROR(CountRows(&s.rows, /*read_unknown=*/false));
  ReaderLock lock(&mu_);
  s.index_bytes = index_.MemoryBytes();
  s.log_memory_bytes = num_frames_ * page_bytes_;
  s.base_memory_bytes = base_ ? base_->memory_bytes() : 0;
  s.memory_bytes = s.index_bytes + s.log_memory_bytes + s.base_memory_bytes;
  s.base_rows = base_ ? base_->rows() : 0;
  s.base_runs = base_ ? base_->runs().size() + base_->overlays().size() : 0;
  s.base_overlays = base_ ? base_->overlays().size() : 0;
  s.base_disk_bytes = base_ ? base_->file_bytes() : 0;
  s.base_reads = base_reads_;
  s.base_merges = base_merges_;
  s.base_rows_written = base_rows_written_;
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
  std::vector<uint64_t> runs;
  for (const auto& [generation, ids] : base_runs_of_) {
    if (stat(BasePath(generation).c_str(), &st) == 0) s.disk_bytes += static_cast<uint64_t>(st.st_size);
    runs.insert(runs.end(), ids.begin(), ids.end());
  }
  std::sort(runs.begin(), runs.end());
  runs.erase(std::unique(runs.begin(), runs.end()), runs.end());
  for (uint64_t run : runs) {
    if (stat(RunPath(run).c_str(), &st) == 0) s.disk_bytes += static_cast<uint64_t>(st.st_size);
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
  return Status::OK();
}

}  // namespace mlkv
