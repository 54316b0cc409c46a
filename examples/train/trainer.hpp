// The parent process of a shmps-train job: loads the data, then either runs
// the in-process ceiling, or starts (or finds) the server, attaches as a
// worker of its own for evaluation, forks the workers, watches them and
// the server (restarting a dead server of its own), evaluates as the
// applied pushes pass each point, and checks the workers' counts against
// the server's. One thread; make it after parse_options.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "child.hpp"
#include "evaluation.hpp"
#include "idx.hpp"
#include "mlp.hpp"
#include "options.hpp"
#include "own_server.hpp"
#include "shmps/worker.hpp"
#include "worker_process.hpp"

namespace shmps::train {

class Trainer {
 public:
  explicit Trainer(Options o) : o_(std::move(o)), counters_(o_.connect.empty() ? o_.name : o_.connect) {}
  // Cleans up after any exit path: kills the workers, detaches the
  // evaluation worker, then stops the server.
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole job; returns the exit code (0, kExitFailure, kExitUsage).
  int run();

 private:
  int load_data();
  int attach(const std::string& server_name);
  int fork_workers(const std::string& server_name, SharedSlots& slots);
  int watch(const EvalSchedule& schedule, Curve& curve);
  bool take(Curve& curve, bool during_training = false);
  // Whether the server this run started has exited (reaped if so).
  bool own_server_exited();
  // The exit code of a failure: stopped_by_signal()'s when a stop signal
  // came (it ends the evaluation worker's waits), else kExitFailure.
  int failed() const;
  // The same for a call that failed with `s`: named on stderr ("shmps-train:
  // <what>: <s>") unless a stop signal came (its waits end with an error).
  int failed(const std::string& what, const Status& s) const;
  Result<Snapshot> pull_snapshot();
  bool counts_agree(const SharedSlots& slots, const ServerStats& end, uint64_t total) const;
  void rebase(const ServerStats& stats);
  void note_checkpoint_failures(bool now = false);
  int stop_own_server();

  // Constant once run() has begun.
  Options o_;
  MlpShape shape_;
  Dataset train_;
  Dataset test_;
  // The server, when it is our own (no --connect).
  std::unique_ptr<OwnServer> server_;
  // The evaluation worker, its buffer, and the server's counters that the
  // run counts from: when it attached (a running server may have served
  // other jobs before), re-based by rebase() on a restarted instance.
  std::unique_ptr<Worker> eval_;
  Buffer eval_buffer_;
  uint64_t base_generation_ = 0;     // of the server instance attached to
  uint64_t counted_generation_ = 0;  // of the instance the bases below are of
  uint64_t base_version_ = 0;
  uint64_t base_rejected_ = 0;
  uint64_t base_applied_ = 0;
  // Checkpoint write failures: the count in instance failures_generation_
  // that was there before (at attach, or 0 after a restart); warned of once.
  ServerCounters counters_;
  uint64_t failures_generation_ = 0;
  uint64_t failures_base_ = 0;
  bool failures_warned_ = false;
  std::chrono::steady_clock::time_point next_failures_check_;
  std::vector<Child> workers_;
  std::chrono::steady_clock::time_point start_;  // of training
};

}  // namespace shmps::train
