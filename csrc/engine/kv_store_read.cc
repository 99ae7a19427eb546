// KVStore's reads: gets from memory under the shared lock, batched disk reads outside it, and
// scans of every live row in log order.
#include "kv_store.h"

#include <algorithm>
#include <cstring>

#include "file_io.h"
#include "log_format.h"

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
  std::vector<size_t> from_base;  // keys the log holds no record of, that the base run may hold
  std::shared_ptr<const BaseRuns> base;
  {
    ReaderLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    const uint64_t head = HeadSlot();
    uint64_t hits = 0;
    // A three-stage pipeline: locate key i+2D and prefetch its buckets, find
    // key i+D and prefetch its record, copy row i; the cache misses overlap.
    constexpr size_t kD = 8;
    HashIndex::Where where[2 * kD];
    uint64_t slot_of[2 * kD];
    auto stage_locate = [&](size_t j)
                            REQUIRES_SHARED(mu_) { index_.Prefetch(where[j % (2 * kD)] = index_.Locate(keys[j])); };
    auto stage_find = [&](size_t j) REQUIRES_SHARED(mu_) {
      const uint64_t address = index_.Find(where[j % (2 * kD)]);
      // A deleted base row reads as absent; a key the log does not hold, from the base run.
      const uint64_t slot = IsDeletion(address) ? kNone : address;
      slot_of[j % (2 * kD)] = address == kNone && BaseMayHold(keys[j]) ? kBaseSlot : slot;
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
      if (slot == kBaseSlot) {
        from_base.push_back(i);
      } else if (slot == kNone) {
        if (missing) missing->push_back(keys[i]);
      } else if (slot >= head) {
        std::memcpy(out + i * value_bytes_, RecordInMemory(slot) + sizeof(RecordHeader), value_bytes_);
        ++hits;
      } else {
        reads.push_back(DiskRecord{i, slot});
      }
    }
    memory_hits_ += hits;
    if (missing && !missing->empty() && from_base.empty())
      return Status::NotFound(std::to_string(missing->size()) + " keys not in store " + path_);
    if (!from_base.empty()) base = base_;
  }
  MLKV_RETURN_IF_ERROR(ReadFromDisk(keys, reads, out));
  if (options_.promote_hot_reads) QueuePromotions(keys, reads, out);
  if (from_base.empty()) return Status::OK();
  std::unique_ptr<bool[]> in_base(new bool[n]);
  MLKV_RETURN_IF_ERROR(ReadFromBase(*base, keys, from_base, out, in_base.get()));
  for (size_t i : from_base) {
    if (found) found[i] = in_base[i];
    if (in_base[i])
      ++disk_rows_;
    else if (missing)
      missing->push_back(keys[i]);
  }
  if (missing && !missing->empty())
    return Status::NotFound(std::to_string(missing->size()) + " keys not in store " + path_);
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
  const uint64_t buffer_pages = std::max<uint64_t>(1, kReadBytes / page_bytes_);
  AlignedBuffer buffer(buffer_pages * page_bytes_);
  while (keys->size() - first_row < max_rows) {
    if (*cursor >= kScanBase) return ScanBaseRows(cursor, max_rows, first_row, keys, values);
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
