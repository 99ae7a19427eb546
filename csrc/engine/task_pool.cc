#include "task_pool.h"

#include <algorithm>
#include <atomic>

#include "thread_name.h"

namespace mlkv {

struct TaskPool::Call {
  const std::vector<std::function<void()>>* tasks;  // read only while a task is left to take
  size_t size = 0;
  std::atomic<size_t> next{0};
  Mutex mu;
  std::condition_variable done_cv;  // with mu
  size_t left GUARDED_BY(mu) = 0;
};

TaskPool& TaskPool::Shared() {
  // Two cores are left to the training thread and the caller: on a small machine a worker would
  // take the core the training step needs (2 cores: 0.71x TorchRec's kernel with one, 0.84x without).
  static TaskPool* pool = new TaskPool(std::min<size_t>(8, std::max(2u, std::thread::hardware_concurrency())) - 2);
  return *pool;
}

TaskPool::TaskPool(size_t workers) {
  for (size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { Loop(); });
  for (std::thread& t : threads_) t.detach();  // the pool lives as long as the process
}

void TaskPool::Drain(Call* call) {
  for (size_t i = call->next++; i < call->size; i = call->next++) {
    (*call->tasks)[i]();
    MutexLock lock(&call->mu);
    if (--call->left == 0) call->done_cv.notify_all();
  }
}

void TaskPool::RunAll(const std::vector<std::function<void()>>& tasks) {
  if (tasks.empty()) return;
  auto call = std::make_shared<Call>();
  call->tasks = &tasks;
  call->size = tasks.size();
  {
    MutexLock lock(&call->mu);
    call->left = tasks.size();
  }
  if (tasks.size() > 1 && !threads_.empty()) {
    {
      MutexLock lock(&mu_);
      for (size_t i = 0; i < std::min(tasks.size() - 1, threads_.size()); ++i) queue_.push_back(call);
    }
    cv_.notify_all();
  }
  Drain(call.get());
  MutexLock lock(&call->mu);
  while (call->left > 0) call->done_cv.wait(lock.native());
}

void TaskPool::Loop() {
  NameThisThread("mlkv-tasks");
  for (;;) {
    std::shared_ptr<Call> call;
    {
      MutexLock lock(&mu_);
      while (queue_.empty()) cv_.wait(lock.native());
      call = std::move(queue_.front());
      queue_.pop_front();
    }
    Drain(call.get());  // a call already finished finds no task left: its tasks vector is never touched
  }
}

}  // namespace mlkv
