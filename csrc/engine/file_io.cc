#include "file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace mlkv {

std::string ErrnoText(int err) { return std::strerror(err); }

AlignedBuffer::AlignedBuffer(size_t bytes) {
  constexpr size_t kMapFrom = 8 << 20;
  if (bytes >= kMapFrom) {
    void* p = mmap(nullptr, RoundUp(bytes, kBlockBytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      data = static_cast<uint8_t*>(p);
      mapped_ = RoundUp(bytes, kBlockBytes);
    }
  } else if (bytes) {
    data = static_cast<uint8_t*>(std::aligned_alloc(kBlockBytes, RoundUp(bytes, kBlockBytes)));
  }
}

AlignedBuffer::~AlignedBuffer() {
  if (mapped_) {
    munmap(data, mapped_);
  } else {
    std::free(data);
  }
}

Status WriteFully(int fd, const void* data, size_t n, uint64_t offset, const std::string& file) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < n) {
    ssize_t k = pwrite(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (k < 0) {
      if (errno == EINTR) continue;
      return Status::IOError("writing " + file + ": " + ErrnoText(errno));
    }
    done += static_cast<size_t>(k);
  }
  return Status::OK();
}

Status ReadExactly(int fd, void* data, size_t n, uint64_t offset, const std::string& file) {
  auto* p = static_cast<uint8_t*>(data);
  size_t done = 0;
  while (done < n) {
    ssize_t k = pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (k < 0) {
      if (errno == EINTR) continue;
      return Status::IOError("reading " + file + ": " + ErrnoText(errno));
    }
    if (k == 0) {
      return Status::Corruption(file + " is truncated: expected " + std::to_string(offset + n) + " bytes, found " +
                                std::to_string(offset + done));
    }
    done += static_cast<size_t>(k);
  }
  return Status::OK();
}

Status SyncDirectory(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IOError("opening directory " + dir + ": " + ErrnoText(errno));
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  if (rc != 0) return Status::IOError("syncing directory " + dir + ": " + ErrnoText(err));
  return Status::OK();
}

bool FileExists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

uint64_t FileSize(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

Status MakeDirectories(const std::string& path) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    partial = path.substr(0, pos);
    if (partial.empty()) continue;
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return Status::InvalidArgument("cannot create store directory " + path + ": " + ErrnoText(errno));
    }
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("path " + path + " exists and is not a directory");
  }
  return Status::OK();
}

}  // namespace mlkv
