// Names the calling thread (at most 15 characters), so `top -H` and /proc/<pid>/task show which
// of the package's background threads does what.
#pragma once

#include <pthread.h>

namespace mlkv {

inline void NameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace mlkv
