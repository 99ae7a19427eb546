#include "serial_executor.h"

#include <map>
#include <memory>

#include "thread_name.h"

namespace mlkv {

SerialExecutor& SerialExecutor::Of(const std::string& name) {
  static std::mutex mu;
  static auto* executors = new std::map<std::string, SerialExecutor*>();
  std::lock_guard<std::mutex> lock(mu);
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
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SerialExecutor::Loop() {
  NameThisThread(name_.c_str());
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return !tasks_.empty(); });
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();  // tasks catch their own errors and keep them for their store
    lock.lock();
  }
}

}  // namespace mlkv
