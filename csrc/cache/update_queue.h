// UpdateQueue: the optimizer steps EmbeddingCache's applier thread applies in order (CPU), counted
// from queued until applied. Its lock is its own and is held with no other.
#pragma once

#include <torch/extension.h>

#include <condition_variable>
#include <deque>
#include <optional>

#include "engine/thread_annotations.h"

namespace mlkv {

// One optimizer step for distinct keys: gradient rows, the step's number and learning rate.
struct QueuedUpdate {
  torch::Tensor keys, grads;
  int64_t step;
  float lr;
};

class UpdateQueue {
 public:
  void Push(QueuedUpdate update) EXCLUDES(mu_);
  // The oldest update once there is one and the queue is not paused; none once it stops empty
  // (a stopping queue gives its updates still queued, paused or not).
  std::optional<QueuedUpdate> Next() EXCLUDES(mu_);
  void Applied() EXCLUDES(mu_);  // the update Next gave is applied (or failed)
  // Waits until at most `n` updates are queued; raises when that would wait for a paused queue.
  void WaitQueuedAtMost(int64_t n) EXCLUDES(mu_);
  void Pause(bool paused) EXCLUDES(mu_);
  void Stop() EXCLUDES(mu_);
  int64_t queued() EXCLUDES(mu_);  // queued or being applied
  int64_t waits() EXCLUDES(mu_);   // WaitQueuedAtMost calls that waited

 private:
  Mutex mu_;
  std::condition_variable queued_cv_, applied_cv_;  // with mu_
  std::deque<QueuedUpdate> updates_ GUARDED_BY(mu_);
  int64_t queued_ GUARDED_BY(mu_) = 0;
  int64_t waits_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  bool paused_ GUARDED_BY(mu_) = false;
};

}  // namespace mlkv
