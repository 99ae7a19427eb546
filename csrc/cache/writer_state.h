// WriterState: what EmbeddingCache's writer thread does besides the write-back buffer it empties.
// It changes with that buffer, so it has no lock of its own: the cache holds it under its mu_.
#pragma once

#include <cstdint>

#include "engine/status.h"

namespace mlkv {

struct WriterState {
  int64_t limit = 0;     // rows the write-back buffer may hold before a fetch waits for the writer
  bool busy = false;     // putting a batch it took, without the cache's lock
  bool paused = false;   // held back (tests of cuts)
  bool stopping = false;
  Status error;          // its last failure; it writes again when a call asks (retry)
  bool retry = false;
  int64_t attempts = 0;  // batches it tried to put
};

}  // namespace mlkv
