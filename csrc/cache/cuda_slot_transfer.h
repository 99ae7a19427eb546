// CudaSlotTransfer: SlotTransfer for a cache in GPU memory. Rows go up through pinned buffers on
// a side stream and are scattered into their slots there; an event per copy says when they
// landed. Every copy first waits (on the device, not the host) for an event recorded on the
// training stream, so no slot changes under a kernel the training step queued before.
// Built with CUDA only.
#pragma once

#ifdef MLKV_WITH_CUDA

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <map>

#include "cache/slot_transfer.h"

namespace mlkv {

class CudaSlotTransfer : public SlotTransfer {
 public:
  // `slots` [capacity, row_words] float32 and `dirty_marks` uint8 [capacity], on one CUDA device.
  CudaSlotTransfer(torch::Tensor slots, torch::Tensor dirty_marks);
  ~CudaSlotTransfer() override;
  CudaSlotTransfer(const CudaSlotTransfer&) = delete;
  CudaSlotTransfer& operator=(const CudaSlotTransfer&) = delete;

  void UseCurrentStreamForTraining() override EXCLUDES(mu_);
  void CopyOut(const std::vector<int32_t>& slots, float* rows, uint8_t* marks) override EXCLUDES(mu_);
  uint64_t CopyIn(const std::vector<int32_t>& slots, const float* rows) override EXCLUDES(mu_);
  void Wait(uint64_t ticket) override EXCLUDES(mu_);

 private:
  // A copy in flight: its event and the buffers it reads, kept until it landed.
  struct InFlight {
    cudaEvent_t landed;
    torch::Tensor host_rows, host_slots, device_rows, device_slots;
  };
  // The side stream waits for the training work given so far (the caller holds mu_).
  void AfterTraining() REQUIRES(mu_);
  torch::Tensor SlotIndexOnDevice(const std::vector<int32_t>& slots, torch::Tensor* host) REQUIRES(mu_);

  const torch::Tensor slots_, dirty_marks_;
  const c10::cuda::CUDAStream side_;
  Mutex mu_;
  cudaStream_t training_ GUARDED_BY(mu_);
  cudaEvent_t training_done_ GUARDED_BY(mu_) = nullptr;
  uint64_t issued_ GUARDED_BY(mu_) = 0;
  std::map<uint64_t, InFlight> in_flight_ GUARDED_BY(mu_);
};

}  // namespace mlkv

#endif  // MLKV_WITH_CUDA
