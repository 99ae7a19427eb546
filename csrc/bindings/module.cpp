// mlkv_torch._C: the storage engines, the embedding cache and the ops beside them, one file per
// bound class in this folder. Tensors are checked in the bindings (the Python wrappers check them
// first, with friendlier messages); engine calls run with the GIL released, and a non-OK Status
// becomes a typed Python exception (errors.h).
#include <torch/extension.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "bindings/bindings.h"
#include "bindings/errors.h"
#include "engine/fault_points.h"
#include "engine/io_reader.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mlkv-torch storage engine";
  mlkv::bindings::RegisterErrors(m);
#ifdef MLKV_WITH_ROCKSDB
  m.attr("with_rocksdb") = true;
#else
  m.attr("with_rocksdb") = false;
#endif
  m.def("uring_available", &mlkv::UringAvailable, "Whether this kernel allows io_uring.");
  m.def(
      "return_free_heap",
      [] {
#ifdef __GLIBC__
        pybind11::gil_scoped_release released;
        malloc_trim(0);
#endif
      },
      "Gives malloc's free pages back to the system (glibc; elsewhere nothing): after a bulk pass "
      "(populate) whose chunks the heap would otherwise keep, outside the budget.");
  m.def(
      "_arm_fault_for_testing",
      [](const std::string& point, int pass) {
        if (point == "thread_start") {
          mlkv::ArmFaultForTesting(mlkv::FaultPoint::kThreadStart, pass);
        } else if (point == "read_ahead_slot_list") {
          mlkv::ArmFaultForTesting(mlkv::FaultPoint::kReadAheadSlotList, pass);
        } else {
          throw pybind11::value_error("no fault point '" + point + "' (thread_start, read_ahead_slot_list)");
        }
      },
      pybind11::arg("point"), pybind11::arg("pass"),
      "Tests only: the pass-th pass through the point from now fails (0 disarms it); see engine/fault_points.h.");
  mlkv::bindings::BindOps(m);
  mlkv::bindings::BindStore(m);
  mlkv::bindings::BindRocksStore(m);
  mlkv::bindings::BindEmbeddingCache(m);
  mlkv::bindings::BindHotRows(m);
  mlkv::bindings::BindIdActivity(m);
}
