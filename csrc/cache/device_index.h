// DeviceIndex: the embedding cache's key -> slot map (an IdMap on the host) copied into device
// memory, so that a batch whose rows are all cached is keyed, looked up and gathered without
// leaving the GPU. The host map stays the one that decides (admission, eviction); the copy
// follows it bucket by bucket (IdMap::TrackChanges) and is brought up to date before a lookup.
// Built with CUDA only.
#pragma once

#ifdef MLKV_WITH_CUDA

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "id_map.h"

namespace mlkv {

class DeviceIndex {
 public:
  // Follows `map` (which must outlive it) for tables of `table_rows` rows, keys holding the
  // table above bit `table_shift`.
  DeviceIndex(IdMap* map, const std::vector<int64_t>& table_rows, int table_shift, torch::Device device);
  ~DeviceIndex();
  DeviceIndex(const DeviceIndex&) = delete;
  DeviceIndex& operator=(const DeviceIndex&) = delete;

  // Counters a lookup adds to, on the device: [0] ids outside their table, [1] misses,
  // [2 + t] hits of table t.
  torch::Tensor NewCounters() const;
  // Keys of a batch of features (values: int64 on the device, feature after feature).
  torch::Tensor BatchKeys(const torch::Tensor& values, const std::vector<int64_t>& feature_counts,
                          const std::vector<int64_t>& feature_tables, const torch::Tensor& counters) const;
  // Copies the map's changes since the last call to the device (the caller holds the map's lock).
  void Sync();
  // Slot (int32, -1: not cached) of each of `keys` (int64 on the device) in the copy.
  torch::Tensor FindSlots(const torch::Tensor& keys, const torch::Tensor& counters) const;
  // Uploads so far; slots found at `version` are still the rows' slots while Unchanged(version).
  int64_t version() const { return version_; }
  bool Unchanged(int64_t since) const { return version_ == since && changed_.empty() && !regrown_; }

 private:
  IdMap* map_;
  const int table_shift_;
  const torch::Device device_;
  torch::Tensor table_rows_;  // int64 [tables] on the device
  torch::Tensor bucket_ids_, bucket_slots_;  // the copy: int64 and int32 [buckets] on the device
  std::vector<int64_t> changed_;  // buckets the map wrote since the last Sync
  bool regrown_ = true;  // every bucket changed (and the first Sync uploads them all)
  int64_t version_ = 0;
};

}  // namespace mlkv

#endif  // MLKV_WITH_CUDA
