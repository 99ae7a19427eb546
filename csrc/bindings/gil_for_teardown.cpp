#include "bindings/gil_for_teardown.h"

#include <condition_variable>
#include <mutex>

#include "bindings/bindings.h"

namespace mlkv::bindings {

namespace {

std::mutex teardown_mu;
std::condition_variable teardown_done;
int released_teardowns = 0;  // teardowns running with the GIL released (guarded by teardown_mu)
bool exit_began = false;     // the atexit wait ran (changed with the GIL held)
unsigned long exit_thread = 0;

}  // namespace

GilReleasedForTeardown::GilReleasedForTeardown() {
  // After the runtime is gone (or while it tears down), no Python call is safe: the GIL stays as it is.
  if (!Py_IsInitialized() || !PyGILState_Check()) return;
  if (exit_began && PyThread_get_thread_ident() != exit_thread) return;
  {
    std::lock_guard<std::mutex> lock(teardown_mu);
    ++released_teardowns;
  }
  released_ = PyEval_SaveThread();
}

GilReleasedForTeardown::~GilReleasedForTeardown() {
  if (released_ == nullptr) return;
  PyEval_RestoreThread(released_);  // before the count drops: the exit waits until this thread holds it again
  {
    std::lock_guard<std::mutex> lock(teardown_mu);
    --released_teardowns;
  }
  teardown_done.notify_all();
}

void WaitForTeardownsAtExit() {
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    exit_began = true;
    exit_thread = PyThread_get_thread_ident();
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(teardown_mu);
    teardown_done.wait(lock, [] { return released_teardowns == 0; });
  }));
}

}  // namespace mlkv::bindings
