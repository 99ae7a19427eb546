// SerialExecutor: one background thread of the process that runs tasks one after another, shared
// by every store, so the threads of a process do not grow with its number of tables. The stores'
// page flushes, copies (lookahead, promotion) and compactions each have one (SerialExecutor::Of).
//
// A task runs the work its store has pending and returns; a store that gets more work submits
// again (at most one task of a kind per store is queued or running: the store tracks it). A task
// may wait for a task of another executor, never for one of its own.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "thread_annotations.h"

namespace mlkv {

class SerialExecutor {
 public:
  // The process's executor of that name (made on first use, never destroyed: stores may still
  // submit while the process exits).
  static SerialExecutor& Of(const std::string& name);
  void Submit(std::function<void()> task) EXCLUDES(mu_);

 private:
  explicit SerialExecutor(std::string name);
  void Loop() EXCLUDES(mu_);
  const std::string name_;
  Mutex mu_;
  std::condition_variable cv_;  // with mu_: a task was queued
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace mlkv
