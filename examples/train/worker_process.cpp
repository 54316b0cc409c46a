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
// weights slots, then the gradient slots, `params` floats each: one of
// each, or two of each for a pipelined loop (UpdatePath::begin_step).
class ServerPath final : public UpdatePath {
 public:
  static size_t buffer_bytes(size_t params, bool pipeline) { return (pipeline ? 4 : 2) * params * sizeof(float); }

  ServerPath(Worker& w, const Buffer& buffer, size_t params, bool pipeline)
      : w_(w), buffer_(buffer), slot_bytes_(params * sizeof(float)), slots_(pipeline ? 2 : 1) {}
  Result<uint64_t> pull() override { return w_.pull(kAllTensors, buffer_.id, weights_offset(weights_slot_)); }
  // The pull follows the push in the lane, so the server serves both in
  // one go and the worker waits once (worker.hpp, push_async). The two use
  // different slots of the buffer: the pull may be written while the push
  // is still in flight.
  Step push_and_pull(uint64_t version) override {
    Result<Worker::Ticket> ticket = push_async(version);
    if (!ticket.ok()) return {ticket.status(), ticket.status()};
    Result<uint64_t> pulled = pull();
    return {w_.wait(*ticket), std::move(pulled)};
  }
  Status begin_step(uint64_t version) override {
    Result<Worker::Ticket> ticket = push_async(version);
    if (!ticket.ok()) return ticket.status();
    push_ticket_ = *ticket;
    pull_ticket_ = w_.pull_async(kAllTensors, buffer_.id, weights_offset(weights_slot_ ^ 1));
    grad_slot_ ^= 1;
    return Status::Ok();
  }
  Step end_step() override {
    Result<uint64_t> pushed = w_.wait(push_ticket_);
    Result<uint64_t> pulled = pull_ticket_.ok() ? w_.wait(*pull_ticket_) : Result<uint64_t>(pull_ticket_.status());
    if (pulled.ok()) weights_slot_ ^= 1;
    return {std::move(pushed), std::move(pulled)};
  }
  const float* weights() const override { return slot(weights_offset(weights_slot_)); }
  float* grad() override { return slot(grad_offset(grad_slot_)); }

 private:
  Result<Worker::Ticket> push_async(uint64_t version) {
    return w_.push_async(kAllTensors, buffer_.id, grad_offset(grad_slot_), slot_bytes_, Dtype::kF32, version);
  }
  uint64_t weights_offset(size_t slot) const { return slot * slot_bytes_; }
  uint64_t grad_offset(size_t slot) const { return (slots_ + slot) * slot_bytes_; }
  float* slot(uint64_t offset) const { return reinterpret_cast<float*>(static_cast<char*>(buffer_.data) + offset); }

  Worker& w_;
  Buffer buffer_;
  uint64_t slot_bytes_;
  size_t slots_;  // of each kind
  size_t weights_slot_ = 0, grad_slot_ = 0;
  Worker::Ticket push_ticket_{};
  Result<Worker::Ticket> pull_ticket_ = Status(ErrorCode::kInternal, "no step in flight");
};

// The body of one worker process; returns its exit code.
int run_worker(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, StartGate& gate, WorkerSlot& slot) {
  const std::string who = "shmps-train worker " + std::to_string(plan.index) + ": ";
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
  Result<Buffer> buffer = w.register_buffer(ServerPath::buffer_bytes(params, plan.pipeline));
  if (!buffer.ok()) {
    std::cerr << who << "register_buffer: " << buffer.status().to_string() << "\n";
    return kExitFailure;
  }
  ServerPath path(w, *buffer, params, plan.pipeline);

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
  Result<ServerStats> stats = w.stats();
  if (!stats.ok() && stats.status().code() == ErrorCode::kServerRestarted) stats = w.stats();
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
