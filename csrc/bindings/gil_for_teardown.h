// The GIL while a bound object that owns threads is destroyed: released, so the object's threads can
// take it (to drop tensors Python saw) while the destructor waits for them, wherever the calling
// thread can take it back. A thread other than the one running the interpreter's exit that released
// it after that exit began would be ended by Python inside the destructor when it asked for it again
// (an abort); such a thread keeps it, and the exit waits for destructors that released it before.
#pragma once

#include <torch/extension.h>

namespace mlkv::bindings {

class GilReleasedForTeardown {
 public:
  GilReleasedForTeardown();
  ~GilReleasedForTeardown();
  GilReleasedForTeardown(const GilReleasedForTeardown&) = delete;
  GilReleasedForTeardown& operator=(const GilReleasedForTeardown&) = delete;

 private:
  PyThreadState* released_ = nullptr;
};

// Registers with Python's atexit the wait for teardowns running with the GIL released.
void WaitForTeardownsAtExit();

}  // namespace mlkv::bindings
