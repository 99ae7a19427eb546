// The check the torch-free test programs share: EXPECT(cond, printf-style message) counts and
// reports a failure (the first 20 printed) from any thread; Failures() reads the count.
#pragma once

#include <cstdio>

#include "engine/thread_annotations.h"

namespace mlkv_test {

inline mlkv::Mutex report_mu;
inline int failures GUARDED_BY(report_mu) = 0;

inline int Failures() {
  mlkv::MutexLock lock(&report_mu);
  return failures;
}

}  // namespace mlkv_test

#define EXPECT(cond, ...)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      mlkv::MutexLock report_lock(&mlkv_test::report_mu);                        \
      if (++mlkv_test::failures <= 20) {                                         \
        std::fprintf(stderr, "%s:%d: expected %s: ", __FILE__, __LINE__, #cond); \
        std::fprintf(stderr, __VA_ARGS__);                                       \
        std::fprintf(stderr, "\n");                                              \
      }                                                                          \
    }                                                                            \
  } while (0)
