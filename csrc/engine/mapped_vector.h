// MappedVector: a std::vector whose large arrays come straight from the kernel (mmap) and go back to
// it whole when freed.
//
// A merge's working rows come and go in tens of MiB. From malloc, its arena would keep them free
// after the merge, outside the budget; and malloc_trim, which would give them back, gives back every
// thread's free pages too, which the training thread then faults in again every step. Mapped, they
// cost resident memory only where written: reserving a bound costs nothing until it is used.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <new>
#include <vector>

namespace mlkv {

template <typename T>
struct MappedAllocator {
  using value_type = T;
  static constexpr size_t kMapFromBytes = size_t{1} << 20;  // smaller arrays from the heap

  MappedAllocator() = default;
  template <typename U>
  MappedAllocator(const MappedAllocator<U>&) {}  // NOLINT: converting, as allocators are

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMapFromBytes) return static_cast<T*>(::operator new(bytes));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMapFromBytes) {
      ::operator delete(p);
    } else {
      munmap(p, bytes);
    }
  }
  template <typename U>
  bool operator==(const MappedAllocator<U>&) const {
    return true;
  }
};

template <typename T>
using MappedVector = std::vector<T, MappedAllocator<T>>;

}  // namespace mlkv
