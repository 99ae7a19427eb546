#include "io_reader.h"

#include <fcntl.h>
#include <linux/io_uring.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <tuple>

#include "thread_annotations.h"
#include "thread_name.h"

namespace mlkv {
namespace {

int SysUringSetup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int SysUringEnter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

// One io_uring instance: the submission and completion rings mapped from the kernel.
class UringRing {
 public:
  ~UringRing() {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) munmap(cq_ptr_, cq_bytes_);
    if (sq_ptr_) munmap(sq_ptr_, sq_bytes_);
    if (fd_ >= 0) close(fd_);
  }

  Status Init(unsigned entries) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd_ = SysUringSetup(entries, &p);
    if (fd_ < 0) return Status::IOError(std::string("io_uring_setup: ") + std::strerror(errno));
    sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ptr_ = mmap(nullptr, sq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    if (sq_ptr_ == MAP_FAILED) {
      sq_ptr_ = nullptr;
      return Status::IOError("io_uring mmap of the submission ring failed");
    }
    if (single) {
      cq_ptr_ = sq_ptr_;
    } else {
      cq_ptr_ = mmap(nullptr, cq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_CQ_RING);
      if (cq_ptr_ == MAP_FAILED) {
        cq_ptr_ = nullptr;
        return Status::IOError("io_uring mmap of the completion ring failed");
      }
    }
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(
        mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES));
    if (sqes_ == MAP_FAILED) {
      sqes_ = nullptr;
      return Status::IOError("io_uring mmap of the entries failed");
    }
    auto* sq = static_cast<uint8_t*>(sq_ptr_);
    auto* cq = static_cast<uint8_t*>(cq_ptr_);
    sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    entries_ = p.sq_entries;
    return Status::OK();
  }

  // Keeps up to `depth` reads in flight until all `n` complete. On an error it
  // still waits for every submitted read (their buffers belong to the caller)
  // and marks the ring broken, since unsubmitted entries may remain in it.
  Status ReadAll(ReadRequest* reqs, size_t n, unsigned depth) {
    depth = std::min(depth, entries_);
    size_t next = 0;
    unsigned in_flight = 0;  // consumed by the kernel, not yet completed
    unsigned queued = 0;     // in the submission ring, not yet consumed
    int busy_retries = 0;
    Status error;
    while (true) {
      if (error.ok()) {
        unsigned tail = *sq_tail_;
        while (next < n && in_flight + queued < depth) {
          unsigned idx = tail & sq_mask_;
          io_uring_sqe* sqe = &sqes_[idx];
          std::memset(sqe, 0, sizeof(*sqe));
          sqe->opcode = IORING_OP_READ;
          sqe->fd = reqs[next].fd;
          sqe->off = reqs[next].offset;
          sqe->addr = reinterpret_cast<uint64_t>(reqs[next].buffer);
          sqe->len = reqs[next].length;
          sqe->user_data = next;
          sq_array_[idx] = idx;
          ++tail;
          ++queued;
          ++next;
        }
        __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
      }
      const unsigned to_submit = error.ok() ? queued : 0;
      if (in_flight == 0 && to_submit == 0) break;
      int rc = SysUringEnter(fd_, to_submit, 1, IORING_ENTER_GETEVENTS);
      if (rc < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if ((err == EAGAIN || err == EBUSY) && busy_retries++ < 1000) {
          if (in_flight == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
          rc = 0;  // nothing consumed; reap whatever completed
        } else {
          error = Status::IOError(std::string("io_uring_enter: ") + std::strerror(err));
          rc = 0;
        }
      }
      queued -= static_cast<unsigned>(rc);
      in_flight += static_cast<unsigned>(rc);
      unsigned head = *cq_head_;
      const unsigned ctail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      while (head != ctail) {
        const io_uring_cqe& cqe = cqes_[head & cq_mask_];
        if (cqe.user_data < n) reqs[cqe.user_data].result = cqe.res;
        ++head;
        --in_flight;
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      if (error.ok() && next == n && queued == 0 && in_flight == 0) break;
    }
    if (!error.ok() || queued != 0) broken_ = true;
    return error;
  }

  bool broken() const { return broken_; }

 private:
  int fd_ = -1;
  bool broken_ = false;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, entries_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
};

int64_t PreadFully(const ReadRequest& r) {
  uint64_t got = 0;
  while (got < r.length) {
    ssize_t k = pread(r.fd, r.buffer + got, r.length - got, static_cast<off_t>(r.offset + got));
    if (k < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (k == 0) break;
    got += static_cast<uint64_t>(k);
  }
  return static_cast<int64_t>(got);
}

class UringReader : public BlockReader {
 public:
  explicit UringReader(uint32_t depth) : depth_(depth) {}
  const char* name() const override { return "io_uring"; }

  Status ReadAll(ReadRequest* reqs, size_t n) override {
    // A ring serves one thread at a time; each calling thread gets its own.
    thread_local std::unique_ptr<UringRing> ring;
    thread_local uint32_t ring_depth = 0;
    if (!ring || ring_depth < depth_) {
      auto fresh = std::make_unique<UringRing>();
      MLKV_RETURN_IF_ERROR(fresh->Init(depth_));
      ring = std::move(fresh);
      ring_depth = depth_;
    }
    Status st = ring->ReadAll(reqs, n, depth_);
    if (ring->broken()) ring.reset();  // the next call starts a fresh ring
    MLKV_RETURN_IF_ERROR(st);
    // A short read (a read that crossed end of file) is finished with pread.
    for (size_t i = 0; i < n; ++i) {
      if (reqs[i].result >= 0 && static_cast<uint64_t>(reqs[i].result) < reqs[i].length)
        reqs[i].result = PreadFully(reqs[i]);
    }
    return Status::OK();
  }

 private:
  uint32_t depth_;
};

// pread on the calling thread, one request after another.
class CallerReader : public BlockReader {
 public:
  const char* name() const override { return "pread"; }
  Status ReadAll(ReadRequest* reqs, size_t n) override {
    for (size_t i = 0; i < n; ++i) reqs[i].result = PreadFully(reqs[i]);
    return Status::OK();
  }
};

// A fixed pool of pread workers; each call spreads its requests over them.
class ThreadPoolReader : public BlockReader {
 public:
  explicit ThreadPoolReader(uint32_t threads) {
    try {
      for (uint32_t t = 0; t < threads; ++t) workers_.emplace_back([this] { Work(); });
    } catch (...) {
      Stop();  // join the workers that did start before the caller sees the error
      throw;
    }
  }
  ~ThreadPoolReader() override { Stop(); }

  void Stop() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }
  const char* name() const override { return "threads"; }

  Status ReadAll(ReadRequest* reqs, size_t n) override {
    if (n == 0) return Status::OK();
    Job job;
    job.reqs = reqs;
    job.n = n;
    {
      MutexLock lock(&mu_);
      jobs_.push_back(&job);
    }
    wake_.notify_all();
    // The caller works too, then waits until no worker still holds the job.
    size_t mine = RunJob(&job);
    MutexLock lock(&mu_);
    job.finished += mine;
    while (!(job.finished == job.n && job.active == 0)) job_done_.wait(lock.native());
    for (size_t k = 0; k < jobs_.size(); ++k) {
      if (jobs_[k] == &job) {
        jobs_.erase(jobs_.begin() + static_cast<long>(k));
        break;
      }
    }
    return Status::OK();
  }

 private:
  struct Job {
    ReadRequest* reqs = nullptr;
    size_t n = 0;
    std::atomic<size_t> next{0};
    size_t finished = 0;  // guarded by mu_
    int active = 0;       // workers inside RunJob, guarded by mu_
  };

  static size_t RunJob(Job* job) {
    size_t mine = 0;
    while (true) {
      size_t i = job->next.fetch_add(1);
      if (i >= job->n) break;
      job->reqs[i].result = PreadFully(job->reqs[i]);
      ++mine;
    }
    return mine;
  }

  void Work() {
    NameThisThread("mlkv-pread");
    MutexLock lock(&mu_);
    while (true) {
      while (!stopping_ && !HasWork()) wake_.wait(lock.native());
      if (stopping_) return;
      Job* job = nullptr;
      for (Job* j : jobs_) {
        if (j->next.load() < j->n) {
          job = j;
          break;
        }
      }
      if (!job) continue;
      ++job->active;
      lock.Unlock();
      size_t mine = RunJob(job);
      lock.Lock();
      job->finished += mine;
      --job->active;
      if (job->finished == job->n && job->active == 0) job_done_.notify_all();
    }
  }

  bool HasWork() const REQUIRES(mu_) {
    for (Job* j : jobs_) {
      if (j->next.load() < j->n) return true;
    }
    return false;
  }

  Mutex mu_;
  std::condition_variable wake_, job_done_;  // with mu_
  std::vector<Job*> jobs_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// A ThreadPoolReader shared by every store of the process that asks for the same number of
// workers: the threads per process do not grow with the number of tables. Its ReadAll serves
// several callers at once (one job each).
class SharedPoolReader : public BlockReader {
 public:
  explicit SharedPoolReader(std::shared_ptr<ThreadPoolReader> pool) : pool_(std::move(pool)) {}
  Status ReadAll(ReadRequest* reqs, size_t n) override { return pool_->ReadAll(reqs, n); }
  const char* name() const override { return "threads"; }

  static std::shared_ptr<ThreadPoolReader> PoolOf(uint32_t threads) {
    static Mutex mu;  // guards pools
    static std::map<uint32_t, std::weak_ptr<ThreadPoolReader>> pools;
    MutexLock lock(&mu);
    std::shared_ptr<ThreadPoolReader> pool = pools[threads].lock();
    if (!pool) {
      pool = std::make_shared<ThreadPoolReader>(threads);
      pools[threads] = pool;
    }
    return pool;
  }

 private:
  std::shared_ptr<ThreadPoolReader> pool_;
};

}  // namespace

// io_uring_setup working is not enough: IORING_OP_READ needs Linux 5.6, so
// one real read of /dev/zero proves the engine usable.
bool UringAvailable() {
  static const bool available = [] {
    UringRing probe;
    if (!probe.Init(4).ok()) return false;
    int fd = open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    uint8_t byte[8];
    ReadRequest req;
    req.fd = fd;
    req.length = sizeof(byte);
    req.buffer = byte;
    req.result = -1;
    Status st = probe.ReadAll(&req, 1, 1);
    close(fd);
    return st.ok() && req.result == static_cast<int64_t>(sizeof(byte));
  }();
  return available;
}

bool InMemoryFileSystem(const std::string& path) {
  struct statfs fs;
  if (statfs(path.c_str(), &fs) != 0) return false;
  return fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC;
}

Status BlockReader::Create(IoEngine engine, uint32_t depth, uint32_t threads, bool in_memory,
                           std::shared_ptr<BlockReader>* out) {
  if (depth == 0 || depth > 4096)
    return Status::InvalidArgument("io_depth must be in [1, 4096], got " + std::to_string(depth));
  if (engine == IoEngine::kAuto) {
    engine = in_memory ? IoEngine::kPread : UringAvailable() ? IoEngine::kUring : IoEngine::kThreads;
  }
  if (engine == IoEngine::kUring && !UringAvailable())
    return Status::InvalidArgument("io_engine='uring' requested but this kernel refuses io_uring_setup");
  if (engine == IoEngine::kThreads && (threads == 0 || threads > 1024))
    return Status::InvalidArgument("io_threads must be in [1, 1024], got " + std::to_string(threads));
  // One reader per engine and setting, shared by the stores that ask for it: the lookups of several
  // stores (a batch's tables) then go to the disk together (RunReadRounds).
  static Mutex mu;  // guards readers
  static std::map<std::tuple<IoEngine, uint32_t, uint32_t>, std::weak_ptr<BlockReader>> readers;
  const auto setting =
      std::make_tuple(engine, engine == IoEngine::kUring ? depth : 0u, engine == IoEngine::kThreads ? threads : 0u);
  MutexLock lock(&mu);
  if ((*out = readers[setting].lock())) return Status::OK();
  if (engine == IoEngine::kPread) {
    out->reset(new CallerReader());
  } else if (engine == IoEngine::kUring) {
    out->reset(new UringReader(depth));
  } else {
    try {
      out->reset(new SharedPoolReader(SharedPoolReader::PoolOf(threads)));
    } catch (const std::exception& e) {
      return Status::IOError(std::string("starting ") + std::to_string(threads) + " I/O threads: " + e.what());
    }
  }
  readers[setting] = *out;
  return Status::OK();
}

}  // namespace mlkv
