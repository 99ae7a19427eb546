#include "cache/update_queue.h"

#include <utility>

namespace mlkv {

void UpdateQueue::Push(QueuedUpdate update) {
  {
    MutexLock lock(&mu_);
    updates_.push_back(std::move(update));
    ++queued_;
  }
  queued_cv_.notify_one();
}

std::optional<QueuedUpdate> UpdateQueue::Next() {
  MutexLock lock(&mu_);
  while (!stopping_ && (paused_ || updates_.empty())) queued_cv_.wait(lock.native());
  if (updates_.empty()) return std::nullopt;
  QueuedUpdate update = std::move(updates_.front());
  updates_.pop_front();
  return update;
}

void UpdateQueue::Applied() {
  {
    MutexLock lock(&mu_);
    --queued_;
  }
  applied_cv_.notify_all();
}

void UpdateQueue::WaitQueuedAtMost(int64_t n) {
  MutexLock lock(&mu_);
  if (queued_ <= n) return;
  TORCH_CHECK(!paused_, "the applier is paused with ", queued_, " updates queued; this call would wait for it forever");
  ++waits_;
  while (queued_ > n) applied_cv_.wait(lock.native());
}

void UpdateQueue::Pause(bool paused) {
  {
    MutexLock lock(&mu_);
    paused_ = paused;
  }
  queued_cv_.notify_all();
}

void UpdateQueue::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    paused_ = false;
  }
  queued_cv_.notify_all();
}

int64_t UpdateQueue::queued() {
  MutexLock lock(&mu_);
  return queued_;
}

int64_t UpdateQueue::waits() {
  MutexLock lock(&mu_);
  return waits_;
}

}  // namespace mlkv
