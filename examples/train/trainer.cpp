#include "trainer.hpp"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "in_process.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "stop_signals.hpp"
#include "train_loop.hpp"

namespace shmps::train {
namespace {

using Clock = std::chrono::steady_clock;

// The exit code of a job a signal stopped (stop_signals.hpp): 128 + its
// number, as a shell reports a process killed by it; main() then dies of
// it, after the cleanup.
int stopped_by_signal() {
  const int signo = stop_signal();
  std::cerr << "shmps-train: stopped by signal " << signo << " (" << strsignal(signo)
            << "); stopping the workers and the server\n";
  return 128 + signo;
}

// A counter's growth since `base`; 0 when it went below (a server
// restarted under the job counts from a checkpoint, or from 0, again).
uint64_t since(uint64_t now, uint64_t base) { return now > base ? now - base : 0; }

}  // namespace

Trainer::~Trainer() {
  // The buffer objects of the workers killed here: a server that stopped
  // first (a signal to the whole process group) swept only the workers
  // dead by then. Only a pid no process has taken again.
  const std::string server_name = o_.connect.empty() ? o_.name : o_.connect;
  for (Child& c : workers_) {
    if (!c.running()) continue;
    c.kill_and_reap();
    if (!shm::pid_in_use(c.pid()))
      for (const shm::OrphanBuffer& b : shm::orphan_buffers(server_name, c.pid()))
        shm::ShmObject::remove(b.object_name);
  }
  eval_.reset();
  server_.reset();  // stops it, removes its files
}

int Trainer::run() {
  if (!csv_writable(o_.csv)) return kExitFailure;
  if (int rc = load_data(); rc != 0) return rc;
  if (o_.in_process) return run_in_process(o_, shape_, train_, test_);
  // From here a signal ends the job through the destructor: temp files,
  // workers and the server are cleaned up (stop_signals.hpp). Workers take
  // their former dispositions again (run_worker()); the server execs,
  // which resets caught ones.
  catch_stop_signals();
  const std::string server_name = o_.connect.empty() ? o_.name : o_.connect;
  if (int rc = attach(server_name); rc != 0) return rc;
  if (stop_signal() != 0) return stopped_by_signal();
  if (o_.evaluate) {
    Curve curve(shape_, train_, test_, /*per_epoch=*/1, /*defer=*/false);
    if (!take(curve)) return failed();
    if (stop_signal() != 0) return stopped_by_signal();
    std::printf("final test accuracy: %.4f (the weights of server '%s', nothing trained)\n",
                curve.final_test_accuracy(), server_name.c_str());
    return 0;
  }

  // Applied pushes per epoch: every worker's minibatches of its shard.
  uint64_t per_epoch = 0;
  for (size_t i = 0; i < o_.workers; ++i)
    per_epoch += steps_per_epoch(shard_size(train_.count, i, o_.workers), o_.batch);
  const uint64_t total = per_epoch * o_.epochs;
  // --eval-every: snapshots are scored after training, so the parent's
  // evaluations take no CPU from the workers and elapsed_s is training time
  // alone.
  const EvalSchedule schedule{total,
                              per_epoch,
                              o_.epochs,
                              o_.evals_per_epoch,
                              o_.eval_every,
                              /*deferred=*/o_.eval_every != 0};
  if (!schedule.fits()) {
    std::cerr << "shmps-train: " << schedule.too_many() << "\n";
    return kExitUsage;
  }
  std::string setup =
      o_.optimizer + " lr " + format_double(o_.lr) + ", max_staleness " + std::to_string(o_.max_staleness);
  if (server_ == nullptr) setup = "the running server's optimizer and max_staleness";
  std::printf("shmps-train: server '%s', %zu workers, batch %zu, %s, %zu epochs of %llu pushes\n", server_name.c_str(),
              o_.workers, o_.batch, setup.c_str(), o_.epochs, static_cast<unsigned long long>(per_epoch));
  std::fflush(stdout);

  if (stop_signal() != 0) return stopped_by_signal();
  SharedSlots slots(o_.workers);
  if (int rc = fork_workers(server_name, slots); rc != 0) return rc;
  set_blas_threads(1);
  Curve curve(shape_, train_, test_, per_epoch, schedule.deferred);
  start_ = Clock::now();
  if (!take(curve)) return failed();
  // Training time runs from the gate on; the first point is its start.
  curve.mark_training_start();
  start_ = Clock::now();
  // SYNC(start_gate): see run_worker.
  slots.gate().open.store(1, std::memory_order_release);

  if (int rc = watch(schedule, curve); rc != 0) return rc;  // the destructor kills the rest
  if (stop_signal() != 0) return stopped_by_signal();
  const double train_s = std::chrono::duration<double>(Clock::now() - start_).count();
  // The last evaluation may have seen the final weights already.
  if (curve.last_recorded_version() != total && !take(curve)) return failed();

  Result<ServerStats> end = eval_->stats();
  if (!end.ok()) {
    return failed("stats", end.status());
  }
  rebase(*end);
  curve.score_deferred();
  if (stop_signal() != 0) return stopped_by_signal();
  const bool agree = counts_agree(slots, *end, total);
  std::printf("final test accuracy: %.4f (wall time %.1f s, %zu workers)\n", curve.final_test_accuracy(), train_s,
              o_.workers);
  std::fflush(stdout);

  if (!curve.write_csv(o_.csv)) return kExitFailure;
  if (int rc = stop_own_server(); rc != 0) return rc;
  return agree ? 0 : kExitFailure;
}

// Detaches the evaluation worker, then stops our own server (if any):
// returns 0, or kExitFailure when it failed. Its last act, the final
// checkpoint into the temp folder that the OwnServer removes next, is
// nobody's loss: its failure alone (exit 1 with one failure more counted,
// e.g. a full disk) is a warning.
int Trainer::stop_own_server() {
  std::optional<uint64_t> failures_before;
  if (server_ != nullptr) {
    note_checkpoint_failures(/*now=*/true);  // those of the run, before the final one's
    failures_before = counters_.checkpoint_failures(eval_->generation());
  }
  eval_.reset();  // detach before the server stops
  if (server_ == nullptr || server_->stop()) return 0;
  const std::optional<uint64_t> failures_after = counters_.mapped_checkpoint_failures();
  if (server_->status() == 1 && failures_before && failures_after && *failures_after > *failures_before) {
    std::cerr << "shmps-train: warning: shmps-server's final checkpoint into its temp folder failed (see its "
                 "message above); that folder is removed now anyway\n";
    return 0;
  }
  std::cerr << "shmps-train: shmps-server exited with status " << server_->status() << "\n";
  return kExitFailure;
}

// Warns once when the server fails to write a checkpoint: a restart would
// resume from an older one. Checks at most once a second, but `now` (the
// end of the run, so that a run shorter than that is checked too); call
// after a call of eval_ succeeded (checkpoint_failures()'s precondition).
void Trainer::note_checkpoint_failures(bool now) {
  if (failures_warned_ || (!now && Clock::now() < next_failures_check_)) return;
  next_failures_check_ = Clock::now() + std::chrono::seconds(1);
  const uint64_t generation = eval_->generation();
  if (generation != failures_generation_) {  // a restarted server counts from 0
    failures_generation_ = generation;
    failures_base_ = 0;
  }
  const std::optional<uint64_t> failures = counters_.checkpoint_failures(generation);
  if (!failures || *failures <= failures_base_) return;
  std::cerr << "shmps-train: warning: shmps-server failed to write " << (*failures - failures_base_)
            << " checkpoint(s) (its log says why): a restart would resume from an older one\n";
  failures_warned_ = true;
}

int Trainer::load_data() {
  const auto t0 = Clock::now();
  Result<Dataset> train = load_fashion_mnist(o_.data_dir, Split::kTrain, o_.train_limit);
  Result<Dataset> test = train.ok() ? load_fashion_mnist(o_.data_dir, Split::kTest, o_.test_limit) : train;
  if (!train.ok() || !test.ok()) {
    const Status& s = train.ok() ? test.status() : train.status();
    std::cerr << "shmps-train: " << s.message() << "\n";
    return kExitUsage;
  }
  train_ = o_.shard_count > 1 ? take_shard(*train, o_.shard_index, o_.shard_count) : std::move(*train);
  test_ = std::move(*test);
  if (train_.count < o_.workers) {
    std::cerr << "shmps-train: " << train_.count << " training images for " << o_.workers << " workers\n";
    return kExitUsage;
  }
  std::printf("shmps-train: %zu training and %zu test images from %s (%.1f s)\n", train_.count, test_.count,
              o_.data_dir.c_str(), std::chrono::duration<double>(Clock::now() - t0).count());
  return 0;
}

// Starts our own server (without --connect), attaches the evaluation
// worker, checks the server's tensors and weights, and reads its counters
// to start from.
int Trainer::attach(const std::string& server_name) {
  if (o_.connect.empty()) {
    server_ = std::make_unique<OwnServer>();
    if (int rc = server_->start(o_, shape_); rc != 0) return rc;
  }
  Result<std::unique_ptr<Worker>> eval = connect_with_retry(server_name, server_.get(), std::chrono::seconds(10));
  if (!eval.ok()) {
    return failed("connect to server '" + server_name + "'", eval.status());
  }
  eval_ = std::move(*eval);
  if (server_ != nullptr) server_->release_init_file();
  if (Status s = check_tensors(*eval_, shape_); !s.ok()) {
    std::cerr << "shmps-train: " << s.message() << "\n";
    return kExitFailure;
  }
  Result<Buffer> buffer =
      again_after_restart([&] { return eval_->register_buffer(mlp_parameter_count(shape_) * sizeof(float)); });
  if (!buffer.ok()) {
    std::cerr << "shmps-train: register_buffer: " << buffer.status().to_string() << "\n";
    return kExitFailure;
  }
  eval_buffer_ = *buffer;
  // A running server may hold all-zero weights (shmps-server's default
  // --init zero). From there every hidden ReLU unit outputs 0 for every
  // input, so no gradient reaches fc1 or fc2.weight and only fc2.bias moves:
  // the run would end at the class prior and exit 0. Our own server starts
  // from the He initialisation.
  if (server_ == nullptr) {
    Result<uint64_t> pulled = eval_->pull(kAllTensors, eval_buffer_.id, 0);
    if (!pulled.ok()) {
      return failed("pull", pulled.status());
    }
    const auto* w = static_cast<const float*>(eval_buffer_.data);
    if (std::all_of(w, w + mlp_parameter_count(shape_), [](float x) { return x == 0.0f; })) {
      std::cerr << "shmps-train: every weight of server '" << server_name << "' is zero (version " << *pulled
                << "): a ReLU MLP started from all-zero weights never learns (its hidden units stay 0, so no "
                   "gradient reaches the first layer). Start the server with random weights, e.g. --init normal "
                   "--init-scale 0.05, or --init-file PATH (raw fp32, all tensors in order)\n";
      return kExitUsage;
    }
  }
  Result<ServerStats> base = eval_->stats();
  if (!base.ok()) {
    return failed("stats", base.status());
  }
  base_generation_ = eval_->generation();
  counted_generation_ = base_generation_;
  failures_generation_ = base_generation_;
  failures_base_ = counters_.checkpoint_failures(base_generation_).value_or(0);
  base_version_ = base->version;
  base_rejected_ = base->rejected_stale;
  base_applied_ = base->gradients_applied;
  return 0;
}

// Forks the workers, before this process touches OpenBLAS.
int Trainer::fork_workers(const std::string& server_name, SharedSlots& slots) {
  for (size_t i = 0; i < o_.workers; ++i) {
    const WorkerPlan plan{i, o_.workers, o_.epochs, o_.batch, o_.seed, server_name};
    Result<Child> child = fork_worker(plan, train_, shape_, slots.gate(), slots[i]);
    if (!child.ok()) {
      std::cerr << "shmps-train: " << child.status().message() << "\n";
      return kExitFailure;
    }
    workers_.push_back(std::move(*child));
  }
  return 0;
}

// Until every worker has exited: reaps them, restarts a dead server of our
// own, and takes an evaluation each time the applied pushes pass the next
// point of `schedule`. Returns 0, or kExitFailure once a worker failed or
// the server is gone for good.
int Trainer::watch(const EvalSchedule& schedule, Curve& curve) {
  const uint64_t evals = schedule.count();
  uint64_t next_eval = 1;
  // Snapshots are cheap (a pull), so deferred scoring polls more often to
  // take each close to its point.
  const auto poll_every = std::chrono::milliseconds(curve.deferred() ? 5 : 20);
  size_t running = workers_.size();
  while (running > 0) {
    std::this_thread::sleep_for(poll_every);
    if (stop_signal() != 0) return stopped_by_signal();
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!workers_[i].running() || !workers_[i].poll()) continue;
      --running;
      if (workers_[i].status() != 0) {
        std::cerr << "shmps-train: worker " << i << " failed with status " << workers_[i].status() << "\n";
        return kExitFailure;
      }
    }
    if (server_ != nullptr && server_->poll()) {
      if (server_->status() != 0 && server_->restart()) continue;
      std::cerr << "shmps-train: shmps-server exited with status " << server_->status() << " during training";
      if (server_->status() != 0 && server_->restartable())
        std::cerr << "; gave up after " << server_->restarts() << " restarts";
      std::cerr << "\n";
      return kExitFailure;
    }
    Result<ServerStats> stats = eval_->stats();
    const ErrorCode code = stats.status().code();
    // The server died since poll(): the next round restarts it.
    if (code == ErrorCode::kServerRestarted ||
        (code == ErrorCode::kServerNotRunning && server_ != nullptr && server_->restartable()) ||
        (code == ErrorCode::kInterrupted && stop_signal() == 0 && own_server_exited()))
      continue;
    if (!stats.ok()) {
      return failed("stats", stats.status());
    }
    note_checkpoint_failures();
    rebase(*stats);
    const uint64_t progress = since(stats->version, base_version_);
    if (next_eval < evals && progress >= schedule.at(next_eval)) {
      if (!take(curve, /*during_training=*/true)) {
        if (stop_signal() == 0 && own_server_exited()) continue;  // the next round restarts it
        return failed();
      }
      // Skip boundaries passed meanwhile, so a slow evaluation cannot queue up.
      while (next_eval < evals && curve.last_recorded_version() >= schedule.at(next_eval)) ++next_eval;
    }
  }
  return 0;
}

// Re-bases the run's counters on a server instance other than the one
// counted so far (eval_'s last call re-attached: a restart under the job,
// --connect). A new instance counts its pushes from 0, and starts at the
// version of the checkpoint it restored (its version less the pushes it
// applied since), which may predate this run: its weights then held none
// of the run's updates, and the run's progress counts from there. Call
// right after the call of eval_ that returned `stats`.
void Trainer::rebase(const ServerStats& stats) {
  const uint64_t generation = eval_->generation();
  if (generation == counted_generation_) return;
  counted_generation_ = generation;
  base_applied_ = 0;
  base_rejected_ = 0;
  base_version_ = std::min(base_version_, since(stats.version, stats.gradients_applied));
}

// Records the server's current weights on the curve. The evaluation
// worker's wait for a server that died ends once this run's own server
// has exited (connect_with_retry()): during training, watch() then
// restarts it and says so.
bool Trainer::take(Curve& curve, bool during_training) {
  Result<Snapshot> s = pull_snapshot();
  if (!s.ok()) {
    if (stop_signal() != 0) return false;  // the caller says so
    if (s.status().code() == ErrorCode::kInterrupted && own_server_exited()) {
      if (!during_training)
        std::cerr << "shmps-train: evaluation: shmps-server exited with status " << server_->status() << "\n";
      return false;
    }
    std::cerr << "shmps-train: evaluation: " << s.status().to_string() << "\n";
    return false;
  }
  curve.record(std::move(*s));
  return true;
}

bool Trainer::own_server_exited() { return server_ != nullptr && server_->poll(); }

int Trainer::failed() const { return stop_signal() != 0 ? stopped_by_signal() : kExitFailure; }

int Trainer::failed(const std::string& what, const Status& s) const {
  if (stop_signal() != 0) return stopped_by_signal();
  std::cerr << "shmps-train: " << what << ": " << s.to_string() << "\n";
  return kExitFailure;
}

// Stats and the weights of the running server, through the evaluation
// worker.
Result<Snapshot> Trainer::pull_snapshot() {
  Result<ServerStats> stats = again_after_restart([&] { return eval_->stats(); });
  if (!stats.ok()) return stats.status();
  rebase(*stats);
  Result<uint64_t> version = again_after_restart([&] { return eval_->pull(kAllTensors, eval_buffer_.id, 0); });
  if (!version.ok()) return version.status();
  const auto* params = static_cast<const float*>(eval_buffer_.data);
  Snapshot s;
  s.version = since(*version, base_version_);
  s.elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
  s.rejected = since(stats->rejected_stale, base_rejected_);
  s.avg_staleness = stats->avg_staleness;
  s.weights.assign(params, params + mlp_parameter_count(shape_));
  return s;
}

// The workers' own counts against the server's (`end`: its stats after
// training), printed; true when they agree and add up to `total`.
bool Trainer::counts_agree(const SharedSlots& slots, const ServerStats& end, uint64_t total) const {
  const int restarts = server_ != nullptr ? server_->restarts() : 0;
  // A server restarted under us is a new generation (--connect: as systemd
  // restarts a unit): whoever re-attached to it, the evaluation worker or
  // any worker, saw it; how often it restarted is not known.
  bool restarted = restarts > 0 || eval_->generation() != base_generation_;
  for (size_t i = 0; i < o_.workers; ++i)
    restarted = restarted || slots[i].generation.load(std::memory_order_relaxed) != base_generation_;  // after waitpid
  uint64_t applied = 0;
  uint64_t rejected = 0;
  uint64_t lost = 0;
  bool agree = true;
  for (size_t i = 0; i < o_.workers; ++i) {
    const WorkerSlot& s = slots[i];  // the worker has exited: waitpid ordered its stores
    applied += s.pushes_applied.load(std::memory_order_relaxed);
    rejected += s.pushes_rejected.load(std::memory_order_relaxed);
    lost += s.pushes_lost.load(std::memory_order_relaxed);
    // A restarted server counts only what it saw since its start.
    const bool differ =
        s.pushes_applied.load(std::memory_order_relaxed) != s.server_applied.load(std::memory_order_relaxed) ||
        s.pushes_rejected.load(std::memory_order_relaxed) != s.server_rejected.load(std::memory_order_relaxed);
    if (!restarted && differ) {
      std::fprintf(stderr,
                   "shmps-train: worker %zu (id %u) counted %llu applied / %llu rejected, the server %llu / %llu\n", i,
                   s.worker_id.load(std::memory_order_relaxed),
                   static_cast<unsigned long long>(s.pushes_applied.load(std::memory_order_relaxed)),
                   static_cast<unsigned long long>(s.pushes_rejected.load(std::memory_order_relaxed)),
                   static_cast<unsigned long long>(s.server_applied.load(std::memory_order_relaxed)),
                   static_cast<unsigned long long>(s.server_rejected.load(std::memory_order_relaxed)));
      agree = false;
    }
  }
  const uint64_t server_applied = since(end.gradients_applied, base_applied_);
  const uint64_t server_rejected = since(end.rejected_stale, base_rejected_);
  // With a server of our own the totals must match; a shared one may have
  // other clients, so only the per-worker counts are compared.
  if (restarted) {
    // Acknowledged pushes after the last checkpoint died with the server.
    const std::string times = restarts > 0 ? std::to_string(restarts) + " times" : "during training";
    std::printf(
        "server restarted %s: %llu pushes in flight were lost and redone; the server's version is "
        "%llu of %llu acknowledged pushes (the rest were after a checkpoint)\n",
        times.c_str(), static_cast<unsigned long long>(lost),
        static_cast<unsigned long long>(since(end.version, base_version_)), static_cast<unsigned long long>(applied));
  } else if (server_ != nullptr && (server_applied != applied || server_rejected != rejected)) {
    agree = false;
  }
  if (applied != total) agree = false;
  std::printf("pushes: workers applied %llu rejected %llu; server applied %llu rejected_stale %llu (%s)\n",
              static_cast<unsigned long long>(applied), static_cast<unsigned long long>(rejected),
              static_cast<unsigned long long>(server_applied), static_cast<unsigned long long>(server_rejected),
              !agree      ? "MISMATCH"
              : restarted ? "not comparable across restarts"
                          : "agree");
  return agree;
}

}  // namespace shmps::train
