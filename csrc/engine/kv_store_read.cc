// KVStore's reads: gets from memory under the shared lock, batched disk reads outside it, and
// scans of every live row in log order.
#include "kv_store.h"

#include <algorithm>
#include <cstring>

#include "file_io.h"
#include "log_format.h"
#include "read_rounds.h"

namespace mlkv {

namespace {

constexpr size_t kMaxUnitsPerRound = 4096;  // bounds the read buffer of one get

}  // namespace

Status KVStore::Get(const int64_t* keys, size_t n, void* values, std::vector<int64_t>* missing) {
  return ReadRows(keys, n, static_cast<uint8_t*>(values), missing, nullptr);
}

Status KVStore::Lookup(const int64_t* keys, size_t n, void* values, bool* found) {
  return ReadRows(keys, n, static_cast<uint8_t*>(values), nullptr, found);
}

// ---- the log's records on disk ----------------------------------------------------------------------

class KVStore::LogReads {
 public:
  LogReads(KVStore* store, const int64_t* keys, std::vector<DiskRecord> records, uint8_t* out)
      : store_(store), keys_(keys), records_(std::move(records)), out_(out) {
    std::sort(records_.begin(), records_.end(),
              [](const DiskRecord& a, const DiskRecord& b) { return a.slot < b.slot; });
  }

  // Takes the results of the units asked last round, then asks for the next ones' (at most `room`);
  // Busy when a segment was compacted away since the index named it (a get looks its keys up again).
  Status Next(const ReadRequest* results, size_t n, size_t room, std::vector<ReadRequest>* wants) {
    MLKV_RETURN_IF_ERROR(TakeResults(results, n));
    return Ask(room, wants);
  }
  bool done() const { return next_ == records_.size() && asked_ == 0; }
  const std::vector<DiskRecord>& records() const { return records_; }

 private:
  Status TakeResults(const ReadRequest* results, size_t n) {
    for (size_t k = next_ - asked_; k < next_; ++k) {
      const DiskRecord& r = records_[k];
      const size_t q = request_of_[k - (next_ - asked_)];
      const ReadRequest& req = results[q];
      const std::string& file = files_[file_of_[q]]->path;
      if (req.result < 0) return Status::IOError("reading " + file + ": " + ErrnoText(static_cast<int>(-req.result)));
      if (static_cast<uint64_t>(req.result) < req.length) {
        return Status::Corruption(file + " is truncated: a read at byte offset " + std::to_string(req.offset) +
                                  " returned " + std::to_string(req.result) + " of " + std::to_string(req.length) +
                                  " bytes");
      }
      const uint64_t in_unit = (r.slot % store_->records_per_unit_) * store_->record_bytes_;
      const uint8_t* rec = req.buffer + in_unit;
      MLKV_RETURN_IF_ERROR(store_->VerifyRecord(rec, file, req.offset + in_unit));
      RecordHeader h;
      std::memcpy(&h, rec, sizeof(h));
      if (h.key != keys_[r.index] || (h.flags & kFlagTombstone)) {
        return Status::Corruption(file + ": record at byte offset " + std::to_string(req.offset + in_unit) +
                                  " holds key " + std::to_string(h.key) + ", the index expected live key " +
                                  std::to_string(keys_[r.index]));
      }
      std::memcpy(out_ + r.index * store_->value_bytes_, rec + sizeof(RecordHeader), store_->value_bytes_);
    }
    store_->disk_reads_ += n;
    store_->disk_rows_ += asked_;
    asked_ = 0;
    return Status::OK();
  }

  Status Ask(size_t room, std::vector<ReadRequest>* wants) {
    files_.clear();
    file_of_.clear();
    request_of_.clear();
    const size_t most = std::min(room, kMaxUnitsPerRound);
    const size_t max_files = std::max<size_t>(1, store_->segments_.max_open() / 2);
    size_t units = 0;
    for (size_t k = next_; k < records_.size() && units <= most; ++k) {
      units += k == next_ ||
               records_[k].slot / store_->records_per_unit_ != records_[k - 1].slot / store_->records_per_unit_;
    }
    units = std::min(units, most);
    buffer_.reset(units ? new AlignedBuffer(units * store_->unit_bytes_) : nullptr);
    if (units && !buffer_->data) return Status::IOError("cannot allocate a read buffer");
    size_t asked_units = 0, end = next_;
    uint64_t last_unit = kNone, last_segment = kNone;
    for (; end < records_.size(); ++end) {
      const uint64_t slot = records_[end].slot;
      const uint64_t unit = slot / store_->records_per_unit_;
      if (unit != last_unit) {
        if (asked_units == units) break;
        const uint64_t segment = store_->SegmentOfSlot(slot);
        if (segment != last_segment) {
          if (files_.size() == max_files) break;
          std::shared_ptr<SegmentFiles::File> file;
          MLKV_RETURN_IF_ERROR(store_->segments_.Open(segment, SegmentFiles::OpenMode::kMayVanish, &file));
          files_.push_back(std::move(file));
          last_segment = segment;
        }
        ReadRequest req;
        req.fd = files_.back()->fd;
        req.offset = (store_->PageOf(slot) % store_->pages_per_segment_) * store_->page_bytes_ +
                     store_->OffsetInPage(slot) / store_->unit_bytes_ * store_->unit_bytes_;
        req.length = static_cast<uint32_t>(store_->unit_bytes_);
        req.buffer = buffer_->data + asked_units * store_->unit_bytes_;
        wants->push_back(req);
        file_of_.push_back(files_.size() - 1);
        ++asked_units;
        last_unit = unit;
      }
      request_of_.push_back(asked_units - 1);
    }
    asked_ = end - next_;
    next_ = end;
    return Status::OK();
  }

  KVStore* const store_;
  const int64_t* keys_;
  std::vector<DiskRecord> records_;  // in slot order
  uint8_t* out_;
  size_t next_ = 0;   // the first record not yet asked for
  size_t asked_ = 0;  // the records asked for last round: those before next_
  std::vector<size_t> request_of_;  // per record asked: its unit among those asked
  std::vector<std::shared_ptr<SegmentFiles::File>> files_;  // the last round's, open until its reads finish
  std::vector<size_t> file_of_;                               // per unit asked: its file
  std::unique_ptr<AlignedBuffer> buffer_;
};

Status KVStore::ReadFromDisk(const int64_t* keys, std::vector<DiskRecord>& reads, uint8_t* out) {
  LogReads log(this, keys, reads, out);
  std::vector<ReadRequest> requests;
  size_t n = 0;
  for (;;) {
    std::vector<ReadRequest> wants;
    MLKV_RETURN_IF_ERROR(log.Next(requests.data(), n, kMaxReadsPerRound, &wants));
    if (wants.empty()) return Status::OK();
    MLKV_RETURN_IF_ERROR(reader_->ReadAll(wants.data(), wants.size()));
    requests.swap(wants);
    n = requests.size();
  }
}

// ---- a get: the index, then the log's records and the base's blocks in the same rounds -------------

class KVStore::RowLookup : public RoundedLookup {
 public:
  // `missing` (Get) lists the absent keys; `found` (Lookup) marks them false; either may be null.
  RowLookup(KVStore* store, const int64_t* keys, size_t n, uint8_t* out, std::vector<int64_t>* missing, bool* found)
      : store_(store), keys_(keys), n_(n), out_(out), missing_(missing), found_(found) {}

  Status Next(const ReadRequest* results, size_t n, size_t room, std::vector<ReadRequest>* wants, bool* done) override {
    const size_t log_results = log_asked_, base_results = base_asked_;  // last round's, in this order
    const size_t first = wants->size();
    bool restarted = !log_;
    if (log_) {
      const Status st = log_->Next(results, log_results, room, wants);
      if (st.code() == Status::Code::kBusy) {  // a segment compacted away: its rows have moved
        wants->resize(first);
        restarted = true;
      } else {
        MLKV_RETURN_IF_ERROR(st);
      }
    }
    if (restarted) MLKV_RETURN_IF_ERROR(Start(room, wants));
    log_asked_ = wants->size() - first;
    base_asked_ = 0;
    if (base_lookup_ && !base_done_) {
      const size_t before = wants->size();
      MLKV_RETURN_IF_ERROR(base_lookup_->Next(restarted ? nullptr : results + log_results, restarted ? 0 : base_results,
                                              room - log_asked_, wants, &base_done_));
      base_asked_ = wants->size() - before;
    }
    *done = log_->done() && (!base_lookup_ || base_done_);
    if (*done) Finish();
    return Status::OK();
  }

  BlockReader* reader() const override { return store_->reader_.get(); }

 private:
  // Looks the keys up in the index and asks for the first round's reads, again while a segment the
  // index named was compacted away before its file was opened.
  Status Start(size_t room, std::vector<ReadRequest>* wants) {
    if (attempts_ == 0) MLKV_RETURN_IF_ERROR(store_->CheckKeys(keys_, n_));
    for (;; ++attempts_) {
      if (attempts_ == 8) {
        return Status::IOError("store at " + store_->path_ +
                               ": the log's segments were compacted away under a read "
                               "8 times");
      }
      MLKV_RETURN_IF_ERROR(FindKeys());
      const size_t first = wants->size();
      const Status st = log_->Next(nullptr, 0, room, wants);
      if (st.code() != Status::Code::kBusy) return st;
      wants->resize(first);
    }
  }

  // Under the shared lock: rows in memory copied, the log's records on disk and the keys the log
  // holds none of (the base's) gathered.
  Status FindKeys() {
    std::vector<DiskRecord> records;
    from_base_.clear();
    if (missing_) missing_->clear();
    {
      ReaderLock lock(&store_->mu_);
      MLKV_RETURN_IF_ERROR(FindKeysLocked(&records));
      base_ = from_base_.empty() ? nullptr : store_->base_;  // held: a merge does not pull it from under the read
    }
    log_.reset(new LogReads(store_, keys_, std::move(records), out_));
    base_lookup_.reset();
    base_done_ = false;
    if (from_base_.empty()) return Status::OK();
    base_keys_.resize(from_base_.size());
    for (size_t j = 0; j < from_base_.size(); ++j) base_keys_[j] = keys_[from_base_[j]];
    base_rows_.resize(from_base_.size() * store_->value_bytes_);
    base_found_.reset(new bool[from_base_.size()]);
    base_lookup_ = base_->StartLookup(base_keys_.data(), base_keys_.size(), base_rows_.data(), base_found_.get(),
                                      store_->reader_.get());
    return Status::OK();
  }

  Status FindKeysLocked(std::vector<DiskRecord>* records) REQUIRES_SHARED(store_->mu_) {
    if (store_->closed_) return Status::InvalidArgument("store at " + store_->path_ + " is closed");
    const HashIndex& index = store_->index_;
    const uint64_t head = store_->HeadSlot();
    const bool has_base = store_->base_ != nullptr;
    uint64_t hits = 0;
    // A three-stage pipeline: locate key i+2D and prefetch its buckets, find key i+D and prefetch
    // its record, copy row i; the cache misses overlap.
    constexpr size_t kD = 8;
    HashIndex::Where where[2 * kD];
    uint64_t address_of[2 * kD];
    // (The analysis cannot see that the lambdas run under this function's lock.)
    auto stage_locate = [&](size_t j)
                            NO_THREAD_SAFETY_ANALYSIS { index.Prefetch(where[j % (2 * kD)] = index.Locate(keys_[j])); };
    auto stage_find = [&](size_t j) NO_THREAD_SAFETY_ANALYSIS {
      const uint64_t address = address_of[j % (2 * kD)] = index.Find(where[j % (2 * kD)]);
      if (address != kNone && !IsDeletion(address) && address >= head) {
        const uint8_t* rec = store_->RecordInMemory(address);
        for (uint32_t line = 0; line < store_->record_bytes_ && line < 1024; line += 64) __builtin_prefetch(rec + line);
      }
    };
    for (size_t j = 0; j < std::min(n_, 2 * kD); ++j) stage_locate(j);
    for (size_t j = 0; j < std::min(n_, kD); ++j) stage_find(j);
    for (size_t i = 0; i < n_; ++i) {
      const uint64_t address = address_of[i % (2 * kD)];
      if (i + kD < n_) stage_find(i + kD);          // reads where[(i + kD) % 2kD]
      if (i + 2 * kD < n_) stage_locate(i + 2 * kD);  // overwrites where[i % 2kD], no longer needed
      // A deleted base row reads as absent; a key the log holds no record of, from the base (whose
      // lookup rules out what its fences and filters can).
      const bool live = address != kNone && !IsDeletion(address);
      if (found_) found_[i] = live;
      if (address == kNone && has_base) {
        from_base_.push_back(i);
      } else if (!live) {
        if (missing_) missing_->push_back(keys_[i]);
      } else if (address >= head) {
        std::memcpy(out_ + i * store_->value_bytes_, store_->RecordInMemory(address) + sizeof(RecordHeader),
                    store_->value_bytes_);
        ++hits;
      } else {
        records->push_back(DiskRecord{i, address});
      }
    }
    store_->memory_hits_ += hits;
    return Status::OK();
  }

  // The base's rows into place, promotions queued, the counters.
  void Finish() {
    if (store_->options_.promote_hot_reads) store_->QueuePromotions(keys_, log_->records(), out_);
    if (!base_lookup_) return;
    uint64_t held = 0;
    for (size_t j = 0; j < from_base_.size(); ++j) {
      const size_t i = from_base_[j];
      if (found_) found_[i] = base_found_[j];
      if (base_found_[j]) {
        std::memcpy(out_ + i * store_->value_bytes_, base_rows_.data() + j * store_->value_bytes_,
                    store_->value_bytes_);
        ++held;
      } else if (missing_) {
        missing_->push_back(keys_[i]);
      }
    }
    store_->base_reads_ += base_lookup_->blocks_read();
    store_->disk_reads_ += base_lookup_->blocks_read();
    store_->disk_rows_ += held;
  }

  KVStore* const store_;
  const int64_t* keys_;
  const size_t n_;
  uint8_t* out_;
  std::vector<int64_t>* missing_;
  bool* found_;
  int attempts_ = 0;
  std::unique_ptr<LogReads> log_;
  size_t log_asked_ = 0, base_asked_ = 0;  // the reads each asked for last round
  std::shared_ptr<const BaseRuns> base_;
  std::vector<size_t> from_base_;  // the keys the log holds no record of
  std::vector<int64_t> base_keys_;
  std::vector<uint8_t> base_rows_;
  std::unique_ptr<bool[]> base_found_;
  std::unique_ptr<BaseLookup> base_lookup_;
  bool base_done_ = false;
};

Status KVStore::ReadRows(const int64_t* keys, size_t n, uint8_t* out, std::vector<int64_t>* missing, bool* found) {
  RowLookup lookup(this, keys, n, out, missing, found);
  MLKV_RETURN_IF_ERROR(RunReadRounds({&lookup}));
  if (missing && !missing->empty())
    return Status::NotFound(std::to_string(missing->size()) + " keys not in store " + path_);
  return Status::OK();
}

std::unique_ptr<RoundedLookup> KVStore::StartLookup(const int64_t* keys, size_t n, void* values, bool* found) {
  return std::make_unique<RowLookup>(this, keys, n, static_cast<uint8_t*>(values), nullptr, found);
}

Status KVStore::ScanRows(uint64_t* cursor, size_t max_rows, std::vector<int64_t>* keys, std::vector<uint8_t>* values) {
  constexpr uint64_t kReadBytes = 4ull << 20;  // one sequential read
  if (*cursor == kScanDone) return Status::OK();
  const size_t first_row = keys->size();
  // Takes the live rows of `pages` consecutive pages from `data` (page `first_page` first).
  auto take_live = [&](const uint8_t* data, uint64_t first_page, uint64_t pages, uint64_t tail, const std::string& file,
                       uint64_t file_offset) REQUIRES_SHARED(mu_) -> Status {
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
  if (*cursor >= kScanBase) return ScanBaseRows(cursor, max_rows, first_row, keys, values);
  const uint64_t buffer_pages = std::max<uint64_t>(1, kReadBytes / page_bytes_);
  AlignedBuffer buffer(buffer_pages * page_bytes_);
  while (keys->size() - first_row < max_rows) {
    if (*cursor >= kScanBase) return Status::OK();  // a step ends with the log: a scan may stop there
    uint64_t page, pages, segment;
    {
      ReaderLock lock(&mu_);
      if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
      *cursor = std::max(*cursor, begin_);  // compacted past: its rows are further on
      const uint64_t log_done = base_ ? kScanBase : kScanDone;  // then the base run's rows
      if (*cursor >= tail_) {
        *cursor = log_done;
        continue;
      }
      page = PageOf(*cursor);
      if (page >= head_page_) {  // in memory: the rest of the log, under the lock
        const uint64_t end_page = (tail_ + records_per_page_ - 1) / records_per_page_;
        for (; page < end_page && keys->size() - first_row < max_rows; ++page) {
          MLKV_RETURN_IF_ERROR(take_live(FrameOf(page), page, 1, tail_, path_ + " (memory)", 0));
          *cursor = (page + 1) * records_per_page_;
        }
        if (*cursor >= tail_) *cursor = log_done;
        continue;
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
    ReaderLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    MLKV_RETURN_IF_ERROR(take_live(buffer.data, page, pages, tail_, file->path, offset));
    *cursor = (page + pages) * records_per_page_;
  }
  return Status::OK();
}

Status KVStore::ScanBaseRows(uint64_t* cursor, size_t max_rows, size_t first_row, std::vector<int64_t>* keys,
                             std::vector<uint8_t>* values) {
  std::vector<int64_t> run_keys;
  std::vector<uint8_t> run_values;
  while (*cursor != kScanDone && keys->size() - first_row < max_rows) {
    std::shared_ptr<const BaseRuns> base;
    {
      ReaderLock lock(&mu_);
      if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
      base = base_;
    }
    const uint64_t block = *cursor - kScanBase;
    if (!base || block >= base->blocks()) {
      *cursor = kScanDone;
      break;
    }
    run_keys.clear();
    run_values.clear();
    uint64_t next;
    MLKV_RETURN_IF_ERROR(base->ReadBlocks(block, &run_keys, &run_values, &next));
    ReaderLock lock(&mu_);
    for (size_t j = 0; j < run_keys.size(); ++j) {
      if (index_.Find(run_keys[j]) != kNone) continue;  // the log holds a newer row or its deletion
      keys->push_back(run_keys[j]);
      values->insert(values->end(), run_values.begin() + static_cast<std::ptrdiff_t>(j * value_bytes_),
                     run_values.begin() + static_cast<std::ptrdiff_t>((j + 1) * value_bytes_));
    }
    *cursor = next >= base->blocks() ? kScanDone : kScanBase + next;
  }
  return Status::OK();
}

}  // namespace mlkv
