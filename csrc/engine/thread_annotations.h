// Clang's thread-safety attributes and the mutexes that carry them. Under clang with -Wthread-safety
// (scripts/sanitize.sh threads) the compiler proves each GUARDED_BY member is touched only under its
// lock and each REQUIRES function is called with it; under other compilers the attributes vanish.
// std::mutex carries no capability attribute in libstdc++, hence the thin wrappers below.
#pragma once

#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define MLKV_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define MLKV_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) MLKV_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY MLKV_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) MLKV_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) MLKV_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) MLKV_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) MLKV_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) MLKV_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) MLKV_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) MLKV_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) MLKV_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) MLKV_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) MLKV_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) MLKV_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) MLKV_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) MLKV_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) MLKV_THREAD_ANNOTATION(assert_capability(x))
#define RETURN_CAPABILITY(x) MLKV_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS MLKV_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace mlkv {

// std::mutex with a capability, so members can be GUARDED_BY it.
class CAPABILITY("mutex") Mutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis the caller holds it where it cannot see so (a condition variable's predicate).
  void AssertHeld() const ASSERT_CAPABILITY(this) {}
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

// std::shared_mutex with a capability: readers share it, a writer has it alone.
class CAPABILITY("shared_mutex") SharedMutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  void LockShared() ACQUIRE_SHARED() { mu_.lock_shared(); }
  void UnlockShared() RELEASE_SHARED() { mu_.unlock_shared(); }
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  std::shared_mutex mu_;
};

// Holds a Mutex for a scope. Unlock() and Lock() let a scope drop it around slow work; native()
// is what a std::condition_variable waits on (the wait releases and retakes it, unseen by the
// analysis, which keeps treating it as held: write the wait as a loop on the guarded condition).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : lock_(mu->native()) {}
  ~MutexLock() RELEASE() {}
  void Unlock() RELEASE() { lock_.unlock(); }
  void Lock() ACQUIRE() { lock_.lock(); }
  bool owns_lock() const { return lock_.owns_lock(); }
  std::unique_lock<std::mutex>& native() { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

// Holds a SharedMutex alone for a scope.
class SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~WriterLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  void Unlock() RELEASE() {
    mu_->Unlock();
    held_ = false;
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  SharedMutex* mu_;
  bool held_ = true;
};

// Holds a SharedMutex shared for a scope.
class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex* mu) ACQUIRE_SHARED(mu) : mu_(mu) { mu_->LockShared(); }
  ~ReaderLock() RELEASE() {
    if (held_) mu_->UnlockShared();
  }
  void Unlock() RELEASE() {
    mu_->UnlockShared();
    held_ = false;
  }
  void Lock() ACQUIRE_SHARED() {
    mu_->LockShared();
    held_ = true;
  }

 private:
  SharedMutex* mu_;
  bool held_ = true;
};

}  // namespace mlkv
