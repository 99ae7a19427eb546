// SlotTransfer: how rows move between host memory and the cache's slots off the training path,
// for the read-ahead into slots (read_ahead.cpp). The cache decides which slots to reserve
// and which rows leave (the policy, the pins); a backend only moves rows and says when they landed:
//
// - CopyOut: rows leaving their slots (and the device's dirty marks of those slots), once every
//   kernel the training stream was given has run; returns with them on the host.
// - CopyIn: starts copying host rows into reserved slots, after that same training work; returns
//   a ticket. Wait(ticket) blocks the calling thread (the read-ahead thread) until they landed, so
//   the cache publishes a slot in its index only once its row is there.
//
// Two backends: HostSlotTransfer (slots in host memory; a copier thread stands for the side
// stream, with an optional delay so tests can hold copies in flight) and CudaSlotTransfer (pinned
// buffers, a side stream, events, one scatter per copy; CUDA builds only).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "engine/thread_annotations.h"

namespace mlkv {

class SlotTransfer {
 public:
  virtual ~SlotTransfer() = default;
  // The calling thread's current stream is the training stream from now on (CUDA; no-op on the host).
  virtual void UseCurrentStreamForTraining() {}
  // Rows [n, row_words] of `slots` into `rows`, and their device dirty marks into `marks` (then
  // cleared on the device; zeros where the host keeps the only marks), after the training work
  // given so far; returns when they are on the host.
  virtual void CopyOut(const std::vector<int32_t>& slots, float* rows, uint8_t* marks) = 0;
  // Starts copying `rows` [n, row_words] (read before it returns) into `slots`, after the
  // training work given so far; returns the copy's ticket.
  virtual uint64_t CopyIn(const std::vector<int32_t>& slots, const float* rows) = 0;
  // Blocks the calling thread until copy `ticket` has landed.
  virtual void Wait(uint64_t ticket) = 0;
};

// Slots in host memory. A copier thread lands each copy `delay_us` microseconds after it was
// started (0: at once), in order; training work on the host is done by the time it returns, so
// there is nothing to wait for before a copy.
class HostSlotTransfer : public SlotTransfer {
 public:
  HostSlotTransfer(float* slots, int64_t row_words, int64_t delay_us);
  ~HostSlotTransfer() override;
  HostSlotTransfer(const HostSlotTransfer&) = delete;
  HostSlotTransfer& operator=(const HostSlotTransfer&) = delete;

  void CopyOut(const std::vector<int32_t>& slots, float* rows, uint8_t* marks) override EXCLUDES(mu_);
  uint64_t CopyIn(const std::vector<int32_t>& slots, const float* rows) override EXCLUDES(mu_);
  void Wait(uint64_t ticket) override EXCLUDES(mu_);

 private:
  struct Copy {
    uint64_t ticket;
    std::vector<int32_t> slots;
    std::vector<float> rows;
  };
  void CopierLoop() EXCLUDES(mu_);

  float* const slots_;  // written by the copier into reserved slots only, which nothing else touches
  const int64_t row_words_, delay_us_;
  Mutex mu_;
  std::condition_variable queued_cv_, landed_cv_;  // with mu_
  std::deque<Copy> queue_ GUARDED_BY(mu_);
  uint64_t issued_ GUARDED_BY(mu_) = 0;
  uint64_t landed_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread copier_;
};

}  // namespace mlkv
