#include "cache/read_ahead_queue.h"

#include <utility>

namespace mlkv {

void ReadAheadQueue::Push(ReadAheadRequest request) {
  {
    MutexLock lock(&mu_);
    requests_.push_back(std::move(request));
  }
  queued_cv_.notify_one();
}

std::optional<ReadAheadRequest> ReadAheadQueue::Next() {
  MutexLock lock(&mu_);
  while (!stopping_ && requests_.empty()) queued_cv_.wait(lock.native());
  if (stopping_) return std::nullopt;
  ReadAheadRequest request = std::move(requests_.front());
  requests_.pop_front();
  return request;
}

void ReadAheadQueue::Done(int32_t sequence, std::chrono::steady_clock::time_point queued) {
  {
    MutexLock lock(&mu_);
    done_ = sequence;
    const double latency_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - queued).count();
    latency_us_ = latency_us_ == 0 ? latency_us : 0.7 * latency_us_ + 0.3 * latency_us;
  }
  done_cv_.notify_all();
}

void ReadAheadQueue::WaitDone(int32_t sequence, bool counted) {
  const auto start = std::chrono::steady_clock::now();
  MutexLock lock(&mu_);
  while (done_ < sequence && !stopping_) done_cv_.wait(lock.native());
  if (counted) {
    wait_us_ += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
  }
}

void ReadAheadQueue::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  queued_cv_.notify_all();
  done_cv_.notify_all();
}

double ReadAheadQueue::latency_us() {
  MutexLock lock(&mu_);
  return latency_us_;
}

int64_t ReadAheadQueue::wait_us() {
  MutexLock lock(&mu_);
  return wait_us_;
}

}  // namespace mlkv
