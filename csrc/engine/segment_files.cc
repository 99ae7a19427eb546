// SegmentFiles: segment file names and the LRU cache of their open descriptors.
#include "segment_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>

#include "file_io.h"

namespace mlkv {

SegmentFiles::File::~File() {
  if (fd >= 0) close(fd);
}

std::string SegmentFiles::PathOf(uint64_t segment) const {
  char name[64];
  std::snprintf(name, sizeof(name), "/segment-%010" PRIu64 ".log", segment);
  return dir_ + name;
}

void SegmentFiles::EvictBeyond(size_t limit) {
  while (open_files_.size() > limit && !open_order_.empty()) {
    open_files_.erase(open_order_.back());  // in-flight readers still hold the descriptor
    open_order_.pop_back();
  }
}

Status SegmentFiles::Open(uint64_t segment, OpenMode mode, std::shared_ptr<File>* out) {
  const bool create = mode == OpenMode::kCreate;
  MutexLock lock(&mu_);
  auto it = open_files_.find(segment);
  if (it != open_files_.end()) {
    open_order_.splice(open_order_.begin(), open_order_, it->second.second);
    *out = it->second.first;
    return Status::OK();
  }
  auto file = std::make_shared<File>();
  file->path = PathOf(segment);
  int flags = (read_only_ ? O_RDONLY : O_RDWR) | O_CLOEXEC | (create ? O_CREAT : 0) | (direct_io_ ? O_DIRECT : 0);
  file->fd = open(file->path.c_str(), flags, 0644);
  if (file->fd < 0 && (errno == EMFILE || errno == ENFILE) && open_files_.size() > 1) {
    // The process is short of descriptors: keep fewer segment files open.
    max_open_files_ = std::max<size_t>(2, open_files_.size() / 2);
    EvictBeyond(max_open_files_ - 1);
    file->fd = open(file->path.c_str(), flags, 0644);
  }
  if (file->fd < 0) {
    if (mode == OpenMode::kMustExist && errno == ENOENT)
      return Status::Corruption("segment file " + file->path + " is missing");
    if (mode == OpenMode::kMayVanish && errno == ENOENT)
      return Status::Busy("segment file " + file->path + " was compacted away");
    return Status::IOError("opening " + file->path + ": " + ErrnoText(errno));
  }
  open_order_.push_front(segment);
  open_files_[segment] = {file, open_order_.begin()};
  EvictBeyond(max_open_files_);
  *out = file;
  return Status::OK();
}

void SegmentFiles::Forget(uint64_t segment) {
  MutexLock lock(&mu_);
  auto it = open_files_.find(segment);
  if (it == open_files_.end()) return;
  open_order_.erase(it->second.second);
  open_files_.erase(it);
}

void SegmentFiles::ForgetAll() {
  MutexLock lock(&mu_);
  open_files_.clear();
  open_order_.clear();
}

}  // namespace mlkv
