#include "cache/slot_transfer.h"

#include <chrono>
#include <cstring>

#include "engine/thread_name.h"

namespace mlkv {

HostSlotTransfer::HostSlotTransfer(float* slots, int64_t row_words, int64_t delay_us)
    : slots_(slots), row_words_(row_words), delay_us_(delay_us) {
  copier_ = std::thread([this] { CopierLoop(); });
}

HostSlotTransfer::~HostSlotTransfer() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  queued_cv_.notify_all();
  copier_.join();
}

void HostSlotTransfer::CopyOut(const std::vector<int32_t>& slots, float* rows, uint8_t* marks) {
  {
    // A slot leaves only after any row on its way into it has landed.
    MutexLock lock(&mu_);
    while (landed_ < issued_ && !stopping_) landed_cv_.wait(lock.native());
  }
  const size_t bytes = static_cast<size_t>(row_words_) * sizeof(float);
  for (size_t i = 0; i < slots.size(); ++i) {
    std::memcpy(rows + i * row_words_, slots_ + static_cast<int64_t>(slots[i]) * row_words_, bytes);
    marks[i] = 0;
  }
}

uint64_t HostSlotTransfer::CopyIn(const std::vector<int32_t>& slots, const float* rows) {
  Copy copy{0, slots, std::vector<float>(rows, rows + slots.size() * static_cast<size_t>(row_words_))};
  uint64_t ticket;
  {
    MutexLock lock(&mu_);
    ticket = copy.ticket = ++issued_;
    queue_.push_back(std::move(copy));
  }
  queued_cv_.notify_one();
  return ticket;
}

void HostSlotTransfer::Wait(uint64_t ticket) {
  MutexLock lock(&mu_);
  while (landed_ < ticket && !stopping_) landed_cv_.wait(lock.native());
}

void HostSlotTransfer::CopierLoop() {
  NameThisThread("mlkv-copier");
  for (;;) {
    Copy copy;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) queued_cv_.wait(lock.native());
      if (stopping_) break;
      copy = std::move(queue_.front());
      queue_.pop_front();
    }
    if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    const size_t bytes = static_cast<size_t>(row_words_) * sizeof(float);
    for (size_t i = 0; i < copy.slots.size(); ++i) {
      std::memcpy(slots_ + static_cast<int64_t>(copy.slots[i]) * row_words_, &copy.rows[i * row_words_], bytes);
    }
    {
      MutexLock lock(&mu_);
      landed_ = copy.ticket;
    }
    landed_cv_.notify_all();
  }
  landed_cv_.notify_all();
}

}  // namespace mlkv
