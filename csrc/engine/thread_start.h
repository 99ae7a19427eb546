// Starts the package's background threads, through FaultPoint::kThreadStart so tests can make a
// start fail as std::thread does when the system has no thread to give (std::system_error).
#pragma once

#include <thread>
#include <utility>

#include "engine/fault_points.h"

namespace mlkv {

template <typename F>
std::thread StartThread(F&& body) {
  PassFaultPoint(FaultPoint::kThreadStart);
  return std::thread(std::forward<F>(body));
}

}  // namespace mlkv
