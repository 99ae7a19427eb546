// Read rounds: the disk reads of several lookups (a store's log and base, many stores' tables) in
// shared rounds, every read of a round in flight at once, so a batch waits for the disk once, not
// once a part or a table.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "io_reader.h"
#include "status.h"

namespace mlkv {

// A lookup whose disk reads go in rounds: each round it takes the results of the reads it asked for
// in the one before and asks for its next, until it is done.
class RoundedLookup {
 public:
  virtual ~RoundedLookup() = default;
  // `results`: the `n` reads it asked for last round, in the order it asked, each with its result.
  // Appends the reads it wants next to *wants, at most `room` of them (it may be 0: the round is
  // full; it asks again next round), and sets *done once it wants no more. An error ends the rounds.
  virtual Status Next(const ReadRequest* results, size_t n, size_t room, std::vector<ReadRequest>* wants,
                      bool* done) = 0;
  // The reader its reads go through (null for a lookup that reads nothing in the rounds): lookups
  // with the same reader share its ReadAll.
  virtual BlockReader* reader() const = 0;
};

// Runs `lookups` until each is done, every round's reads of one reader in one ReadAll; a round holds
// at most kMaxReadsPerRound reads (so many buffers at once), the earlier lookups asking first.
constexpr size_t kMaxReadsPerRound = 4096;
Status RunReadRounds(const std::vector<RoundedLookup*>& lookups);

// A lookup of a store that reads nothing in the rounds: `lookup` runs whole at its first round.
template <typename Lookup>
class ImmediateLookup : public RoundedLookup {
 public:
  explicit ImmediateLookup(Lookup lookup) : lookup_(std::move(lookup)) {}
  Status Next(const ReadRequest*, size_t, size_t, std::vector<ReadRequest>*, bool* done) override {
    *done = true;
    return lookup_();
  }
  BlockReader* reader() const override { return nullptr; }

 private:
  Lookup lookup_;
};

}  // namespace mlkv
