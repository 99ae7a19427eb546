// TaskPool: worker threads of the process that run the tasks of one call side by side (the tables
// of a batch read at once, each its own batched read), shared by every cache so the threads of a
// process do not grow with its number of tables.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "thread_annotations.h"

namespace mlkv {

class TaskPool {
 public:
  // The process's pool, of min(8, cores) - 2 workers (made on first use, never destroyed: a cache
  // may still read while the process exits); with none, RunAll runs every task on its caller.
  static TaskPool& Shared();
  // A pool of its own (tests); its workers live as long as the process.
  explicit TaskPool(size_t workers);
  // Runs every task, the calling thread taking its share, and returns once all have returned.
  // Tasks must not throw.
  void RunAll(const std::vector<std::function<void()>>& tasks) EXCLUDES(mu_);
  size_t workers() const { return threads_.size(); }

 private:
  struct Call;  // one RunAll: its tasks, the next to take, how many are left
  static void Drain(Call* call);
  void Loop() EXCLUDES(mu_);
  Mutex mu_;
  std::condition_variable cv_;  // with mu_: work was queued
  std::deque<std::shared_ptr<Call>> queue_ GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace mlkv
