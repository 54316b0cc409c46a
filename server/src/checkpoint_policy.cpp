#include "checkpoint_policy.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/log.hpp"
#include "shmps/unique_fd.hpp"

namespace shmps::server {

CheckpointPolicy::CheckpointPolicy(const ServerConfig& config, Model& model, Backend& backend, shm::StatsBlock& stats)
    : config_(config), model_(model), backend_(backend), stats_(stats) {}

CheckpointLayout CheckpointPolicy::layout() const {
  CheckpointLayout l;
  l.tensors = config_.tensors;
  l.optimizer_kind = static_cast<uint32_t>(config_.optimizer.kind);
  l.state_arrays = static_cast<uint32_t>(kernels::state_arrays(config_.optimizer));
  return l;
}

Result<bool> CheckpointPolicy::snapshot(CheckpointData* out) const {
  CheckpointData& d = *out;
  if (federation_source_ && !federation_source_(&d.federation)) return false;
  d.version = model_.version;
  d.layout = layout();
  d.steps = model_.steps;
  Result<std::vector<float>> weights = backend_.read_weights();
  if (!weights.ok()) return weights.status();
  Result<std::vector<float>> state = backend_.read_state();
  if (!state.ok()) return state.status();
  d.weights = std::move(weights).value();
  d.state = std::move(state).value();
  return true;
}

Status CheckpointPolicy::start(uint64_t now, FailureKind* kind) {
  // Refused now rather than at every checkpoint and at stop; as by
  // --check-config, a configuration error (a restart cannot fix it).
  if (Status s = check_checkpoint_dir(config_.checkpoint_dir); !s.ok()) {
    if (kind != nullptr) *kind = FailureKind::kConfiguration;
    return s;
  }
  // The directory is the server's alone: the directories it creates
  // (the checkpoint directory and missing parents) are made 0700, whatever
  // the umask (the unit's UMask=0007, for the segment's group access, would
  // make them writable by the workers' group, who could then delete, hide
  // or plant checkpoints, or move the directory away). Existing ones are
  // the operator's to change: a warning when the group or others may write
  // the directory, or its parent unless sticky (where only an entry's
  // owner may move it). A file of another user is never restored
  // (read_checkpoint()).
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> missing;
  for (fs::path p = fs::absolute(config_.checkpoint_dir, ec); !ec && !p.empty() && !fs::exists(p, ec);
       p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  // Each directory made is fsync'ed into its parent: a power loss must not
  // take it, and the checkpoints written into it since, away.
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0700) != 0) {
      if (errno == EEXIST) continue;  // made by another process meanwhile
      return Status{ErrorCode::kIo, "--checkpoint-dir " + config_.checkpoint_dir + ": mkdir " + it->string() + ": " +
                                        std::strerror(errno)};
    }
    const fs::path parent = it->parent_path();
    const UniqueFd d(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d.fd < 0 || ::fsync(d.fd) != 0)
      return Status{ErrorCode::kIo, "--checkpoint-dir " + config_.checkpoint_dir + ": " +
                                        (d.fd < 0 ? "open " : "fsync ") + parent.string() + " (after mkdir " +
                                        it->string() + "): " + std::strerror(errno)};
  }
  const fs::path dir = fs::absolute(config_.checkpoint_dir, ec);
  for (const fs::path& p : {dir, dir.parent_path()}) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0 || (st.st_mode & 022) == 0 || (p != dir && (st.st_mode & S_ISVTX) != 0)) continue;
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    log::warn("--checkpoint-dir " + config_.checkpoint_dir + ": " + p.string() + " (mode " + mode +
              ") can be written by its group or others, who could delete, rename or plant files there (a planted "
              "file is never restored, but a checkpoint of its name cannot be written), or move the checkpoints "
              "away: chmod go-w it");
  }
  // Before anything in the directory is touched: another server's writer
  // may be writing there.
  auto lock = CheckpointDirLock::acquire(config_.checkpoint_dir);
  if (!lock.ok()) {
    // Held by another live server (acquire()'s kInvalidArgument): no
    // restart fixes that, but a change of the configuration.
    if (kind != nullptr && lock.status().code() == ErrorCode::kInvalidArgument) *kind = FailureKind::kConfiguration;
    return lock.status();
  }
  dir_lock_ = std::move(lock).value();
  // From here on through the lock's descriptor of the directory: the
  // restore, the writes and pruning never touch another one put at its path.
  remove_temp_files(dir_lock_);
  std::optional<uint64_t> restored;
  const CheckpointLayout l = layout();
  uint32_t refused = 0;
  // A directory that cannot be listed fails the start: taken for an empty
  // one, the server would train from scratch and write over its
  // checkpoints, version by version.
  const Result<std::vector<std::string>> paths = list_checkpoints(dir_lock_);
  if (!paths.ok())
    return Status{ErrorCode::kIo, "--checkpoint-dir " + config_.checkpoint_dir +
                                      ": not restoring: " + paths.status().message() +
                                      ", and start the server again (it does not start from the configured initial "
                                      "values over checkpoints it could not list)"};
  for (const std::string& path : *paths) {
    bool damaged = false;
    auto data = read_checkpoint(dir_lock_, path, l, &damaged);
    if (!data.ok()) {
      std::string aside;
      if (damaged) {
        const Result<std::string> moved = set_aside_damaged_checkpoint(dir_lock_, path);
        aside = moved.ok() ? "; renamed to " + *moved +
                                 " (kept for inspection; neither restored nor counted by --checkpoint-keep again)"
                           : "; could not set it aside (" + moved.status().message() + ")";
      }
      log::error("checkpoint " + data.status().message() + aside + "; trying the previous one");
      ++refused;
      continue;
    }
    if (Status s = backend_.load(data->weights, data->state); !s.ok()) return s;
    model_.steps = data->steps;
    model_.version = data->version;
    restored_federation_ = std::move(data->federation);
    // The join keeps the updates applied since, W - W_ckpt.
    if (restored_federation_) restored_weights_ = std::move(data->weights);
    restored_path_ = path;
    if (!restored_federation_) unfederated_version_ = model_.version;
    last_version_ = model_.version;
    // relaxed: published with the segment (publish() is a release store).
    stats_.version.store(model_.version, std::memory_order_relaxed);
    log::info("restored checkpoint " + path + ": version " + std::to_string(model_.version) +
              (restored_federation_ ? ", federation round " + std::to_string(restored_federation_->round) : ""));
    restored = model_.version;
    break;
  }
  // Refused files make a fresh start likely a mistake (options changed, a
  // downgrade): said as a warning.
  if (!restored && refused == 0)
    log::info("no checkpoint in " + config_.checkpoint_dir + "; starting from the configured initial values");
  else if (!restored)
    log::warn("none of the " + std::to_string(refused) + " checkpoint(s) in " + config_.checkpoint_dir +
              " could be restored (above); starting from the configured initial values, and training from scratch. "
              "If they should have been restored, stop this server before it checkpoints and restart it with the "
              "options they were written with (or a build that reads their format)");
  restored_ = restored.has_value();
  writer_ = std::make_unique<CheckpointWriter>(config_.checkpoint_keep, restored, dir_lock_);
  last_ns_ = now;
  return Status::Ok();
}

void CheckpointPolicy::pause_after_failure(uint64_t now, const std::string& why) {
  constexpr uint64_t kFirstPauseNs = 1'000'000'000, kLongestPauseNs = 64'000'000'000;
  retry_pause_ns_ = retry_pause_ns_ == 0 ? kFirstPauseNs : std::min(2 * retry_pause_ns_, kLongestPauseNs);
  retry_at_ns_ = now + retry_pause_ns_;
  retry_due_ = true;
  log::error(why + "; trying again in " + std::to_string(retry_pause_ns_ / 1'000'000'000) + " s");
}

void CheckpointPolicy::publish_result(uint64_t now) {
  const uint64_t written = writer_->written();
  if (written != std::exchange(written_seen_, written)) retry_pause_ns_ = 0;  // one went through
  if (Status s = writer_->take_result(); !s.ok()) pause_after_failure(now, s.message());
  // relaxed: statistics, as every store to the block: the writer's counts
  // and the unread ones (write_final() bumps them for the final write).
  stats_.checkpoints_written.store(written, std::memory_order_relaxed);
  stats_.checkpoint_failures.store(writer_->failed() + unread_, std::memory_order_relaxed);
}

bool CheckpointPolicy::keeps_unfederated_checkpoint() {
  if (!federation_source_ || unfederated_version_ != model_.version) return false;
  if (!unfederated_logged_)
    log::warn("not checkpointing version " + std::to_string(model_.version) + " over " + restored_path_ +
              ": it holds no federation state, and weights of a run without federation that the join may have "
              "replaced; the next version is checkpointed to a file of its own (docs/federation.md, "
              "\"Checkpoints and restarts\")");
  unfederated_logged_ = true;
  return true;
}

void CheckpointPolicy::maybe(uint64_t now) {
  publish_result(now);
  if (now < retry_at_ns_) return;  // pausing after a failed write
  if (!retry_due_) {
    // Changes that leave the version alone count too (Model::unversioned_changes).
    if (model_.version == last_version_ && model_.unversioned_changes == last_unversioned_) return;
    const bool by_count = config_.checkpoint_every != 0 && model_.version - last_version_ >= config_.checkpoint_every;
    const bool by_time =
        config_.checkpoint_interval_s != 0 && now - last_ns_ >= uint64_t{config_.checkpoint_interval_s} * 1'000'000'000;
    if (!by_count && !by_time) return;
  }
  if (writer_->busy() || keeps_unfederated_checkpoint()) return;
  CheckpointData data;
  const Result<bool> taken = snapshot(&data);
  if (!taken.ok()) {
    ++unread_;  // counted in checkpoint_failures by publish_result()
    pause_after_failure(now, "checkpoint of version " + std::to_string(model_.version) +
                                 " not written: reading it from the device failed: " + taken.status().message());
    return;
  }
  if (!*taken) {
    defer(now);
    return;
  }
  deferred_since_ns_ = 0;
  retry_due_ = false;
  writer_->submit(std::move(data), model_.unversioned_changes);
  log::info("checkpoint of version " + std::to_string(model_.version) + " handed to the writer");
  last_version_ = model_.version;
  last_unversioned_ = model_.unversioned_changes;
  last_ns_ = now;
}

void CheckpointPolicy::defer(uint64_t now) {
  const uint64_t every_ns =
      (config_.checkpoint_interval_s != 0 ? uint64_t{config_.checkpoint_interval_s} : uint64_t{60}) * 1'000'000'000;
  if (deferred_since_ns_ == 0) {
    deferred_since_ns_ = now;
    deferred_next_ns_ = now + every_ns;
    shm::bump(stats_.checkpoints_deferred);
    return;
  }
  if (now < deferred_next_ns_) return;
  deferred_next_ns_ = now + every_ns;
  shm::bump(stats_.checkpoints_deferred);
  log::warn("checkpoint of version " + std::to_string(model_.version) + " overdue by " +
            std::to_string((now - deferred_since_ns_) / 1'000'000'000) +
            " s: a federation round has been between its snapshot and its merge since (a host hung?), and the "
            "federation's state does not match the weights until it merges; the newest checkpoint is version " +
            (writer_->last_written() ? std::to_string(*writer_->last_written()) : std::string("none")) +
            " (docs/federation.md, \"Checkpoints and restarts\")");
}

Status CheckpointPolicy::write_final() {
  if (Status s = writer_->drain(); !s.ok()) log::error(s.message());
  publish_result(0);  // the drained write's counts (its message is logged above)
  // What the writer wrote, not what it was handed: a write that failed,
  // also one at the version of an earlier good one after the weights
  // changed without a new version, leaves that change to this one.
  if (writer_->holds(model_.version, model_.unversioned_changes)) return Status::Ok();
  if (keeps_unfederated_checkpoint()) return Status::Ok();
  CheckpointData data;
  const Result<bool> taken = snapshot(&data);
  if (taken.ok() && !*taken) {
    // The federation thread was left behind in a collective: its state
    // cannot be had. A checkpoint without it would be the newest, and a
    // restart would take it as a host that never federated (the join
    // replaces its weights, W - A lost) instead of restoring the newest
    // one that holds the state, whose updates the join keeps.
    shm::bump(stats_.checkpoint_failures);
    return Status{
        ErrorCode::kTimeout,
        "final checkpoint of version " + std::to_string(model_.version) +
            " not written: the federation's state cannot be had (its thread was left behind in a "
            "collective), and one without it would shadow the newest checkpoint that holds it" +
            (writer_->last_written() ? " (version " + std::to_string(*writer_->last_written()) + ")" : std::string()) +
            ", which the next start restores"};
  }
  if (!taken.ok()) {
    shm::bump(stats_.checkpoint_failures);
    return Status{taken.status().code(),
                  "final checkpoint of version " + std::to_string(model_.version) +
                      " not written: reading it from the device failed: " + taken.status().message()};
  }
  Status held = dir_lock_.still_held();
  if (Status s = held.ok() ? write_checkpoint(dir_lock_, data) : held; !s.ok()) {
    shm::bump(stats_.checkpoint_failures);
    return Status{s.code(), "final " + s.message()};
  }
  shm::bump(stats_.checkpoints_written);
  prune_checkpoints(dir_lock_, config_.checkpoint_keep, model_.version, layout());
  last_version_ = model_.version;
  last_unversioned_ = model_.unversioned_changes;
  log::info("final checkpoint written: version " + std::to_string(model_.version) + " in " + config_.checkpoint_dir);
  return Status::Ok();
}

}  // namespace shmps::server
