// EmbeddingCache's read-ahead: ReadAhead (Python's lookahead) queues the keys of future batches, the read-ahead thread
// reads them from the stores into the staging area, and a fetch waits for a read-ahead in flight
// rather than reading its rows twice (see embedding_cache.h).
#include <algorithm>
#include <chrono>

#include "embedding_cache.h"
#include "engine/thread_name.h"

namespace mlkv {

namespace {

// Rows of a fetch a read-ahead request may read before the fetch waits for it rather than reading
// them itself.
constexpr int64_t kReadItselfRows = 64;

}  // namespace

void EmbeddingCache::ReadAhead(const torch::Tensor& ids) {
  CheckIds(ids);
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> outside;
  {
    MutexLock lock(&mu_);
    ThrowIfFailed();
    int32_t sequence;
    {
      MutexLock queue_lock(&read_ahead_mu_);
      sequence = read_ahead_requested_ + 1;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (slot_index_.Find(id[i]) >= 0 || staging_.Contains(id[i]) || reading_ahead_.Find(id[i]) >= 0 ||
          BufferedRow(id[i]) != nullptr) {
        continue;
      }
      reading_ahead_.Insert(id[i], sequence);
      outside.push_back(id[i]);
    }
    if (outside.empty()) return;
    // Queued under mu_ too, so requests reach the read-ahead thread in sequence order.
    MutexLock queue_lock(&read_ahead_mu_);
    read_ahead_requested_ = sequence;
    read_ahead_queue_.push_back({sequence, std::move(outside), std::chrono::steady_clock::now()});
  }
  read_ahead_cv_.notify_one();
}

void EmbeddingCache::ReadAheadLoop() {
  NameThisThread("mlkv-prefetch");
  for (;;) {
    ReadAheadRequest request;
    {
      MutexLock lock(&read_ahead_mu_);
      while (!read_ahead_stopping_ && read_ahead_queue_.empty()) read_ahead_cv_.wait(lock.native());
      if (read_ahead_stopping_) return;
      request = std::move(read_ahead_queue_.front());
      read_ahead_queue_.pop_front();
    }
    const std::vector<int64_t>& ids = request.ids;
    {
      MutexLock lock(&mu_);
      ++reads_in_flight_;
    }
    std::vector<float> rows;
    bool read_ok = true;
    try {
      rows.resize(ids.size() * static_cast<size_t>(row_words_));
      std::unique_ptr<bool[]> fresh(new bool[ids.size()]);
      ReadFromStore(ids.data(), ids.size(), rows.data(), fresh.get());
    } catch (const std::exception&) {
      read_ok = false;  // the fetch that needs these rows reads them itself and meets the error
    }
    {
      MutexLock lock(&mu_);
      for (size_t i = 0; i < ids.size(); ++i) {
        // A row a fetch took over (WaitForReadAheads) or a later request holds is not this one's to stage.
        if (reading_ahead_.Find(ids[i]) != request.sequence) continue;
        reading_ahead_.Erase(ids[i]);
        // A row written since the read began (now waiting to be written, or written) is newer than the read.
        if (!read_ok || written_during_reads_.Find(ids[i]) >= 0 || BufferedRow(ids[i]) != nullptr ||
            slot_index_.Find(ids[i]) >= 0 || staging_.Contains(ids[i])) {
          continue;
        }
        if (staging_.Stage(ids[i], &rows[i * row_words_], /*read_ahead=*/true, policy_.fetch_epoch())) {
          ++stats_.lookahead_rows;
        } else {
          ++stats_.lookahead_dropped;
        }
      }
      EndRead();
    }
    {
      MutexLock lock(&read_ahead_mu_);
      read_ahead_done_ = request.sequence;
      const double latency_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - request.queued).count();
      read_ahead_latency_us_ =
          read_ahead_latency_us_ == 0 ? latency_us : 0.7 * read_ahead_latency_us_ + 0.3 * latency_us;
    }
    read_ahead_done_cv_.notify_all();
  }
}

void EmbeddingCache::WaitForReadAheads(const int64_t* ids, int64_t n) {
  int32_t needed = 0;
  {
    MutexLock lock(&mu_);
    if (reading_ahead_.size() == 0) return;
    // Requests complete in order: the fetch waits for the newest one that reads many of its rows.
    // A later one reading only a few (the next batch's look-ahead, queued just before this fetch,
    // holds the rows of this batch that were written back meanwhile) would hold it up for a whole
    // request: the fetch reads those rows itself, and takes them from reading_ahead_ (ReadAheadLoop
    // stages only rows its request still holds, so never over what the fetch brought in).
    std::vector<std::pair<int32_t, int64_t>> rows_of;  // request -> rows of this fetch it reads
    for (int64_t i = 0; i < n; ++i) {
      const int32_t sequence = reading_ahead_.Find(ids[i]);
      if (sequence <= 0) continue;
      auto it = std::find_if(rows_of.begin(), rows_of.end(), [&](const auto& r) { return r.first == sequence; });
      if (it == rows_of.end()) {
        rows_of.emplace_back(sequence, 1);
      } else {
        ++it->second;
      }
    }
    for (const auto& [sequence, rows] : rows_of) {
      if (rows >= kReadItselfRows) needed = std::max(needed, sequence);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (reading_ahead_.Find(ids[i]) > needed) reading_ahead_.Erase(ids[i]);
    }
  }
  if (needed <= 0) return;
  const auto start = std::chrono::steady_clock::now();
  MutexLock lock(&read_ahead_mu_);
  while (read_ahead_done_ < needed && !read_ahead_stopping_) read_ahead_done_cv_.wait(lock.native());
  read_ahead_wait_us_ +=
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace mlkv
