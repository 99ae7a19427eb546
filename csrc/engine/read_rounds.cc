#include "read_rounds.h"

#include <algorithm>

namespace mlkv {

Status RunReadRounds(const std::vector<RoundedLookup*>& lookups) {
  struct Asked {
    size_t first = 0, n = 0;  // its reads in the round's requests
    bool done = false;
  };
  std::vector<Asked> asked(lookups.size());
  std::vector<ReadRequest> requests, wants;
  std::vector<ReadRequest> results;  // the last round's, by lookup in `asked` order
  for (;;) {
    results.swap(requests);
    requests.clear();
    bool any = false;
    for (size_t l = 0; l < lookups.size(); ++l) {
      Asked& a = asked[l];
      if (a.done) continue;
      wants.clear();
      const size_t room = kMaxReadsPerRound - std::min(kMaxReadsPerRound, requests.size());
      MLKV_RETURN_IF_ERROR(lookups[l]->Next(results.data() + a.first, a.n, room, &wants, &a.done));
      if (wants.size() > room) return Status::IOError("a lookup asked for more reads than a round holds");
      a.first = requests.size();
      a.n = wants.size();
      requests.insert(requests.end(), wants.begin(), wants.end());
      any = any || !a.done;
    }
    if (!any) return Status::OK();
    if (requests.empty()) return Status::IOError("a lookup that is not done asked for no reads");
    // Each reader's reads in one call, in the order asked.
    std::vector<bool> sent(lookups.size(), false);
    std::vector<ReadRequest> batch;
    for (size_t l = 0; l < lookups.size(); ++l) {
      if (sent[l] || asked[l].n == 0) continue;
      BlockReader* reader = lookups[l]->reader();
      std::vector<size_t> members;
      batch.clear();
      for (size_t m = l; m < lookups.size(); ++m) {
        if (sent[m] || asked[m].n == 0 || lookups[m]->reader() != reader) continue;
        sent[m] = true;
        members.push_back(m);
        batch.insert(batch.end(), requests.begin() + asked[m].first, requests.begin() + asked[m].first + asked[m].n);
      }
      if (!reader) return Status::IOError("a lookup without a reader asked for reads");
      MLKV_RETURN_IF_ERROR(reader->ReadAll(batch.data(), batch.size()));
      size_t pos = 0;
      for (size_t m : members) {
        std::copy(batch.begin() + pos, batch.begin() + pos + asked[m].n, requests.begin() + asked[m].first);
        pos += asked[m].n;
      }
    }
  }
}

}  // namespace mlkv
