#include "cache/device_index.h"

#ifdef MLKV_WITH_CUDA

#include <c10/cuda/CUDAStream.h>

#include "cache/cuda_kernels.h"

namespace mlkv {

namespace {

cudaStream_t StreamOf(const torch::Device& device) { return c10::cuda::getCurrentCUDAStream(device.index()).stream(); }

void CheckLaunch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "the CUDA kernel ", what, " failed: ", cudaGetErrorString(err));
}

// A host tensor in pinned memory, copied to the device without blocking the host.
torch::Tensor ToDevice(const std::vector<int64_t>& values, const torch::Device& device) {
  torch::Tensor host = torch::empty({static_cast<int64_t>(values.size())},
                                    torch::TensorOptions().dtype(torch::kInt64).pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

}  // namespace

DeviceIndex::DeviceIndex(IdMap* map, const std::vector<int64_t>& table_rows, int table_shift, torch::Device device)
    : map_(map), table_shift_(table_shift), device_(device) {
  table_rows_ = torch::tensor(table_rows, torch::kInt64).to(device_);
  map_->TrackChanges(&changed_, &regrown_);
}

DeviceIndex::~DeviceIndex() { map_->TrackChanges(nullptr, nullptr); }

torch::Tensor DeviceIndex::NewCounters() const {
  return torch::zeros({2 + table_rows_.size(0)}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
}

torch::Tensor DeviceIndex::BatchKeys(const torch::Tensor& values, const std::vector<int64_t>& feature_counts,
                                     const std::vector<int64_t>& feature_tables, const torch::Tensor& counters) const {
  std::vector<int64_t> features(2 * feature_counts.size());  // ends, then tables
  int64_t end = 0;
  for (size_t f = 0; f < feature_counts.size(); ++f) {
    end += feature_counts[f];
    features[f] = end;
    features[feature_counts.size() + f] = feature_tables[f];
  }
  const torch::Tensor on_device = ToDevice(features, device_);
  torch::Tensor keys = torch::empty_like(values);
  const int64_t f = static_cast<int64_t>(feature_counts.size());
  const BatchKeysArgs args{values.data_ptr<int64_t>(),
                           values.numel(),
                           on_device.data_ptr<int64_t>(),
                           on_device.data_ptr<int64_t>() + f,
                           f,
                           table_rows_.data_ptr<int64_t>(),
                           table_shift_,
                           keys.data_ptr<int64_t>(),
                           counters.data_ptr<int64_t>()};
  CheckLaunch(LaunchBatchKeys(args, StreamOf(device_)), "BatchKeys");
  return keys;
}

void DeviceIndex::Sync() {
  const int64_t buckets = static_cast<int64_t>(map_->buckets());
  if (regrown_) {  // the whole map, once at the start and after it grew
    bucket_ids_ = torch::from_blob(const_cast<int64_t*>(map_->bucket_ids()), {buckets}, torch::kInt64).to(device_);
    bucket_slots_ = torch::from_blob(const_cast<int32_t*>(map_->bucket_values()), {buckets}, torch::kInt32).to(device_);
    regrown_ = false;
    changed_.clear();
    ++version_;
    return;
  }
  if (changed_.empty()) return;
  // One upload of (bucket, id, slot) per written bucket, its current contents (a bucket written
  // twice is sent twice, alike).
  const int64_t n = static_cast<int64_t>(changed_.size());
  torch::Tensor host = torch::empty({3, n}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(true));
  int64_t* bucket = host.data_ptr<int64_t>();
  const int64_t* ids = map_->bucket_ids();
  const int32_t* slots = map_->bucket_values();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = changed_[static_cast<size_t>(i)];
    bucket[i] = b;
    bucket[n + i] = ids[b];
    bucket[2 * n + i] = slots[b];
  }
  const torch::Tensor on_device = host.to(device_, /*non_blocking=*/true);
  bucket_ids_.index_copy_(0, on_device[0], on_device[1]);
  bucket_slots_.index_copy_(0, on_device[0], on_device[2].to(torch::kInt32));
  changed_.clear();
  ++version_;
}

torch::Tensor DeviceIndex::FindSlots(const torch::Tensor& keys, const torch::Tensor& counters) const {
  torch::Tensor slots = torch::empty({keys.numel()}, torch::TensorOptions().dtype(torch::kInt32).device(device_));
  const FindSlotsArgs args{bucket_ids_.data_ptr<int64_t>(),
                           bucket_slots_.data_ptr<int32_t>(),
                           static_cast<uint64_t>(bucket_ids_.numel()),
                           keys.data_ptr<int64_t>(),
                           keys.numel(),
                           table_shift_,
                           table_rows_.size(0),
                           slots.data_ptr<int32_t>(),
                           counters.data_ptr<int64_t>()};
  CheckLaunch(LaunchFindSlots(args, StreamOf(device_)), "FindSlots");
  return slots;
}

}  // namespace mlkv

#endif  // MLKV_WITH_CUDA
