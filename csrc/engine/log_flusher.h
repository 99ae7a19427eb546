// LogFlusher: writes the hybrid log's read-only pages from their memory frames to their segment
// files on the process's flush executor (SerialExecutor "mlkv-flush", shared by every store), and
// tracks which pages are on disk and which segments wait for a checkpoint's sync.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <vector>

#include "segment_files.h"
#include "status.h"
#include "thread_annotations.h"

namespace mlkv {

class LogFlusher {
 public:
  struct Layout {
    const uint8_t* frames = nullptr;  // the ring of num_frames page frames; page p lies in frame p % num_frames
    uint64_t page_bytes = 0, pages_per_segment = 0, num_frames = 0;
    uint64_t batch_pages = 1;  // read-only pages that wake the flush task
  };
  static constexpr uint64_t kPagesPerTurn = 64;      // pages one task writes before yielding
  static constexpr uint64_t kWriteBytes = 4ull << 20;  // at most one write of the flush task

  explicit LogFlusher(SegmentFiles* segments) : segments_(segments) {}
  LogFlusher(const LogFlusher&) = delete;
  LogFlusher& operator=(const LogFlusher&) = delete;

  // At open, before any page is written.
  void Configure(const Layout& layout) { layout_ = layout; }
  // Recovery: the pages below `page` are on disk.
  void Reset(uint64_t page) EXCLUDES(mu_);
  uint64_t flushed_page() const { return flushed_page_; }  // pages below are written to their segment
  // The pages below `page` are read-only, to be written; the flush task wakes once enough wait.
  void MarkReadOnly(uint64_t page) EXCLUDES(mu_);
  // Until the pages below page_end are written; a write's error goes to one caller, and the next
  // wait writes the page again.
  Status WaitFlushed(uint64_t page_end) EXCLUDES(mu_);
  // A checkpoint's segments to sync: those written since the last one. A failed sync is kept: after
  // a failed writeback the kernel may drop the pages and a second sync succeed without them, so no
  // later checkpoint may count on them.
  Status TakeDirtySegments(std::vector<uint64_t>* dirty) EXCLUDES(mu_);
  void ReturnDirtySegments(std::vector<uint64_t>::const_iterator first, std::vector<uint64_t>::const_iterator end)
      EXCLUDES(mu_);
  Status FailSync(const Status& error) EXCLUDES(mu_);  // returns the error kept
  bool SyncFailed() EXCLUDES(mu_);
  // Until no flush task is queued or running: the tasks hold `this` and read the frames.
  void WaitIdle() EXCLUDES(mu_);

 private:
  void ScheduleLocked() REQUIRES(mu_);
  void FlushPending() EXCLUDES(mu_);  // the flush task: writes pages up to the target, or to an error
  Status WritePages(uint64_t first_page, uint64_t count) EXCLUDES(mu_);

  SegmentFiles* const segments_;
  Layout layout_;
  Mutex mu_;
  std::condition_variable flushed_cv_;                   // with mu_: flushed_page_ moved, or an error
  uint64_t target_page_ GUARDED_BY(mu_) = 0;             // pages below are read-only, to be written
  std::atomic<uint64_t> flushed_page_{0};                // written under mu_, read without it
  Status error_ GUARDED_BY(mu_);                         // the last write's failure, for one waiter
  bool scheduled_ GUARDED_BY(mu_) = false;               // a FlushPending task is queued or running
  std::vector<uint64_t> dirty_segments_ GUARDED_BY(mu_);  // written since the last checkpoint
  Status sync_error_ GUARDED_BY(mu_);
};

}  // namespace mlkv
