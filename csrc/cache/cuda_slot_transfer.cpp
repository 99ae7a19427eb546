#include "cache/cuda_slot_transfer.h"

#ifdef MLKV_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>

#include <cstring>

namespace mlkv {

namespace {

void Check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "the read-ahead's ", what, " failed: ", cudaGetErrorString(err));
}

torch::TensorOptions Pinned(torch::ScalarType type) { return torch::TensorOptions().dtype(type).pinned_memory(true); }

}  // namespace

CudaSlotTransfer::CudaSlotTransfer(torch::Tensor slots, torch::Tensor dirty_marks)
    : slots_(std::move(slots)),
      dirty_marks_(std::move(dirty_marks)),
      side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, slots_.device().index())) {
  MutexLock lock(&mu_);
  training_ = c10::cuda::getCurrentCUDAStream(slots_.device().index()).stream();
  Check(cudaEventCreateWithFlags(&training_done_, cudaEventDisableTiming), "event creation");
}

CudaSlotTransfer::~CudaSlotTransfer() {
  MutexLock lock(&mu_);
  for (auto& [ticket, copy] : in_flight_) {
    cudaEventSynchronize(copy.landed);
    cudaEventDestroy(copy.landed);
  }
  in_flight_.clear();
  if (training_done_ != nullptr) cudaEventDestroy(training_done_);
}

void CudaSlotTransfer::UseCurrentStreamForTraining() {
  MutexLock lock(&mu_);
  training_ = c10::cuda::getCurrentCUDAStream(slots_.device().index()).stream();
}

void CudaSlotTransfer::AfterTraining() {
  // Recorded from this thread on the training thread's stream: it covers every kernel queued there so far.
  Check(cudaEventRecord(training_done_, training_), "event record");
  Check(cudaStreamWaitEvent(side_.stream(), training_done_, 0), "stream wait");
}

torch::Tensor CudaSlotTransfer::SlotIndexOnDevice(const std::vector<int32_t>& slots, torch::Tensor* host) {
  *host = torch::empty({static_cast<int64_t>(slots.size())}, Pinned(torch::kInt64));
  int64_t* h = host->data_ptr<int64_t>();
  for (size_t i = 0; i < slots.size(); ++i) h[i] = slots[i];
  return host->to(slots_.device(), /*non_blocking=*/true);
}

void CudaSlotTransfer::CopyOut(const std::vector<int32_t>& slots, float* rows, uint8_t* marks) {
  if (slots.empty()) return;
  const int64_t n = static_cast<int64_t>(slots.size()), row_words = slots_.size(1);
  MutexLock lock(&mu_);
  c10::cuda::CUDAStreamGuard guard(side_);
  AfterTraining();
  torch::Tensor host_slots;
  const torch::Tensor index = SlotIndexOnDevice(slots, &host_slots);
  torch::Tensor host_rows = torch::empty({n, row_words}, Pinned(torch::kFloat32));
  torch::Tensor host_marks = torch::empty({n}, Pinned(torch::kUInt8));
  host_rows.copy_(slots_.index_select(0, index), /*non_blocking=*/true);
  host_marks.copy_(dirty_marks_.index_select(0, index), /*non_blocking=*/true);
  dirty_marks_.index_fill_(0, index, 0);
  side_.synchronize();
  std::memcpy(rows, host_rows.data_ptr<float>(), static_cast<size_t>(n * row_words) * sizeof(float));
  std::memcpy(marks, host_marks.data_ptr<uint8_t>(), static_cast<size_t>(n));
}

uint64_t CudaSlotTransfer::CopyIn(const std::vector<int32_t>& slots, const float* rows) {
  const int64_t n = static_cast<int64_t>(slots.size()), row_words = slots_.size(1);
  MutexLock lock(&mu_);
  c10::cuda::CUDAStreamGuard guard(side_);
  AfterTraining();
  InFlight copy;
  copy.host_rows = torch::empty({n, row_words}, Pinned(torch::kFloat32));
  std::memcpy(copy.host_rows.data_ptr<float>(), rows, static_cast<size_t>(n * row_words) * sizeof(float));
  copy.device_slots = SlotIndexOnDevice(slots, &copy.host_slots);
  copy.device_rows = copy.host_rows.to(slots_.device(), /*non_blocking=*/true);
  // The one scatter: rows into their slots, on the side stream.
  torch::Tensor target = slots_;
  target.index_copy_(0, copy.device_slots, copy.device_rows);
  Check(cudaEventCreateWithFlags(&copy.landed, cudaEventDisableTiming), "event creation");
  Check(cudaEventRecord(copy.landed, side_.stream()), "event record");
  const uint64_t ticket = ++issued_;
  in_flight_.emplace(ticket, std::move(copy));
  return ticket;
}

void CudaSlotTransfer::Wait(uint64_t ticket) {
  cudaEvent_t landed;
  {
    MutexLock lock(&mu_);
    auto it = in_flight_.find(ticket);
    if (it == in_flight_.end()) return;
    landed = it->second.landed;
  }
  Check(cudaEventSynchronize(landed), "copy");
  MutexLock lock(&mu_);
  auto it = in_flight_.find(ticket);
  if (it == in_flight_.end()) return;
  cudaEventDestroy(it->second.landed);
  in_flight_.erase(it);  // its buffers return to the allocator, which orders their reuse on the side stream
}

}  // namespace mlkv

#endif  // MLKV_WITH_CUDA
