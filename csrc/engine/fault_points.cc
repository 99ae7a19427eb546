#include "engine/fault_points.h"

#include <atomic>
#include <system_error>

namespace mlkv {

namespace {

constexpr int kFaultPoints = 2;

// Passes left until the armed one, per point; 0: unarmed.
std::atomic<int> passes_left[kFaultPoints];

std::system_error FaultOf(FaultPoint point) {
  if (point == FaultPoint::kThreadStart) {
    return std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                             "starting a thread (fault point)");
  }
  return std::system_error(std::make_error_code(std::errc::not_enough_memory), "allocating a slot list (fault point)");
}

}  // namespace

void ArmFaultForTesting(FaultPoint point, int pass) { passes_left[static_cast<int>(point)].store(pass > 0 ? pass : 0); }

void PassFaultPoint(FaultPoint point) {
  std::atomic<int>& left = passes_left[static_cast<int>(point)];
  int now = left.load(std::memory_order_relaxed);
  while (now > 0 && !left.compare_exchange_weak(now, now - 1)) {
  }
  if (now == 1) throw FaultOf(point);
}

}  // namespace mlkv
