// When the server checkpoints, and what: at start the newest valid
// checkpoint of --checkpoint-dir is restored; a snapshot of the model (its
// version and step counts) and of the backend's weights and optimizer state
// is handed to the writer thread (checkpoint.hpp) every --checkpoint-every
// updates and every --checkpoint-interval-s seconds, and the final one is
// written at stop unless that version is on disk already. A merged
// federation round, an init or an update cut short changes the weights
// without a new version (Model::unversioned_changes): it counts as a
// change for the interval and the final checkpoint (which then rewrites
// the file of that version; but not a restored file without federation
// state: keeps_unfederated_checkpoint()), and each checkpoint stores the
// federation's state as of its weights. Consumer thread only (the writer
// thread is CheckpointWriter's).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "backend.hpp"
#include "checkpoint.hpp"
#include "model.hpp"
#include "shmps/server/config.hpp"
#include "shmps/server/server.hpp"
#include "shmps/shm/layout.hpp"

namespace shmps::server {

class CheckpointPolicy {
 public:
  CheckpointPolicy(const ServerConfig& config, Model& model, Backend& backend, shm::StatsBlock& stats);

  // Creates the directory, takes its lock (CheckpointDirLock, held for the
  // policy's life), removes the temp files of a writer killed mid-write,
  // restores the newest valid checkpoint (a corrupt, truncated or foreign
  // file is reported and the previous one tried; with none, the
  // configured initial values stay) and starts the writer. Errors: kIo
  // (the directory, also one it cannot list: no fresh start over
  // checkpoints it could not see), kInvalidArgument (another server holds the
  // directory: a configuration error, said in `kind` when given), the
  // backend's.
  Status start(uint64_t now, FailureKind* kind = nullptr);
  // After an applied push: the count trigger.
  void after_push(uint64_t now) {
    if (config_.checkpoint_every != 0 && model_.version - last_version_ >= config_.checkpoint_every) maybe(now);
  }
  // Every tick of the loop: both triggers.
  void tick(uint64_t now) { maybe(now); }
  // At stop: the current version on disk, unless a checkpoint of it is
  // there already (restored, or written by the writer: a periodic write
  // that failed does not count). Errors: the write's, the device's read,
  // kTimeout (a federated server whose federation thread was left behind:
  // nothing written); the server then exits with it, so that an operator
  // learns the state was not saved.
  Status write_final();

  // Where a federated server's checkpoints get the federation's state
  // (FederationLink::checkpoint_state()): false while it does not match
  // the weights, and the checkpoint waits for the next push or tick; at
  // stop (a thread left behind) the final checkpoint is not written.
  using FederationSource = std::function<bool(std::optional<FederationState>*)>;
  void set_federation_source(FederationSource source) { federation_source_ = std::move(source); }
  // Whether start() restored a checkpoint.
  bool restored() const { return restored_; }
  // The file start() restored ("" when none).
  const std::string& restored_path() const { return restored_path_; }
  // The federation's state in the checkpoint start() restored, once.
  std::optional<FederationState> take_restored_federation() { return std::exchange(restored_federation_, {}); }
  // The weights of that checkpoint when it held a federation state, once
  // (Federator::restore(): what the join keeps of the updates since).
  std::vector<float> take_restored_weights() { return std::exchange(restored_weights_, {}); }

 private:
  CheckpointLayout layout() const;
  // True when taken; false when the federation's state cannot be had now
  // (see set_federation_source()). Errors: the backend's read of the
  // weights or the state (then nothing may be written: a file of values
  // that were never read would pass every check of the restore).
  Result<bool> snapshot(CheckpointData* out) const;
  // The writer's last result into the log and the stats block's counters;
  // a failed write starts (or doubles) the pause before the next try.
  void publish_result(uint64_t now);
  // A checkpoint that failed (`why`, logged): starts or doubles the pause.
  void pause_after_failure(uint64_t now, const std::string& why);
  // A federated server's write at the version of the checkpoint it
  // restored when that one holds no federation state (a job that ran
  // without federation): the join replaced its weights with the group's,
  // and that file keeps the only copy of them. Such a write is skipped
  // (the next version's checkpoint goes to a file of its own); the first
  // skip is logged.
  bool keeps_unfederated_checkpoint();
  // A due checkpoint that the federation's state defers (a round between
  // its snapshot and its merge): counted in checkpoints_deferred, once
  // when it starts waiting and once per interval (--checkpoint-interval-s,
  // else 60 s) it keeps waiting, each of the latter logged: a round that hangs
  // (a peer that hung under MPI keeps it open for good) stops
  // checkpointing while local pushes are served.
  void defer(uint64_t now);
  // Hands a snapshot to the writer when a trigger fired and it is idle;
  // never waits for the disk. A trigger that finds the writer busy fires
  // again on the next push or tick, so under load a checkpoint may land a
  // few versions after the multiple of checkpoint_every. After a failed
  // write (a full or read-only disk) nothing is handed over for a pause,
  // 1 s doubling to 64 s while writes keep failing: each try may fill the
  // disk before it fails, and logs. Once the pause is over the current
  // version is tried again, whatever the triggers say.
  void maybe(uint64_t now);

  const ServerConfig& config_;
  Model& model_;
  Backend& backend_;
  shm::StatsBlock& stats_;
  // Held from start() until the policy goes, after the writer (declared
  // before it): the final checkpoint is written under it.
  CheckpointDirLock dir_lock_;
  std::unique_ptr<CheckpointWriter> writer_;
  uint64_t last_version_ = 0;      // handed to the writer (or restored)
  uint64_t last_unversioned_ = 0;  // Model::unversioned_changes then
  uint64_t last_ns_ = 0;
  uint64_t retry_pause_ns_ = 0;  // after a failed write (0: the last write went through)
  uint64_t retry_at_ns_ = 0;     // no write handed over before then
  bool retry_due_ = false;       // a write failed: try again once the pause is over
  uint64_t written_seen_ = 0;    // CheckpointWriter::written() at the last publish_result()
  uint64_t unread_ = 0;          // checkpoints not written because the backend's read failed
  // A due checkpoint waiting for the federation's state (a round between
  // its snapshot and its merge): since when (0: none waits), and when the
  // next warning (and count) is due.
  uint64_t deferred_since_ns_ = 0;
  uint64_t deferred_next_ns_ = 0;
  FederationSource federation_source_;
  std::optional<FederationState> restored_federation_;
  std::vector<float> restored_weights_;  // with restored_federation_ only
  std::string restored_path_;
  // The version of the checkpoint restored without federation state
  // (keeps_unfederated_checkpoint(), once a federation source is set).
  std::optional<uint64_t> unfederated_version_;
  bool unfederated_logged_ = false;
  bool restored_ = false;
};

}  // namespace shmps::server
