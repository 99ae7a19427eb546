// The binding of the module's functions on tensors: initial rows, the bag's backward, the optimizer.
#include <torch/extension.h>

#include <initializer_list>

#include "bindings/bindings.h"
#include "bindings/errors.h"
#include "row_ops.h"

namespace mlkv::bindings {

namespace {

// Rows never written: element j of row `id` is uniform in [a, b) (normal: mean a, deviation b),
// a function of (seed, id, j) alone, so every batch order gives the same rows.
torch::Tensor InitialRows(const torch::Tensor& ids, int64_t dim, int64_t seed, double a, double b,
                          torch::ScalarType dtype, int64_t first_column, bool normal) {
  CheckKeys(ids);
  TORCH_CHECK_VALUE(dim > 0, "dim must be positive, got ", dim);
  if (normal) {
    TORCH_CHECK_VALUE(b >= 0, "std must be non-negative, got ", b);
  } else {
    TORCH_CHECK_VALUE(a <= b, "low must not exceed high, got [", a, ", ", b, ")");
  }
  torch::Tensor rows = torch::empty({ids.numel(), dim}, torch::kFloat32);
  const int64_t* id = ids.data_ptr<int64_t>();
  float* out = rows.data_ptr<float>();
  TORCH_CHECK_VALUE(first_column >= 0, "first_column must be non-negative, got ", first_column);
  const mlkv::RowInit init{static_cast<uint64_t>(seed), static_cast<float>(a), static_cast<float>(normal ? b : b - a),
                           first_column, normal};
  at::parallel_for(0, ids.numel(), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) mlkv::InitialRow(init, id[i], dim, out + i * dim);
  });
  return dtype == torch::kFloat32 ? rows : rows.to(dtype);
}

// Backward of the bag pooling on the CPU, in one pass: gradient rows per
// distinct id (duplicates summed, as a coalesced sparse gradient) and, when
// `weights` is given, the gradient of per_sample_weights.
std::tuple<torch::Tensor, torch::Tensor> BagBackward(const torch::Tensor& grad_out, const torch::Tensor& offsets,
                                                     const torch::Tensor& inverse, int64_t distinct, bool mean,
                                                     const c10::optional<torch::Tensor>& per_sample_weights,
                                                     const c10::optional<torch::Tensor>& weights) {
  TORCH_CHECK_VALUE(grad_out.device().is_cpu() && grad_out.dim() == 2, "grad_out must be a 2-D CPU tensor");
  const torch::Tensor g = grad_out.to(torch::kFloat32).contiguous();
  const int64_t bags = g.size(0), dim = g.size(1);
  TORCH_CHECK_VALUE(offsets.scalar_type() == torch::kInt64 && offsets.numel() == bags + 1 && offsets.is_contiguous(),
                    "offsets must be int64 [bags + 1]");
  TORCH_CHECK_VALUE(inverse.scalar_type() == torch::kInt64 && inverse.is_contiguous(), "inverse must be int64");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* inv = inverse.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(off[bags] == inverse.numel(), "offsets must end at the input length");
  torch::Tensor psw = per_sample_weights ? per_sample_weights->to(torch::kFloat32).contiguous() : torch::Tensor();
  torch::Tensor w = weights ? weights->to(torch::kFloat32).contiguous() : torch::Tensor();
  torch::Tensor grads = torch::zeros({distinct, dim}, torch::kFloat32);
  torch::Tensor grad_psw = w.defined() ? torch::empty({inverse.numel()}, torch::kFloat32) : torch::Tensor();
  const float* gp = g.data_ptr<float>();
  const float* pp = psw.defined() ? psw.data_ptr<float>() : nullptr;
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  float* out = grads.data_ptr<float>();
  float* gpsw = grad_psw.defined() ? grad_psw.data_ptr<float>() : nullptr;
  {
    py::gil_scoped_release release;
    for (int64_t b = 0; b < bags; ++b) {
      const float* row = gp + b * dim;
      const int64_t begin = off[b], end = off[b + 1];
      const float bag_scale = mean && end > begin ? 1.0f / static_cast<float>(end - begin) : 1.0f;
      for (int64_t j = begin; j < end; ++j) {
        TORCH_CHECK_VALUE(inv[j] >= 0 && inv[j] < distinct, "inverse index out of range");
        float* dst = out + inv[j] * dim;
        if (gpsw) {
          const float* wr = wp + inv[j] * dim;
          float dot = 0.f;
          for (int64_t k = 0; k < dim; ++k) dot += row[k] * wr[k];
          gpsw[j] = dot;
        }
        const float scale = pp ? pp[j] * bag_scale : bag_scale;
        for (int64_t k = 0; k < dim; ++k) dst[k] += row[k] * scale;
      }
    }
  }
  return {grads, grad_psw};
}

// The fused rule on separate weight and state tensors (CPU float32, rows of
// unit stride); mlkv_torch.optim calls it, so its tests check the same code
// the cache runs.
void ApplyOptimizer(int64_t kind, double lr, double eps, double beta1, double beta2, torch::Tensor weights,
                    torch::Tensor state, const torch::Tensor& grads, int64_t step) {
  const mlkv::OptimizerSpec spec = MakeSpec(kind, lr, eps, beta1, beta2);
  const int64_t n = weights.size(0), dim = weights.size(1);
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&weights, &state, &grads}) {
    TORCH_CHECK_VALUE(t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->dim() == 2 && t->size(0) == n &&
                          (t->size(1) == 0 || t->stride(1) == 1),
                      "weights, state and grads must be 2-D float32 CPU tensors of ", n,
                      " rows with unit column stride");
  }
  TORCH_CHECK_VALUE(grads.size(1) == dim && state.size(1) == mlkv::StateColumns(spec.kind, dim), "grads must be [n, ",
                    dim, "] and state [n, ", mlkv::StateColumns(spec.kind, dim), "]");
  TORCH_CHECK_VALUE(spec.kind != mlkv::OptimizerKind::kAdam || step >= 1, "step counts from 1, got ", step);
  const float adam_scale = spec.kind == mlkv::OptimizerKind::kAdam ? mlkv::AdamStepScale(spec, step) : 0.f;
  float* w = weights.data_ptr<float>();
  float* st = state.data_ptr<float>();
  const float* g = grads.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    mlkv::UpdateRow<float>(spec, adam_scale, w + i * weights.stride(0), st + i * state.stride(0),
                           g + i * grads.stride(0), dim);
  }
}

}  // namespace

OptimizerSpec MakeSpec(int64_t kind, double lr, double eps, double beta1, double beta2) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 3, "unknown optimizer kind ", kind);
  return {static_cast<mlkv::OptimizerKind>(kind), static_cast<float>(lr), static_cast<float>(eps),
          static_cast<float>(beta1), static_cast<float>(beta2)};
}

void BindOps(py::module_& m) {
  m.def("initial_rows", &InitialRows, py::arg("ids"), py::arg("dim"), py::arg("seed"), py::arg("a"), py::arg("b"),
        py::arg("dtype"), py::arg("first_column") = 0, py::arg("normal") = false,
        "Deterministic initial rows from (seed, id, column): uniform [a, b), or normal(mean a, std b).");
  m.def("bag_backward", &BagBackward, py::arg("grad_out"), py::arg("offsets"), py::arg("inverse"), py::arg("distinct"),
        py::arg("mean"), py::arg("per_sample_weights"), py::arg("weights"),
        "Gradient rows per distinct id of a pooled bag, and of per_sample_weights, on the CPU.");
  m.def("apply_optimizer", &ApplyOptimizer, py::arg("kind"), py::arg("lr"), py::arg("eps"), py::arg("beta1"),
        py::arg("beta2"), py::arg("weights"), py::arg("state"), py::arg("grads"), py::arg("step"),
        "One fused optimizer step on CPU float32 rows, in place.");
}

}  // namespace mlkv::bindings
