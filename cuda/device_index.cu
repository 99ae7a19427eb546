// Kernels of the cache's device-resident lookup (csrc/device_index.h): the keys of a batch of
// features, and key -> slot through the copy of the cache's map in device memory.
#include <cuda_runtime.h>

#include "cache/cuda_kernels.h"
#include "id_map.h"

namespace mlkv {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kSharedTables = 1024;  // tables counted per block in shared memory

using Counter = unsigned long long;  // atomicAdd's 64-bit type; the same bits as the int64 counters

// Key of each value, (table << table_shift) | id, the table that of the feature the value belongs
// to (feature_ends: cumulative counts); an id outside its table counts in counters[0].
__global__ void BatchKeysKernel(const int64_t* values, int64_t n, const int64_t* feature_ends,
                                const int64_t* feature_tables, int64_t features, const int64_t* table_rows,
                                int table_shift, int64_t* keys, Counter* counters) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t lo = 0, hi = features - 1;  // the first feature whose end lies past i
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (feature_ends[mid] > i) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int64_t table = feature_tables[lo];
  const int64_t id = values[i];
  if (id < 0 || id >= table_rows[table]) {
    atomicAdd(&counters[0], Counter{1});
    keys[i] = 0;
    return;
  }
  keys[i] = (table << table_shift) | id;
}

// Slot of each key (-1: not cached), probing as IdMap does; misses count in counters[1], hits of
// table t in counters[2 + t] (summed per block first).
__global__ void FindSlotsKernel(const int64_t* bucket_ids, const int32_t* bucket_slots, uint64_t buckets,
                                const int64_t* keys, int64_t n, int table_shift, int64_t tables, int32_t* slots,
                                Counter* counters) {
  __shared__ unsigned int block_hits[kSharedTables];
  const bool shared = tables <= kSharedTables;
  if (shared) {
    for (int64_t t = threadIdx.x; t < tables; t += blockDim.x) block_hits[t] = 0;
  }
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    const int64_t key = keys[i];
    int32_t slot = -1;
    for (uint64_t b = IdMapHome(key, buckets);; b = IdMapNext(b, buckets)) {
      const int64_t at = bucket_ids[b];
      if (at == key) {
        slot = bucket_slots[b];
        break;
      }
      if (at < 0) break;
    }
    slots[i] = slot;
    if (slot < 0) {
      atomicAdd(&counters[1], Counter{1});
    } else if (shared) {
      atomicAdd(&block_hits[key >> table_shift], 1u);
    } else {
      atomicAdd(&counters[2 + (key >> table_shift)], Counter{1});
    }
  }
  __syncthreads();
  if (shared) {
    for (int64_t t = threadIdx.x; t < tables; t += blockDim.x) {
      if (block_hits[t] != 0) atomicAdd(&counters[2 + t], Counter{block_hits[t]});
    }
  }
}

unsigned BlocksFor(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t LaunchBatchKeys(const BatchKeysArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  BatchKeysKernel<<<BlocksFor(a.n), kThreads, 0, stream>>>(a.values, a.n, a.feature_ends, a.feature_tables, a.features,
                                                           a.table_rows, a.table_shift, a.keys,
                                                           reinterpret_cast<Counter*>(a.counters));
  return cudaGetLastError();
}

cudaError_t LaunchFindSlots(const FindSlotsArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  FindSlotsKernel<<<BlocksFor(a.n), kThreads, 0, stream>>>(a.bucket_ids, a.bucket_slots, a.buckets, a.keys, a.n,
                                                           a.table_shift, a.tables, a.slots,
                                                           reinterpret_cast<Counter*>(a.counters));
  return cudaGetLastError();
}

}  // namespace mlkv
