// RowStoreHandle: what every store binding offers over the RowStore it holds, and what a table's
// EmbeddingCache takes (mlkv_torch._C.RowStore).
#pragma once

#include <torch/extension.h>

#include <memory>

#include "bindings/bindings.h"
#include "bindings/errors.h"
#include "engine/row_store.h"

namespace mlkv::bindings {

class MLKV_BINDING RowStoreHandle {
 public:
  // The store, shared with a table's cache, which keeps it alive.
  std::shared_ptr<mlkv::RowStore> rows() const { return rows_; }

  void Put(const torch::Tensor& keys, const torch::Tensor& values) {
    CheckKeys(keys);
    CheckRowsIn(keys, values);
    Status st;
    {
      py::gil_scoped_release release;
      st = rows_->Put(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), values.data_ptr());
    }
    Check(st);
  }

  torch::Tensor Lookup(const torch::Tensor& keys, torch::Tensor& out) {
    CheckKeys(keys);
    CheckRowsOut(keys, out);
    torch::Tensor found = torch::empty({keys.numel()}, torch::kBool);
    Status st;
    {
      py::gil_scoped_release release;
      st = rows_->Lookup(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), out.data_ptr(),
                         found.data_ptr<bool>());
    }
    Check(st);
    return found;
  }

 protected:
  void CheckRowsIn(const torch::Tensor& keys, const torch::Tensor& values) const {
    TORCH_CHECK_VALUE(values.device().is_cpu() && values.is_contiguous(), "values must be a contiguous CPU tensor");
    TORCH_CHECK_VALUE(static_cast<uint64_t>(values.numel() * values.element_size()) ==
                          static_cast<uint64_t>(keys.numel()) * rows_->value_bytes(),
                      "values must hold ", keys.numel(), " rows of ", rows_->value_bytes(), " bytes");
  }
  void CheckRowsOut(const torch::Tensor& keys, const torch::Tensor& out) const {
    TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() &&
                          static_cast<uint64_t>(out.numel() * out.element_size()) ==
                              static_cast<uint64_t>(keys.numel()) * rows_->value_bytes(),
                      "out must be a contiguous CPU tensor of ", keys.numel(), " rows");
  }

  std::shared_ptr<mlkv::RowStore> rows_;
};

}  // namespace mlkv::bindings
