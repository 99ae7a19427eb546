// POSIX file helpers the store's files share: whole writes and reads that
// name the file in their error, directory syncs, and buffers aligned for
// O_DIRECT.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"

namespace mlkv {

constexpr uint64_t kBlockBytes = 4096;  // O_DIRECT alignment and the disk read unit

inline uint64_t RoundUp(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

std::string ErrnoText(int err);

// Bytes aligned to kBlockBytes, freed with the buffer. Those of 8 MiB or more are mapped and
// unmapped: freed to the heap, malloc's arenas would keep them, outside the memory budget. Smaller
// ones come from the heap, which a read made every step reuses: mapped, their pages would fault
// in (zeroed) each time.
struct AlignedBuffer {
  uint8_t* data = nullptr;
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

 private:
  size_t mapped_ = 0;  // bytes mapped (0: from the heap)
};

// All n bytes at `offset`, retrying short writes and EINTR.
Status WriteFully(int fd, const void* data, size_t n, uint64_t offset, const std::string& file);
// All n bytes at `offset`; a file that ends first is Corruption (truncated).
Status ReadExactly(int fd, void* data, size_t n, uint64_t offset, const std::string& file);
// fsync of the directory, so entries created or renamed in it are durable.
Status SyncDirectory(const std::string& dir);
bool FileExists(const std::string& path);
uint64_t FileSize(int fd);
// mkdir -p; InvalidArgument naming the path when it cannot be a directory.
Status MakeDirectories(const std::string& path);

}  // namespace mlkv
