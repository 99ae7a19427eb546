// Torch-free tests of BaseRun (csrc/engine/base_run.h), built and run under AddressSanitizer and
// ThreadSanitizer by scripts/sanitize.sh: runs written and read back against std::map, a block
// per key read once, the cursor's order, and damaged files refused by name.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tests/expect.h"
#include "engine/base_run.h"

using mlkv::BaseRun;
using mlkv::BaseRunWriter;
using mlkv::Status;

namespace {

int passed = 0;

std::vector<uint8_t> ValueOf(int64_t key, uint32_t value_bytes) {
  std::vector<uint8_t> v(value_bytes);
  for (uint32_t i = 0; i < value_bytes; ++i) v[i] = static_cast<uint8_t>(key * 31 + i * 7);
  return v;
}

// Writes the keys (sorted) as a run; returns the model.
std::map<int64_t, std::vector<uint8_t>> WriteRun(const std::string& path, const std::vector<int64_t>& keys,
                                                 uint32_t value_bytes) {
  std::unique_ptr<BaseRunWriter> writer;
  Status st = BaseRunWriter::Create(path, value_bytes, 1, &writer);
  EXPECT(st.ok(), "create: %s", st.ToString().c_str());
  std::map<int64_t, std::vector<uint8_t>> model;
  for (int64_t key : keys) {
    model[key] = ValueOf(key, value_bytes);
    st = writer->Add(key, model[key].data());
    EXPECT(st.ok(), "add %lld: %s", static_cast<long long>(key), st.ToString().c_str());
  }
  st = writer->Finish();
  EXPECT(st.ok(), "finish: %s", st.ToString().c_str());
  return model;
}

std::unique_ptr<mlkv::BlockReader> Reader() {
  std::unique_ptr<mlkv::BlockReader> reader;
  Status st = mlkv::BlockReader::Create(mlkv::IoEngine::kThreads, 16, 4, false, &reader);
  if (!st.ok()) std::exit(2);
  return reader;
}

// Every key, and keys around them, looked up against the model; the cursor gives every row in order.
void ReadBackTest(const std::string& dir, uint32_t value_bytes, size_t rows, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> keys;
  int64_t key = static_cast<int64_t>(rng() % 5);
  for (size_t i = 0; i < rows; ++i, key += 1 + static_cast<int64_t>(rng() % 3)) keys.push_back(key);
  const std::string path = dir + "/run-" + std::to_string(value_bytes) + ".run";
  auto model = WriteRun(path, keys, value_bytes);
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  EXPECT(run->rows() == rows, "rows %llu", static_cast<unsigned long long>(run->rows()));
  std::vector<int64_t> probes;
  for (int64_t k = 0; k <= key + 2; ++k) probes.push_back(k);
  std::shuffle(probes.begin(), probes.end(), rng);
  probes.push_back(probes.front());  // a key asked twice
  std::vector<uint8_t> out(probes.size() * value_bytes);
  std::unique_ptr<bool[]> found(new bool[probes.size()]);
  auto reader = Reader();
  uint64_t blocks_read = 0;
  st = run->Lookup(probes.data(), probes.size(), out.data(), found.get(), reader.get(), &blocks_read);
  EXPECT(st.ok(), "lookup: %s", st.ToString().c_str());
  size_t wrong = 0;
  for (size_t i = 0; i < probes.size(); ++i) {
    auto it = model.find(probes[i]);
    const bool in_model = it != model.end();
    if (found[i] != in_model ||
        (in_model && std::memcmp(out.data() + i * value_bytes, it->second.data(), value_bytes) != 0)) {
      ++wrong;
    }
  }
  EXPECT(wrong == 0, "%zu of %zu lookups wrong", wrong, probes.size());
  size_t wrong_presence = 0;  // what the fences tell never contradicts the rows
  for (int64_t probe : probes) {
    const BaseRun::Presence p = run->PresenceOf(probe);
    if ((p == BaseRun::Presence::kPresent && !model.count(probe)) ||
        (p == BaseRun::Presence::kAbsent && model.count(probe))) {
      ++wrong_presence;
    }
  }
  EXPECT(wrong_presence == 0, "%zu presences wrong", wrong_presence);
  EXPECT(blocks_read == run->blocks(), "read %llu blocks for %llu: each once",
         static_cast<unsigned long long>(blocks_read), static_cast<unsigned long long>(run->blocks()));
  BaseRun::Cursor cursor(*run);
  std::vector<int64_t> scanned;
  std::vector<uint8_t> values;
  for (bool more = true; more;) {
    st = cursor.Next(&scanned, &values, &more);
    EXPECT(st.ok(), "cursor: %s", st.ToString().c_str());
    if (!st.ok()) break;
  }
  EXPECT(scanned == keys, "the cursor gave %zu rows for %zu", scanned.size(), keys.size());
  bool values_match = values.size() == keys.size() * value_bytes;
  for (size_t i = 0; values_match && i < keys.size(); ++i) {
    values_match = std::memcmp(values.data() + i * value_bytes, model[keys[i]].data(), value_bytes) == 0;
  }
  EXPECT(values_match, "cursor values");
  ++passed;
}

// A run of every key in a range (a table written in full) tells each key present from its fences
// alone; one gap makes its block's keys unknown, and only those.
void GaplessTest(const std::string& dir) {
  std::vector<int64_t> keys;
  for (int64_t k = 100; k < 5100; ++k) keys.push_back(k);
  const std::string path = dir + "/gapless.run";
  WriteRun(path, keys, 32);
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, 32, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  size_t present = 0;
  for (int64_t k = 100; k < 5100; ++k) present += run->PresenceOf(k) == BaseRun::Presence::kPresent;
  EXPECT(present == keys.size(), "%zu of %zu present", present, keys.size());
  EXPECT(run->PresenceOf(99) == BaseRun::Presence::kAbsent && run->PresenceOf(5100) == BaseRun::Presence::kAbsent,
         "keys outside the range");
  keys.erase(keys.begin() + 1000);  // key 1100 missing
  WriteRun(path, keys, 32);
  st = BaseRun::Open(path, 32, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  size_t maybe = 0;
  for (int64_t k = 100; k < 5100; ++k) maybe += run->PresenceOf(k) == BaseRun::Presence::kMaybe;
  const size_t rows_per_block = (4096 - 16) / (8 + 32);
  EXPECT(maybe > 0 && maybe < rows_per_block + 1, "%zu keys unknown: those of the block with the gap", maybe);
  ++passed;
}

void EmptyAndOrderTest(const std::string& dir) {
  const std::string path = dir + "/empty.run";
  WriteRun(path, {}, 12);
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, 12, 1, true, &run);
  EXPECT(st.ok() && run->rows() == 0 && run->blocks() == 0, "empty run: %s", st.ToString().c_str());
  if (st.ok()) {
    int64_t k = 7;
    uint8_t out[12];
    bool found = true;
    auto reader = Reader();
    st = run->Lookup(&k, 1, out, &found, reader.get());
    EXPECT(st.ok() && !found, "lookup in an empty run");
  }
  std::unique_ptr<BaseRunWriter> writer;
  st = BaseRunWriter::Create(dir + "/order.run", 12, 1, &writer);
  uint8_t value[12] = {};
  st = writer->Add(5, value);
  EXPECT(st.ok(), "first add");
  st = writer->Add(5, value);
  EXPECT(st.code() == Status::Code::kInvalidArgument, "a repeated key: %s", st.ToString().c_str());
  st = BaseRun::Open(dir + "/order.run", 12, 1, true, &run);  // never finished: not a run
  EXPECT(st.code() == Status::Code::kCorruption, "an unfinished run: %s", st.ToString().c_str());
  st = BaseRun::Open(path, 12, 2, true, &run);
  EXPECT(st.code() == Status::Code::kCorruption, "another run's number: %s", st.ToString().c_str());
  st = BaseRun::Open(path, 16, 1, true, &run);
  EXPECT(st.code() == Status::Code::kInvalidArgument, "other row width: %s", st.ToString().c_str());
  ++passed;
}

void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = open(path.c_str(), O_RDWR);
  uint8_t b = 0;
  if (pread(fd, &b, 1, static_cast<off_t>(offset)) != 1) std::exit(2);
  b ^= 0x40;
  if (pwrite(fd, &b, 1, static_cast<off_t>(offset)) != 1) std::exit(2);
  close(fd);
}

// A flipped byte in a block fails the lookups that read it, naming the block; the fences' and the
// trailer's fail the open; a truncated file too.
void DamageTest(const std::string& dir) {
  const uint32_t value_bytes = 64;
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < 2000; ++k) keys.push_back(k * 2);
  const std::string path = dir + "/damaged.run";
  WriteRun(path, keys, value_bytes);
  FlipByte(path, 3 * 4096 + 100);  // inside block 3
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  auto reader = Reader();
  uint8_t out[64];
  bool found = false;
  int64_t fine = 0;
  st = run->Lookup(&fine, 1, out, &found, reader.get());
  EXPECT(st.ok() && found, "a key of an undamaged block: %s", st.ToString().c_str());
  const uint64_t rows_per_block = (4096 - 16) / (8 + value_bytes);
  int64_t in_block_3 = static_cast<int64_t>(3 * rows_per_block + 1) * 2;
  st = run->Lookup(&in_block_3, 1, out, &found, reader.get());
  EXPECT(st.code() == Status::Code::kCorruption && st.message().find("block 3") != std::string::npos &&
             st.message().find(path) != std::string::npos,
         "a key of the damaged block: %s", st.ToString().c_str());
  const uint64_t size = [&] {
    const int fd = open(path.c_str(), O_RDONLY);
    const off_t end = lseek(fd, 0, SEEK_END);
    close(fd);
    return static_cast<uint64_t>(end);
  }();
  FlipByte(path, size - 64 - 8);  // a fence
  st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.code() == Status::Code::kCorruption && st.message().find("fences") != std::string::npos,
         "damaged fences: %s", st.ToString().c_str());
  if (truncate(path.c_str(), static_cast<off_t>(size - 10)) != 0) std::exit(2);
  st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.code() == Status::Code::kCorruption, "a truncated run: %s", st.ToString().c_str());
  ++passed;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = argc > 1 ? argv[1] : "/tmp/mlkv-base-run-test";
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  ReadBackTest(dir, 68, 20000, 1);    // many rows a block
  ReadBackTest(dir, 5000, 300, 2);    // a row wider than 4 KiB: 8 KiB blocks
  ReadBackTest(dir, 4072, 100, 3);    // exactly one row a 4 KiB block
  GaplessTest(dir);
  EmptyAndOrderTest(dir);
  DamageTest(dir);
  std::printf("base_run: %d passed, %d failed\n", mlkv_test::Failures() == 0 ? passed : 0, mlkv_test::Failures());
  return mlkv_test::Failures() == 0 ? 0 : 1;
}
