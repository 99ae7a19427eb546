// SegmentFiles: the hybrid log's on-disk part, one append-only file per segment, and the bounded
// LRU cache of their open descriptors. A reader's shared_ptr keeps a file open while it reads, even
// after the cache (or a compaction) lets it go.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "status.h"
#include "thread_annotations.h"

namespace mlkv {

class SegmentFiles {
 public:
  struct File {  // an open segment file, closed with the last reference
    std::string path;
    int fd = -1;
    ~File();
  };
  // kMustExist reports a missing file as corruption; kMayVanish as Busy, for a reader that looked
  // the slot up before a compaction deleted its segment.
  enum class OpenMode { kCreate, kMustExist, kMayVanish };

  explicit SegmentFiles(const std::string& dir) : dir_(dir) {}
  SegmentFiles(const SegmentFiles&) = delete;
  SegmentFiles& operator=(const SegmentFiles&) = delete;

  // Set once at open, before any file is opened.
  void Configure(bool direct_io, size_t max_open_files, bool read_only = false) {
    direct_io_ = direct_io;
    max_open_files_ = max_open_files;
    read_only_ = read_only;
  }
  std::string PathOf(uint64_t segment) const;
  Status Open(uint64_t segment, OpenMode mode, std::shared_ptr<File>* out) EXCLUDES(mu_);
  void Forget(uint64_t segment) EXCLUDES(mu_);  // after its file was deleted
  void ForgetAll() EXCLUDES(mu_);
  // Descriptors the cache keeps at most; shrinks when the process runs short of them.
  size_t max_open() const { return max_open_files_.load(); }

 private:
  void EvictBeyond(size_t limit) REQUIRES(mu_);

  const std::string dir_;
  bool direct_io_ = false;
  bool read_only_ = false;  // files opened for reading only (a read-only store)
  Mutex mu_;
  std::list<uint64_t> open_order_ GUARDED_BY(mu_);  // most recently used first
  std::unordered_map<uint64_t, std::pair<std::shared_ptr<File>, std::list<uint64_t>::iterator>> open_files_
      GUARDED_BY(mu_);
  std::atomic<size_t> max_open_files_{256};
};

}  // namespace mlkv
