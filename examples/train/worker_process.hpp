// shmps-train's worker processes: what each shares with the parent (its
// counters and the start gate, in an anonymous shared mapping made before
// fork), and fork_worker(), which starts one running the training loop
// against the server. Each slot has one writer (its worker); the parent
// reads a slot once its worker has exited.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "child.hpp"
#include "idx.hpp"
#include "mlp.hpp"
#include "shmps/status.hpp"
#include "train_loop.hpp"

namespace shmps::train {

struct alignas(64) WorkerSlot {
  // The worker's own counts (LoopCounts), stored once its loop is done;
  // relaxed: they order nothing, and the parent reads them after waitpid(),
  // which synchronises.
  std::atomic<uint64_t> pushes_applied{0};
  std::atomic<uint64_t> pushes_rejected{0};
  // This worker's counters as the server reports them (stats() at the end).
  std::atomic<uint64_t> server_applied{0};
  std::atomic<uint64_t> server_rejected{0};
  std::atomic<uint32_t> worker_id{0};
  // Pushes lost with a server that died (kServerRestarted), and the server
  // generation the worker ended on.
  std::atomic<uint64_t> pushes_lost{0};
  std::atomic<uint64_t> generation{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "counters shared across fork need lock-free atomics");

// The start gate: workers attach, then wait for it, so the parent scores the
// initial weights before the first push and times training alone.
struct alignas(64) StartGate {
  std::atomic<uint32_t> open{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the gate is shared across fork");

// The gate and one slot per worker, in one MAP_SHARED | MAP_ANONYMOUS
// mapping: make it before forking the workers.
class SharedSlots {
 public:
  // Throws std::runtime_error when mmap fails.
  explicit SharedSlots(size_t n);
  ~SharedSlots();
  SharedSlots(const SharedSlots&) = delete;
  SharedSlots& operator=(const SharedSlots&) = delete;
  WorkerSlot& operator[](size_t i) { return slots_[i]; }
  const WorkerSlot& operator[](size_t i) const { return slots_[i]; }
  StartGate& gate() { return *gate_; }

 private:
  size_t bytes() const { return sizeof(StartGate) + n_ * sizeof(WorkerSlot); }
  size_t n_;
  void* base_ = nullptr;
  StartGate* gate_ = nullptr;
  WorkerSlot* slots_ = nullptr;
};

// Forks worker plan.index: it attaches to plan.server_name, registers one
// buffer, waits for the gate, trains its shard through the server, stores
// its counts and the server's in `slot`, detaches and exits 0 (kExitFailure
// on an error, printed). The child gets SIGKILL when this process dies.
// Errors: kIo when fork fails.
Result<Child> fork_worker(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, StartGate& gate,
                          WorkerSlot& slot);

}  // namespace shmps::train
