// ReadAheadQueue: the read-ahead requests on their way to the cache's read-ahead thread, in the
// order they were asked for, the sequence of the last one done, and the read-ahead timings the
// cache's stats report. Its lock is its own and comes after the cache's mu_ (EmbeddingCache queues
// requests under mu_, so they arrive in sequence order); it is held with no other.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "engine/thread_annotations.h"

namespace mlkv {

struct BatchReadAhead;  // embedding_cache.h

struct ReadAheadRequest {
  int32_t sequence = 0;
  std::vector<int64_t> keys;
  std::chrono::steady_clock::time_point queued;
  bool into_slots = false;                // else into the staging area
  std::shared_ptr<BatchReadAhead> batch;  // of ReadAheadBatch, settled once the request is done
};

class ReadAheadQueue {
 public:
  void Push(ReadAheadRequest request) EXCLUDES(mu_);
  // The oldest request, once there is one; none once the queue stops.
  std::optional<ReadAheadRequest> Next() EXCLUDES(mu_);
  // The request of `sequence` (queued at `queued`) is done, and every one before it.
  void Done(int32_t sequence, std::chrono::steady_clock::time_point queued) EXCLUDES(mu_);
  // Waits until the request of `sequence` is done or the queue stops; a `counted` wait adds to wait_us.
  void WaitDone(int32_t sequence, bool counted) EXCLUDES(mu_);
  void Stop() EXCLUDES(mu_);
  // A moving average of the time from queued to done, and the time fetches waited (counted waits).
  double latency_us() EXCLUDES(mu_);
  int64_t wait_us() EXCLUDES(mu_);

 private:
  Mutex mu_;
  std::condition_variable queued_cv_, done_cv_;  // with mu_
  std::deque<ReadAheadRequest> requests_ GUARDED_BY(mu_);
  int32_t done_ GUARDED_BY(mu_) = 0;
  double latency_us_ GUARDED_BY(mu_) = 0;
  int64_t wait_us_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
};

}  // namespace mlkv
