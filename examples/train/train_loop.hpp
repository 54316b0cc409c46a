// The training loop of shmps-train, and the interface to where its
// gradients go: the parameter server (a worker process) or the optimizer
// applied in this process (--in-process, the ceiling). One thread at a time
// per UpdatePath and per loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "idx.hpp"
#include "mlp.hpp"
#include "shmps/status.hpp"

namespace shmps::train {

// `call()`, and once more where it found its server dead (kServerRestarted:
// not acknowledged); a Worker with reconnect re-attaches to the server's
// successor in the second call.
template <class Call>
auto again_after_restart(Call call) {
  auto result = call();
  if (!result.ok() && result.status().code() == ErrorCode::kServerRestarted) result = call();
  return result;
}

// Where the loop gets its weights and sends its gradients.
class UpdatePath {
 public:
  // What push_and_pull() came to: the push's result, then the pull's.
  struct Step {
    Result<uint64_t> pushed;
    Result<uint64_t> pulled;
  };

  virtual ~UpdatePath() = default;
  // Makes weights() current; returns their version (applied updates).
  virtual Result<uint64_t> pull() = 0;
  // Sends grad(), computed from weights() at `version`, then makes
  // weights() current, the pull seeing the push: one wait for both, so the
  // worker is woken once per step. kStale (too old, nothing applied) and
  // kServerRestarted (lost with a dead server) are retried by the loop on
  // the weights pulled; a pull that failed with kServerRestarted (or was
  // not sent: `pulled` then holds the push's error) is made again before
  // the next gradient; any other error ends the loop.
  virtual Step push_and_pull(uint64_t version) = 0;
  virtual const float* weights() const = 0;
  virtual float* grad() = 0;
};

// One training loop's share of the job.
struct WorkerPlan {
  size_t index = 0;  // 0..workers-1; takes examples index, index+workers, ...
  size_t workers = 1;
  size_t epochs = 1;
  size_t batch = 64;
  uint64_t seed = 1;
  std::string server_name;
};

// What one loop's pushes came to.
struct LoopCounts {
  uint64_t applied = 0;
  uint64_t rejected = 0;  // stale, retried
  uint64_t lost = 0;      // with a server that died (kServerRestarted), retried
};

// Examples of a shard of `count` (every workers-th from index), and the
// minibatches per epoch of a shard.
size_t shard_size(size_t count, size_t index, size_t workers);
size_t steps_per_epoch(size_t shard, size_t batch);

// Called after each applied push with the loop's applied count; false
// stops the loop (with an error).
using AfterApply = std::function<bool(uint64_t applied)>;

// Trains on the shard of `plan` (examples index, index+workers, ...,
// reshuffled every epoch from the worker's seed) for plan.epochs epochs:
// one pull first, then per minibatch the gradient and push_and_pull(); a
// stale push is counted and retried on the weights pulled with it, with the
// same minibatch, and so is one lost with a server that died (the Worker
// re-attaches to its successor).
// Counts go to `counts`. Returns the first error that is not retried.
Status train_shard(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, UpdatePath& path,
                   LoopCounts& counts, const AfterApply& after_apply);

}  // namespace shmps::train
