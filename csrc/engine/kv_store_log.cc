// KVStore's hybrid log in memory: its layout (pages, frames, segments), the record encoding, and
// appends at the tail, which move the read-only and head boundaries as pages fill.
#include "kv_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "crc32c.h"
#include "file_io.h"
#include "log_format.h"

namespace mlkv {

namespace {

constexpr uint64_t kHugePageBytes = 2ull << 20;

}  // namespace

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

void KVStore::MoveLive(uint64_t old_slot, uint64_t new_slot) {
  old_slot = SlotOf(old_slot);  // a deletion's tombstone counts where it lies
  new_slot = SlotOf(new_slot);
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
    ReaderLock lock(&mu_);
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

}  // namespace mlkv
