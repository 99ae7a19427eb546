// IdActivity: what the tables of a virtual (raw-id) kernel know of each id they were asked for,
// to filter ids seen too rarely and to evict ids gone cold: Monolith's frequency filter and
// expirable embeddings, under TorchRec's virtual-table eviction policies (count, timestamp, both).
//
// Per key (TableKey): how many batches looked it up (decayed at each eviction round, as FBGEMM's
// count-based eviction does), when it was last looked up (on a clock the caller keeps: training
// steps or wall seconds), and whether it holds a row (an id gets one at its `admit_after`-th
// batch; before that its lookups read zeros). Keys of tables without a policy are not tracked.
//
// Not thread-safe: its owner (one training thread) calls it between steps.
#pragma once

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "id_map.h"

namespace mlkv {

enum class EvictionRule : int { kNone = 0, kCount = 1, kTimestamp = 2, kCountAndTimestamp = 3 };
// The rules' names in EvictionRule's order: Python names a rule by them (`IdActivity.rules`).
inline constexpr std::array<const char*, 4> kEvictionRuleNames = {"none", "count", "timestamp", "count_and_timestamp"};

struct ActivityPolicy {
  bool tracked = false;
  int64_t admit_after = 1;    // batches an id is looked up in before it gets a row
  EvictionRule rule = EvictionRule::kNone;
  double count_threshold = 0;  // kCount: evicted when the decayed count is below it
  double decay_rate = 1;       // counts are multiplied by it at each eviction round
  int64_t ttl = 0;             // kTimestamp: evicted when last looked up more than ttl ago
  int64_t trigger_ids = 0;     // a round runs when more ids than this hold rows (0: only when asked)
  int64_t keep_ids = 0;        // after the rule, the weakest go until at most this many hold rows (0: no cap)
};

class IdActivity {
 public:
  explicit IdActivity(std::vector<ActivityPolicy> tables);
  // Records that a batch looked up the distinct `keys` at time `now`; returns which hold a row
  // (bool [n]; keys of untracked tables always do).
  torch::Tensor Observe(const torch::Tensor& keys, int64_t now);
  // Which of `keys` hold a row (keys of untracked tables always do), nothing recorded: what an
  // evaluation reads, which neither counts ids nor admits them.
  torch::Tensor Holds(const torch::Tensor& keys) const;
  // An eviction round of table `table` at time `now`: counts decayed, then the ids the rule
  // picks, then, while more than keep_ids hold rows, the weakest (lowest count, then least
  // recent). Returns (keys holding rows, keys without rows) picked; nothing is forgotten until
  // Forget.
  std::tuple<torch::Tensor, torch::Tensor> Pick(int64_t table, int64_t now);
  // Forgets `keys`: they no longer hold rows, and their counts start again.
  void Forget(const torch::Tensor& keys);
  // A cut's boundary: changes are followed from here (a restore is one too).
  void Mark();
  // Since the mark: the keys looked up that hold rows now, and the keys that held rows at the mark
  // and hold none now (each sorted): an incremental export's rows and tombstones. Both are bounded
  // by the ids holding rows, however many ids came and went between the marks.
  std::tuple<torch::Tensor, torch::Tensor> Changes() const;
  // Whether table `table` has more ids holding rows than its trigger.
  bool Due(int64_t table) const;
  int64_t live(int64_t table) const { return live_[static_cast<size_t>(table)]; }
  int64_t tracked() const { return static_cast<int64_t>(keys_.size()); }
  // Host bytes per tracked id (the memory budget counts them).
  static int64_t BytesPerId();
  // Every tracked key: (keys, counts float32, last looked up, holds a row), in no order, and its
  // inverse (an owner saves and restores the state with a cut).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> State() const;
  void Restore(const torch::Tensor& keys, const torch::Tensor& counts, const torch::Tensor& last,
               const torch::Tensor& holds_row);

 private:
  const ActivityPolicy& PolicyOf(int64_t key) const;
  void Erase(int64_t key);

  std::vector<ActivityPolicy> tables_;
  IdMap index_;  // key -> position in the vectors below
  std::vector<int64_t> keys_;
  std::vector<float> counts_;
  std::vector<int64_t> last_;
  std::vector<uint8_t> holds_row_;
  std::vector<uint8_t> since_mark_;  // kLookedUpSinceMark | kHeldAtMark
  std::vector<int64_t> gone_;        // keys forgotten since the mark that held rows at it
  std::vector<int64_t> live_;  // per table: ids holding rows
};

}  // namespace mlkv
