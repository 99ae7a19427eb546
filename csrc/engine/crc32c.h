// CRC-32C (Castagnoli), hardware-accelerated with SSE4.2 where the CPU has it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlkv {

// Extends `crc` (0 to start) over `n` bytes at `data`.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace mlkv
