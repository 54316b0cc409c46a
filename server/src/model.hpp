// The model as the server's consumer thread keeps it: the tensor table (a
// private copy, never re-read from shared memory), PyTorch's step count per
// tensor, the version, the staleness of the last applied pushes and who
// initialised the weights. The weights and optimizer state themselves are
// the backend's. Consumer thread only (and Server::create() before it).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "shmps/server/config.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

// The mean staleness of the last kSize applied pushes.
class StalenessWindow {
 public:
  static constexpr size_t kSize = 128;
  // Adds one push's staleness; returns the mean over the window in
  // millionths (what StatsBlock::avg_staleness_micro holds). A constant
  // divisor once the window is full: a multiply, not a 64-bit division, on
  // every push.
  uint64_t record(uint64_t staleness) {
    const size_t pos = count_ % kSize;
    if (count_ >= kSize) sum_ -= window_[pos];
    window_[pos] = staleness;
    sum_ += staleness;
    ++count_;
    return count_ >= kSize ? sum_ * 1'000'000 / kSize : sum_ * 1'000'000 / count_;
  }

 private:
  std::array<uint64_t, kSize> window_{};
  uint64_t count_ = 0;
  uint64_t sum_ = 0;
};

struct Model {
  std::vector<shm::TensorDesc> tensors;
  uint64_t total_elements = 0;
  std::vector<uint64_t> steps;  // per tensor, PyTorch's step count
  uint64_t version = 0;         // applied pushes (or the restored checkpoint's)
  // Changes of the weights that leave the version alone: a merged
  // federation round, an init, an update cut short (a device error, a
  // buffer truncated under --allow-nonfinite). Checkpoints count them.
  uint64_t unversioned_changes = 0;
  // Federation rounds merged into the weights, the join's included: from
  // the first, the weights are the group's (an init is refused).
  uint64_t rounds_merged = 0;
  // A join's snapshot was taken and the join not abandoned: its merge
  // keeps what W holds beyond the snapshot, so an init accepted before it
  // would be averaged into every host's weights by the rounds; an init is
  // refused from then on, as after a merge.
  bool federation_joining = false;
  void merged(uint64_t rounds) {
    rounds_merged += rounds;
    unversioned_changes += rounds;
  }
  // Who set the weights an init would replace: "worker 2 (pid 4711)" once
  // a worker's init was accepted, or the checkpoint whose federation state
  // a federated server restored.
  std::string initialised_by;
  StalenessWindow staleness;
};

// The weights --init asks for: N(0, scale) or U(-scale, scale) from a
// seeded mt19937_64, or the raw fp32 of --init-file, given to `sink` in
// order, a chunk at a time, so the server never holds a host copy of the
// model (on the CUDA backend the weights live on the device only). Zeros
// give nothing: a backend's arrays start at zero. Errors: the file's (kIo,
// kInvalidArgument), the sink's.
Status initial_weights(const InitSpec& init, uint64_t total, const WeightsSink& sink);

}  // namespace shmps::server
