#include "worker_process.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "options.hpp"
#include "shmps/worker.hpp"
#include "stop_signals.hpp"
#include "train_loop.hpp"

namespace shmps::train {

SharedSlots::SharedSlots(size_t n) : n_(n) {
  void* p = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
  base_ = p;
  gate_ = new (p) StartGate();
  slots_ = reinterpret_cast<WorkerSlot*>(static_cast<char*>(p) + sizeof(StartGate));
  for (size_t i = 0; i < n_; ++i) new (&slots_[i]) WorkerSlot();
}

SharedSlots::~SharedSlots() { ::munmap(base_, bytes()); }

namespace {

// Pull and push through a shmps-server: one registered buffer holds the
// pulled weights, then the gradient pushed from them.
class ServerPath final : public UpdatePath {
 public:
  ServerPath(Worker& w, const Buffer& buffer, size_t params)
      : w_(w), buffer_(buffer), range_bytes_(params * sizeof(float)), params_(params) {}
  Result<uint64_t> pull() override { return w_.pull(kAllTensors, buffer_.id, 0); }
  // The pull follows the push in the lane, so the server serves both in
  // one go and the worker waits once (worker.hpp, push_async). The two use
  // different halves of the buffer: the pull may be written while the push
  // is still in flight.
  Step push_and_pull(uint64_t version) override {
    Result<Worker::Ticket> ticket =
        w_.push_async(kAllTensors, buffer_.id, range_bytes_, range_bytes_, Dtype::kF32, version);
    if (!ticket.ok()) return {ticket.status(), ticket.status()};
    Result<uint64_t> pulled = pull();
    return {w_.wait(*ticket), std::move(pulled)};
  }
  const float* weights() const override { return static_cast<const float*>(buffer_.data); }
  float* grad() override { return static_cast<float*>(buffer_.data) + params_; }

 private:
  Worker& w_;
  Buffer buffer_;
  uint64_t range_bytes_;
  size_t params_;
};

// The body of one worker process; returns its exit code.
int run_worker(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, StartGate& gate, WorkerSlot& slot) {
  const std::string who = "shmps-train worker " + std::to_string(plan.index) + ": ";
  // The parent's handlers only set its stop flag: a worker ends on these
  // as the job was started to (Ctrl-C reaches the whole group).
  restore_stop_signals();
  set_blas_threads(1);
  WorkerOptions options;
  options.name = plan.server_name;
  options.reconnect = true;
  Result<std::unique_ptr<Worker>> connected = Worker::connect(options);
  if (!connected.ok()) {
    std::cerr << who << "connect: " << connected.status().to_string() << "\n";
    return kExitFailure;
  }
  Worker& w = **connected;
  slot.worker_id.store(w.worker_id(), std::memory_order_relaxed);  // read after waitpid
  const size_t params = mlp_parameter_count(shape);
  Result<Buffer> buffer = again_after_restart([&] { return w.register_buffer(2 * params * sizeof(float)); });
  if (!buffer.ok()) {
    std::cerr << who << "register_buffer: " << buffer.status().to_string() << "\n";
    return kExitFailure;
  }
  ServerPath path(w, *buffer, params);

  // SYNC(start_gate): nothing is published through it; acquire for symmetry.
  while (gate.open.load(std::memory_order_acquire) == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  LoopCounts counts;
  if (Status s = train_shard(plan, train, shape, path, counts, nullptr); !s.ok()) {
    std::cerr << who << s.message() << "\n";
    return kExitFailure;
  }
  // Relaxed: read after waitpid.
  slot.pushes_applied.store(counts.applied, std::memory_order_relaxed);
  slot.pushes_rejected.store(counts.rejected, std::memory_order_relaxed);
  slot.pushes_lost.store(counts.lost, std::memory_order_relaxed);
  Result<ServerStats> stats = again_after_restart([&] { return w.stats(); });
  if (!stats.ok()) {
    std::cerr << who << "stats: " << stats.status().to_string() << "\n";
    return kExitFailure;
  }
  slot.server_applied.store(stats->my_pushes_applied, std::memory_order_relaxed);  // read after waitpid
  slot.generation.store(w.generation(), std::memory_order_relaxed);
  slot.server_rejected.store(stats->my_pushes_rejected, std::memory_order_relaxed);
  if (Status s = w.detach(); !s.ok()) {
    std::cerr << who << "detach: " << s.to_string() << "\n";
    return kExitFailure;
  }
  return 0;
}

}  // namespace

Result<Child> fork_worker(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, StartGate& gate,
                          WorkerSlot& slot) {
  // The child _exits: the parent's objects (its Worker, the server child)
  // are not its to destroy; it dies with the parent.
  auto child = ChildProcess::fork_run(
      [&]() -> int {
        try {
          return run_worker(plan, train, shape, gate, slot);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "shmps-train worker %zu: %s\n", plan.index, e.what());
          return kExitFailure;
        }
      },
      /*die_with_parent=*/true);
  if (!child.ok()) return child.status();
  return Child(std::move(child).value());
}

}  // namespace shmps::train
