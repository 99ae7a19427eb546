// How the engine's errors reach Python: a non-OK Status becomes a typed Python exception (KeyError,
// ValueError, mlkv_torch._C.CorruptionError, StoreIOError), and every exception a binding throws is
// translated by this module's own runtime. Also the checks of tensors the bindings share.
#pragma once

#include <torch/extension.h>

#include <stdexcept>
#include <vector>

#include "engine/status.h"

namespace mlkv::bindings {

namespace py = pybind11;

struct CorruptionException : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct StoreIOException : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raises the Python exception of a non-OK Status; a KeyError names up to ten of `missing`.
void Check(const Status& st, const std::vector<int64_t>* missing = nullptr);

// Runs an engine call with the GIL released (it may wait on the disk or on other threads).
template <typename F>
auto Unlocked(F&& f) {
  py::gil_scoped_release release;
  return f();
}

// Raises unless `keys` is a contiguous 1-D int64 CPU tensor.
void CheckKeys(const torch::Tensor& keys);

// Registers the module's exception types and its translator of every exception.
void RegisterErrors(py::module_& m);

}  // namespace mlkv::bindings
