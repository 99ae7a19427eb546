// LogFlusher: the background writes of the log's read-only pages to their segment files.
#include "log_flusher.h"

#include <algorithm>
#include <exception>
#include <string>

#include "file_io.h"
#include "serial_executor.h"

namespace mlkv {

void LogFlusher::Reset(uint64_t page) {
  MutexLock lock(&mu_);
  flushed_page_ = target_page_ = page;
}

Status LogFlusher::WritePages(uint64_t first_page, uint64_t count) {
  std::shared_ptr<SegmentFiles::File> file;
  const uint64_t segment = first_page / layout_.pages_per_segment;
  MLKV_RETURN_IF_ERROR(segments_->Open(segment, SegmentFiles::OpenMode::kCreate, &file));
  const uint8_t* frame = layout_.frames + first_page % layout_.num_frames * layout_.page_bytes;
  MLKV_RETURN_IF_ERROR(WriteFully(file->fd, frame, count * layout_.page_bytes,
                                  (first_page % layout_.pages_per_segment) * layout_.page_bytes, file->path));
  MutexLock lock(&mu_);
  if (dirty_segments_.empty() || dirty_segments_.back() != segment) dirty_segments_.push_back(segment);
  return Status::OK();
}

void LogFlusher::ScheduleLocked() {
  if (scheduled_) return;
  // The task takes mu_ first, so setting the flag after the submit is not late.
  SerialExecutor::Of("mlkv-flush").Submit([this] { FlushPending(); });
  scheduled_ = true;
}

void LogFlusher::FlushPending() {
  MutexLock lock(&mu_);
  // Stops at the first error: a caller collects it (WaitFlushed), and the next wait tries again.
  uint64_t written = 0;  // pages this turn
  while (error_.ok() && flushed_page_ < target_page_) {
    if (written >= kPagesPerTurn) {
      // The stores of a process share this thread: the rest of the backlog queues behind their
      // turns, so one store that keeps appending starves none (scheduled_ stays set).
      SerialExecutor::Of("mlkv-flush").Submit([this] { FlushPending(); });
      return;
    }
    const uint64_t page = flushed_page_;
    // A run of pages in one write, as each write wakes this thread and a wake-up takes a core from
    // training. A run stays within a segment and within the frame ring, where the pages lie side by side.
    const uint64_t count = std::min(
        {target_page_ - page, kPagesPerTurn - written, std::max<uint64_t>(1, kWriteBytes / layout_.page_bytes),
         layout_.pages_per_segment - page % layout_.pages_per_segment, layout_.num_frames - page % layout_.num_frames});
    lock.Unlock();
    // The pages are read-only, and their frames are not reused before they are written: no lock needed.
    Status st;
    try {
      st = WritePages(page, count);
    } catch (const std::exception& e) {
      st = Status::IOError(std::string("writing log pages: ") + e.what());
    }
    lock.Lock();
    if (st.ok()) {
      flushed_page_ = page + count;
      written += count;
    } else {
      error_ = st;
    }
    flushed_cv_.notify_all();
  }
  scheduled_ = false;
  flushed_cv_.notify_all();
}

void LogFlusher::MarkReadOnly(uint64_t page) {
  MutexLock lock(&mu_);
  target_page_ = page;
  // The task wakes once a batch of read-only frames waits, and writes them in one go, as a wake-up
  // per page costs more CPU than the write; the frames beyond the batch keep a put from waiting
  // for it (a frame's reuse still wakes it, in WaitFlushed).
  if (error_.ok() && target_page_ - flushed_page_ >= layout_.batch_pages) ScheduleLocked();
}

Status LogFlusher::WaitFlushed(uint64_t page_end) {
  MutexLock lock(&mu_);
  if (target_page_ < page_end) target_page_ = page_end;
  if (flushed_page_ >= page_end) return Status::OK();
  ScheduleLocked();
  while (!(flushed_page_ >= page_end || !error_.ok())) flushed_cv_.wait(lock.native());
  if (flushed_page_ >= page_end) return Status::OK();
  // Hand the error to this caller; the next wait writes the page again.
  Status st = error_;
  error_ = Status::OK();
  return st;
}

Status LogFlusher::TakeDirtySegments(std::vector<uint64_t>* dirty) {
  MutexLock lock(&mu_);
  if (sync_error_.ok()) dirty->swap(dirty_segments_);
  return sync_error_;
}

void LogFlusher::ReturnDirtySegments(std::vector<uint64_t>::const_iterator first,
                                     std::vector<uint64_t>::const_iterator end) {
  MutexLock lock(&mu_);
  dirty_segments_.insert(dirty_segments_.begin(), first, end);
}

Status LogFlusher::FailSync(const Status& error) {
  MutexLock lock(&mu_);
  sync_error_ = error;
  return sync_error_;
}

bool LogFlusher::SyncFailed() {
  MutexLock lock(&mu_);
  return !sync_error_.ok();
}

void LogFlusher::WaitIdle() {
  MutexLock lock(&mu_);
  while (scheduled_) flushed_cv_.wait(lock.native());
}

}  // namespace mlkv
