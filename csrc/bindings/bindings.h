// The parts of the module mlkv_torch._C, each binding its classes or functions (module.cpp calls them).
#pragma once

#include <torch/extension.h>

#include "row_ops.h"

// Hidden, as pybind11's own namespace is, for a class bound outside an anonymous namespace: its
// py::class_ is then no more visible than its pybind11 base.
#define MLKV_BINDING __attribute__((visibility("hidden")))

namespace mlkv::bindings {

namespace py = pybind11;

void BindStore(py::module_& m);           // RowStore, Store (store.cpp)
void BindRocksStore(py::module_& m);      // RocksStore, when built with RocksDB (rocks_store.cpp)
void BindOps(py::module_& m);             // initial_rows, bag_backward, apply_optimizer (ops.cpp)
void BindEmbeddingCache(py::module_& m);  // EmbeddingCache and its memory rules (embedding_cache.cpp)
void BindHotRows(py::module_& m);         // HotRowIndex, for replicas of hot rows (hot_rows.cpp)
void BindIdActivity(py::module_& m);      // IdActivity, for virtual tables (id_activity.cpp)

// An optimizer's spec from its Python description (kind: 0..3, as mlkv_torch.optim numbers them).
OptimizerSpec MakeSpec(int64_t kind, double lr, double eps, double beta1, double beta2);

}  // namespace mlkv::bindings
