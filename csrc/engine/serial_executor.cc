#include "serial_executor.h"

#include <map>
#include <memory>

#include "thread_name.h"

namespace mlkv {

SerialExecutor& SerialExecutor::Of(const std::string& name) {
  static Mutex mu;  // guards executors
  static auto* executors = new std::map<std::string, SerialExecutor*>();
  MutexLock lock(&mu);
  SerialExecutor*& executor = (*executors)[name];
  if (executor == nullptr) executor = new SerialExecutor(name);
  return *executor;
}

SerialExecutor::SerialExecutor(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { Loop(); });
  thread_.detach();  // lives as long as the process
}

void SerialExecutor::Submit(std::function<void()> task) {
  {
    MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SerialExecutor::Loop() {
  NameThisThread(name_.c_str());
  MutexLock lock(&mu_);
  for (;;) {
    while (tasks_.empty()) cv_.wait(lock.native());
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.Unlock();
    task();  // tasks catch their own errors and keep them for their store
    lock.Lock();
  }
}

}  // namespace mlkv
