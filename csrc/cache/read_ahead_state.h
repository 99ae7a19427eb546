// ReadAheadState: EmbeddingCache's record of its read-aheads: which request reads each row in
// flight, how many were asked for, those no lookup took yet and the one the batch between its lookup
// and its update took. It changes with the slots its read-aheads pin, so it has no lock of its own:
// the cache holds it under its mu_.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>

#include "id_map.h"

namespace mlkv {

struct BatchReadAhead;  // embedding_cache.h

// A read-ahead no lookup took yet: its sequence, its batch's fingerprint (none for one read into the
// staging area) and its batch (none for a read-ahead of keys, ReadAhead).
struct UntakenReadAhead {
  int32_t sequence;
  std::optional<uint64_t> fingerprint;
  std::shared_ptr<BatchReadAhead> batch;
};

struct ReadAheadState {
  IdMap reading;  // key -> sequence of the read-ahead request reading it
  int32_t issued = 0;  // read-aheads asked for (each has its sequence number)
  std::deque<UntakenReadAhead> untaken;
  int32_t in_use = 0;  // taken by the batch between its lookup and its update (read_ahead_into_slots)
};

}  // namespace mlkv
