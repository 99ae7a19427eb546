// BlockReader: reads many aligned blocks from files at a high queue depth.
// Three engines: io_uring (one ring per calling thread, raw syscalls), a pool
// of pread workers (one pool per process for all stores), and pread on the
// calling thread, for files in memory (tmpfs), where a read is a copy that a
// hand-off to another thread only delays; the store picks one by its options.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "status.h"

namespace mlkv {

struct ReadRequest {
  int fd = -1;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint8_t* buffer = nullptr;
  int64_t result = 0;  // bytes read, or -errno
};

enum class IoEngine { kAuto = 0, kUring = 1, kThreads = 2, kPread = 3 };

class BlockReader {
 public:
  // `depth`: reads in flight per call; `threads`: workers for kThreads. kAuto picks kPread for
  // files in memory (`in_memory`), else io_uring where the kernel allows it, else kThreads. Callers
  // asking for the same engine and setting share one reader.
  static Status Create(IoEngine engine, uint32_t depth, uint32_t threads, bool in_memory,
                       std::shared_ptr<BlockReader>* out);
  virtual ~BlockReader() = default;
  // Reads every request; sets each `result`. Returns an error only when the
  // engine itself fails; per-request errors are left in `result`.
  virtual Status ReadAll(ReadRequest* requests, size_t n) = 0;
  virtual const char* name() const = 0;
};

// True when this kernel lets the process set up an io_uring.
bool UringAvailable();

// True when `path` is on a file system held in memory (tmpfs, ramfs).
bool InMemoryFileSystem(const std::string& path);

}  // namespace mlkv
