#include "federation_link.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/log.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "threads.hpp"

namespace shmps::server {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

FederationLink::FederationLink(const FederationConfig& config, std::unique_ptr<FederationEngine> engine,
                               const ModelFingerprint& fingerprint, shm::StatsBlock& stats,
                               shm::WaitWord& consumer_wake)
    : config_(config),
      engine_(std::move(engine)),
      membership_(engine_->membership()),
      stats_(stats),
      consumer_wake_(consumer_wake),
      federator_(config_, *engine_, fingerprint),
      exchange_(fingerprint.total_elements) {}

FederationLink::~FederationLink() {
  if (thread_.joinable()) {
    abandon();  // ends every wait of the thread, and it announces no leave
    thread_.join();
  }
  // After the server's "stopped" line, before the engine closes: an
  // operator (or systemd's TimeoutStopSec=) would otherwise see a stopped
  // server that does not exit.
  if (engine_->close_waits_for_every_member())
    log::info(std::string("federation (") + engine_->name() +
              "): this process ends when every rank of the job has stopped (closing the engine, MPI_Finalize, "
              "waits for them); it serves nothing meanwhile");
}

void FederationLink::start(uint64_t version) {
  last_snapshot_version_ = version;
  // A restored checkpoint's unmerged updates are in W - A already: they
  // count in the drift (a checkpoint's count is at most its version; a
  // larger, damaged one counts as the whole version).
  merged_version_ = version - std::min(unmerged_updates_, version);
  thread_ = start_helper_thread([this] { thread_main(); });
}

void FederationLink::set_phase(Phase p) {
  // SYNC(fed_phase): release publishes the exchange buffer's contents
  // (the snapshot, or the correction) to the thread that acquires the new
  // phase; the buffer changes hands with it.
  phase_.store(static_cast<uint32_t>(p), std::memory_order_release);
  shm::notify(thread_wake_);
  // Only the thread sets these, and only it takes mu_ while serving goes
  // on: under mu_, since once stop() gave up on the thread the segment that
  // holds the word may be unmapped.
  if (p == Phase::kWantSnapshot || p == Phase::kMergeReady || p == Phase::kDiscarded) {
    std::lock_guard lock(mu_);
    if (!abandoned_.load(std::memory_order_relaxed)) shm::notify(consumer_wake_);  // relaxed: written under mu_
  }
}

void FederationLink::abandon() {
  {
    std::lock_guard lock(mu_);
    abandoned_.store(true, std::memory_order_relaxed);  // relaxed: mu_ orders it against the thread's uses
  }
  shm::notify(thread_wake_);
}

bool FederationLink::stopping() const noexcept {
  // relaxed: flags; the wake word's notify() orders them before the
  // waiter's re-check (shm::wait_until's protocol).
  return stop_.load(std::memory_order_relaxed) || abandoned_.load(std::memory_order_relaxed);
}

bool FederationLink::sleep_until(Clock::time_point deadline, const std::function<bool()>& ready) {
  // No spin: the thread's waits are long, and it may run at a lowered priority.
  return shm::wait_until(thread_wake_, ready, nullptr, deadline, /*spin_iterations=*/0,
                         std::chrono::milliseconds(100)) == shm::WaitResult::kReady;
}

FederationLink::Phase FederationLink::phase() const noexcept {
  return static_cast<Phase>(phase_.load(std::memory_order_acquire));  // SYNC(fed_phase)
}

// ------------------------------------------------------------ consumer

Result<FederationLink::Polled> FederationLink::poll(Backend& backend, uint64_t version) {
  // relaxed: the common case (nothing asked) needs no ordering; a phase
  // that asks for work is re-read with acquire below.
  const auto p = static_cast<Phase>(phase_.load(std::memory_order_relaxed));
  if (p == Phase::kIdle) {
    if (config_.every_versions != 0 && version - last_snapshot_version_ >= config_.every_versions) request_round();
    return Polled::kNothing;
  }
  if (p != Phase::kWantSnapshot && p != Phase::kMergeReady && p != Phase::kDiscarded) return Polled::kNothing;
  if (phase() == Phase::kDiscarded) {
    // The round was abandoned: W keeps its local updates (the thread
    // counts them in the next round).
    hold_since_ns_ = 0;
    set_phase(Phase::kIdle);
    return Polled::kDiscard;
  }
  const bool snapshot = phase() == Phase::kWantSnapshot;
  if (Status s = snapshot ? backend.snapshot_weights(exchange_) : backend.add_to_weights(exchange_); !s.ok()) {
    set_phase(Phase::kOff);  // the thread sees it, tells the others it leaves, and ends
    return s;
  }
  if (snapshot) {
    // This snapshot answers every request for a round made before it
    // (the thread may be slow to take the phase: a lowered priority).
    round_now_.store(false, std::memory_order_relaxed);  // relaxed: a flag, as in request_round()
    snapshot_updates_ = version - last_snapshot_version_;
    last_snapshot_version_ = snapshot_version_ = version;
    set_phase(Phase::kExchanging);
    return Polled::kSnapshot;
  }
  // The drift counts from the merged snapshot, less the local updates of
  // it that the merge keeps in W - A' (a join that keeps the drift).
  merged_version_ = snapshot_version_ - std::min(merge_kept_updates_, snapshot_version_);
  ++merges_;
  hold_since_ns_ = 0;  // a hold ends with its round, whether or not a lane looked since
  set_phase(Phase::kIdle);
  return Polled::kMerge;
}

bool FederationLink::wants_consumer() const noexcept {
  const Phase p = phase();
  return p == Phase::kWantSnapshot || p == Phase::kMergeReady || p == Phase::kDiscarded;
}

bool FederationLink::holding_pushes(uint64_t version) {
  // relaxed: a hint; the phase that hands the buffer over is acquired in poll().
  const auto p = static_cast<Phase>(phase_.load(std::memory_order_relaxed));
  const bool exchanging = !config_.overlap && (p == Phase::kExchanging || p == Phase::kMergeReady);
  // relaxed: a hint as the phase is; outside a group no merge would come.
  const bool capped = in_group_.load(std::memory_order_relaxed) && config_.max_drift != 0 &&
                      version - merged_version_ >= config_.max_drift;
  if (capped && p == Phase::kIdle) request_round();
  const bool hold = p != Phase::kOff && (exchanging || capped);
  if (!hold || lifted_at_merges_ == merges_) {
    if (!hold) hold_since_ns_ = 0;
    return false;
  }
  const uint64_t now = shm::monotonic_ns();
  if (hold_since_ns_ == 0) hold_since_ns_ = now;
  if (now - hold_since_ns_ < hold_limit_ms() * 1'000'000) return true;
  lifted_at_merges_ = merges_;
  hold_since_ns_ = 0;
  log::warn("federation: pushes held " + std::to_string(hold_limit_ms()) + " ms for a round that has not merged (" +
            (config_.overlap ? "the drift cap, --fed-max-drift" : "--fed-no-overlap") +
            "; a host hung?): served without the hold until a round merges");
  return false;
}

uint32_t FederationLink::group_period_ms() const noexcept {
  // relaxed: written once by the thread after its join; 0 (not joined
  // yet) only leaves our own period.
  return std::max(config_.every_ms, group_every_ms_.load(std::memory_order_relaxed));
}

uint64_t FederationLink::hold_limit_ms() const noexcept { return 2 * uint64_t{group_period_ms()} + config_.timeout_ms; }

void FederationLink::request_round() {
  // relaxed: a flag; notify() orders it before the timer's re-check.
  if (round_now_.exchange(true, std::memory_order_relaxed)) return;
  shm::notify(thread_wake_);
}

Status FederationLink::restore(FederationState state, std::vector<float> weights) {
  const uint64_t unmerged = state.unmerged_updates;
  // The updates in the restore base's drift (all, when the base is the
  // checkpoint's weights).
  const uint64_t in_base = state.restore_base.empty() ? unmerged : state.restore_base_updates;
  if (Status s = federator_.restore(std::move(state), std::move(weights)); !s.ok()) return s;
  // Before start(): the thread's from then on.
  unmerged_updates_ = unmerged;
  restored_unmerged_ = in_base;
  return Status::Ok();
}

bool FederationLink::checkpoint_state(uint64_t version, std::optional<FederationState>* out) const {
  // Before start() the federator is the consumer's; after it, the thread
  // touches the anchor only between kExchanging and kMergeReady, and only
  // the consumer moves the phase out of kWantSnapshot: in kIdle and
  // kWantSnapshot the anchor is the one already merged into W. In kOff
  // the thread may still be ending (announcing its leave) until done.
  const Phase p = phase();                                         // SYNC(fed_phase): acquire, as in poll()
  const bool done = thread_done_.load(std::memory_order_acquire);  // SYNC(fed_done): as in stop()
  const bool stable =
      !thread_.joinable() || p == Phase::kIdle || p == Phase::kWantSnapshot || (p == Phase::kOff && done);
  // (kDiscarded: a repair may have moved the anchor of a round abandoned
  // after it; the consumer takes the phase back at its next poll.)
  if (!stable) return false;
  *out = federator_.state();
  // The updates in W - A: the snapshots' not yet merged (the thread's,
  // handed over with the phase) and those since the last snapshot.
  if (*out) {
    (*out)->unmerged_updates = unmerged_updates_ + (version - last_snapshot_version_);
    if (!(*out)->restore_base.empty()) (*out)->restore_base_updates = restored_unmerged_;
  }
  return true;
}

void FederationLink::publish_drift(uint64_t version) {
  // relaxed: statistics.
  stats_.fed_drift.store(version - merged_version_, std::memory_order_relaxed);
}

std::chrono::milliseconds FederationLink::stop_bound() const {
  // An elastic engine's thread may be forming a group: its settle,
  // agreement and rendezvous take up to about two of its timeouts.
  return std::chrono::milliseconds(2 * uint64_t{group_period_ms()} + 5000 +
                                   (engine_->elastic() ? 2 * uint64_t{config_.timeout_ms} : 0));
}

bool FederationLink::stop(Backend& backend, uint64_t version, uint64_t* merges) {
  if (!thread_.joinable()) return true;
  stop_.store(true, std::memory_order_relaxed);  // relaxed: notify() orders it
  shm::notify(thread_wake_);
  const uint64_t timeout_ms = static_cast<uint64_t>(stop_bound().count());
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  // SYNC(fed_done): pairs with the thread's release as it ends.
  while (!thread_done_.load(std::memory_order_acquire)) {
    // A failed poll ends federation (kOff), so it is logged once.
    if (Result<Polled> r = poll(backend, version); !r.ok())
      log::error("federation: at stop: " + r.status().message());
    else if (*r == Polled::kMerge)
      ++*merges;
    if (Clock::now() >= deadline) {
      abandon();
      log::error("federation: the federation thread is still inside a collective after " + std::to_string(timeout_ms) +
                 " ms (a host gone?); leaving it behind: the engine is not finalised");
      thread_.detach();
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  thread_.join();
  return true;
}

// ------------------------------------------------------------ federation thread

bool FederationLink::wait_for(Phase want) {
  // relaxed: abandoned_ is a flag here (its notify() wakes this wait).
  const auto done = [&] {
    return abandoned_.load(std::memory_order_relaxed) || phase() == want || phase() == Phase::kOff;
  };
  sleep_until(Clock::time_point::max(), done);  // no deadline: it returns only once done()
  return !abandoned_.load(std::memory_order_relaxed) && phase() == want;
}

template <class F>
bool FederationLink::with_stats(F update) {
  std::lock_guard lock(mu_);
  if (abandoned_.load(std::memory_order_relaxed)) return false;  // relaxed: written under mu_
  update(stats_);
  return true;
}

void FederationLink::end(const std::string& why) {
  ended_ = true;
  log::warn("federation: " + why + "; serving the local workers alone from now on");
  publish_state(shm::FederationState::kEnded);
  set_phase(Phase::kOff);
}

void FederationLink::publish_state(shm::FederationState state) {
  with_stats([state](shm::StatsBlock& s) {
    // relaxed: statistics, each a value of its own.
    s.fed_state.store(static_cast<uint64_t>(state), std::memory_order_relaxed);
    if (state != shm::FederationState::kInGroup) s.fed_members.store(0, std::memory_order_relaxed);
  });
}

void FederationLink::publish(const RoundResult& r, uint64_t round_ns) {
  with_stats([&](shm::StatsBlock& s) {
    // relaxed: statistics, each a value of its own.
    s.fed_round.store(r.round, std::memory_order_relaxed);
    s.fed_members.store(r.members, std::memory_order_relaxed);
    s.fed_state.store(static_cast<uint64_t>(shm::FederationState::kInGroup), std::memory_order_relaxed);
    s.fed_round_ns.store(round_ns, std::memory_order_relaxed);
    s.fed_bytes.fetch_add(r.bytes, std::memory_order_relaxed);
    s.fed_anchor_hash.store(federator_.anchor_hash(), std::memory_order_relaxed);
    s.fed_epoch.store(engine_->membership().epoch, std::memory_order_relaxed);
  });
}

FederationLink::Outcome FederationLink::exchange(bool join) {
  set_phase(Phase::kWantSnapshot);
  if (!wait_for(Phase::kExchanging)) return Outcome::kOver;
  const auto start = Clock::now();
  unmerged_updates_ += snapshot_updates_;
  Result<RoundResult> r = join ? federator_.join(exchange_) : federator_.round(exchange_, unmerged_updates_);
  const std::string what = join ? std::string("the join") : "round " + std::to_string(federator_.round_number() + 1);
  if (!r.ok()) {
    // relaxed: statistics.
    with_stats([](shm::StatsBlock& s) { s.fed_failures.fetch_add(1, std::memory_order_relaxed); });
    log::error(r.status().message());
    // kIo: a host failed or was left out (an elastic group re-forms without
    // it); anything else is this host's configuration to fix (its model or
    // round is not the group's), and ends its federation.
    if (!engine_->elastic() || r.status().code() != ErrorCode::kIo) {
      end(what + " failed");
      return Outcome::kOver;
    }
    log::warn("federation: " + what + " failed; its local updates stay in the weights, the group re-forms");
    return discard();
  }
  if (r->peer_left || r->regroup) {
    const std::string why =
        r->peer_left ? "host rank " + std::to_string(r->left_rank) + " left the federation" : "a host waits to join";
    if (!engine_->elastic()) {
      end(why + " (" + engine_->name() + " cannot re-form the group)");
      return Outcome::kOver;
    }
    log::info("federation: " + why + "; the group re-forms");
    return discard();
  }
  publish(*r, static_cast<uint64_t>(std::chrono::nanoseconds(Clock::now() - start).count()));
  if (r->restored_drift_dropped || r->restored_drift_rebased) log_restored_drift(*r);
  // Merged, or gone: a join that does not keep the drift sets W = A, but
  // for the updates since a restart where it keeps them.
  if (join && !r->drift_kept && r->restart_updates_kept) {
    unmerged_updates_ -= std::min(unmerged_updates_, restored_unmerged_);
  } else if (!join || !r->drift_kept) {
    unmerged_updates_ = 0;
  }
  if (join) {
    // A round that failed here but merged elsewhere took its updates.
    unmerged_updates_ -= std::min(unmerged_updates_, r->failed_round_updates);
    // relaxed: read by stop() for its timeout only.
    group_every_ms_.store(federator_.group_every_ms(), std::memory_order_relaxed);
    engine_->set_group_period_ms(federator_.group_every_ms());
    in_group_.store(true, std::memory_order_relaxed);  // relaxed: holding_pushes()'s hint
    const Membership m = engine_->membership();
    log::info("federation: joined as rank " + std::to_string(m.rank) + " of " + std::to_string(m.size) +
              (engine_->elastic() ? " (epoch " + std::to_string(m.epoch) + ")" : "") + " over " + engine_->name() +
              "; a round every " + std::to_string(config_.every_ms) + " ms" +
              (config_.every_versions != 0 ? " or " + std::to_string(config_.every_versions) + " local updates" : "") +
              ", outer step " + outer_step_name(config_.outer) +
              (r->resumed ? "; resumed at round " + std::to_string(r->round) + " from rank " +
                                std::to_string(r->source_rank) + "'s anchor"
                          : "; rank 0's weights are the anchor") +
              " (lineage " + hex64(federator_.lineage()) + ")");
    if (r->fork)
      log::warn("federation: a fork of lineage " + hex64(federator_.lineage()) + " at round " +
                std::to_string(r->round) + ": " + std::to_string(r->fork_others) + " member(s) (the lowest rank " +
                std::to_string(r->fork_rank) + ") held another anchor of that round than rank " +
                std::to_string(r->source_rank) + " and the " + std::to_string(r->fork_holders - 1) +
                " other(s) holding its anchor (a round that completed at some hosts only); the anchor more members "
                "hold is kept, the other branch's rounds since the fork are replaced" +
                (r->fork_lost ? "; this host's branch is one of those replaced: its drift since its last merge is "
                                "kept, rebased onto the group's anchor"
                              : ""));
    // A fresh group's rank 0 keeps its weights (they became the anchor).
    if (!unfederated_checkpoint_.empty() && (r->resumed || m.rank != 0))
      log::warn("federation: the weights restored from " + unfederated_checkpoint_ +
                ", a checkpoint without federation state (a run without federation), were replaced by the join "
                "with " +
                (r->resumed ? "the group's anchor of round " + std::to_string(r->round) + " (rank " +
                                  std::to_string(r->source_rank) + "'s)"
                            : std::string("rank 0's weights (a fresh group)")) +
                "; that file is not written over: copy it elsewhere to keep those weights (pruning deletes it once "
                "--checkpoint-keep newer checkpoints are written)");
    unfederated_checkpoint_.clear();
  }
  if (r->anchors_repaired)
    log::warn("federation: round " + std::to_string(r->round) + ": the anchors differed between hosts; rank 0's " +
              "was broadcast");
  merge_kept_updates_ = unmerged_updates_;  // handed over with the phase
  set_phase(Phase::kMergeReady);
  return wait_for(Phase::kIdle) ? Outcome::kMerged : Outcome::kOver;
}

void FederationLink::log_restored_drift(const RoundResult& r) const {
  // unmerged_updates_: the checkpoint's, and those of the join's snapshot
  // since the restart.
  const uint64_t in_checkpoint = std::min(unmerged_updates_, restored_unmerged_);
  const uint64_t since_restart = unmerged_updates_ - in_checkpoint;
  // The rounds since the checkpoint: "round 6", "rounds 6 to 9".
  const bool one = r.round == r.restored_round + 1;
  const std::string after = (one ? "round " : "rounds ") + std::to_string(r.restored_round + 1) +
                            (one ? "" : " to " + std::to_string(r.round));
  const std::string any_of = (one ? "" : "one of ") + after;
  if (r.restored_drift_rebased) {
    log::info("federation: the join rebases the checkpoint's weights of round " + std::to_string(r.restored_round) +
              " onto the group's anchor of round " + std::to_string(r.round) + ": the groups that completed " + after +
              " did not hold this host, so its " + std::to_string(in_checkpoint) +
              " local updates not merged as of the checkpoint are kept, with the " + std::to_string(since_restart) +
              " applied since the restart");
    return;
  }
  if (in_checkpoint == 0 && since_restart == 0) return;
  std::string text = "federation: the join takes the group's anchor of round " + std::to_string(r.round) +
                     " as the weights, over the checkpoint's of round " + std::to_string(r.restored_round);
  if (since_restart != 0)
    text += "; the " + std::to_string(since_restart) + " local updates applied since the restart are " +
            (r.restart_updates_kept ? "kept" : "dropped");
  if (in_checkpoint != 0 && r.restored_round >= r.round)
    text += "; the checkpoint's " + std::to_string(in_checkpoint) +
            " local updates not merged as of its round are dropped: its state is of no known lineage, and the group "
            "resumed from another";
  else if (in_checkpoint != 0)
    text += "; the checkpoint's " + std::to_string(in_checkpoint) + " local updates not merged as of its round " +
            (r.restored_drift_merged
                 ? "are in the group's anchor (this host was a member of a group that completed " + any_of + ")"
                 : "are dropped: merged already if this host was a member of a group that completed " + any_of +
                       ", lost if it was in none of them (the source's record of groups cannot tell: it does not "
                       "reach back, or names no members, or the checkpoint was written under another host id)");
  // A warning where something is dropped that no round may have merged.
  const bool lost = (in_checkpoint != 0 && !r.restored_drift_merged) || (since_restart != 0 && !r.restart_updates_kept);
  if (lost)
    log::warn(text);
  else
    log::info(text);
}

FederationLink::Outcome FederationLink::discard() {
  in_group_.store(false, std::memory_order_relaxed);  // relaxed: holding_pushes()'s hint
  publish_state(shm::FederationState::kForming);
  set_phase(Phase::kDiscarded);
  return wait_for(Phase::kIdle) ? Outcome::kRegroup : Outcome::kOver;
}

bool FederationLink::form_group() {
  federator_.rejoin();
  FederationEngine::Reform last = FederationEngine::Reform::kFormed;
  // A failure that repeats is logged again after 5 s, then at doubling
  // intervals up to 5 minutes, with its newest reason (each try's names its
  // attempt): a host that keeps failing says why without a line per try.
  constexpr auto kFirstRepeat = std::chrono::seconds(5);
  constexpr auto kLongestRepeat = std::chrono::minutes(5);
  Clock::duration repeat_every = kFirstRepeat;
  Clock::time_point first_failure, next_repeat;
  uint64_t failures = 0;
  while (true) {
    if (stopping()) return false;
    std::string why;
    const FederationEngine::Reform r = engine_->reform(&why, [this] { return stopping(); });
    const auto now = Clock::now();
    if (r == FederationEngine::Reform::kRefused) {
      end(why);
      return false;
    }
    if (r == FederationEngine::Reform::kFormed) {
      if (last == FederationEngine::Reform::kPaused) {
        log::info("federation: a majority is back; federation resumes");
        publish_state(shm::FederationState::kForming);
      }
      return true;
    }
    if (stopping()) return false;  // the try was cancelled: nothing to log
    // Logged when it changes, not on every try; a failure again as it
    // repeats. A backoff each time: it warns of a host the others cannot
    // reach, and its waits double.
    if (r == FederationEngine::Reform::kBackedOff) {
      log::warn(why);
    } else if (r != last) {
      (r == FederationEngine::Reform::kPaused ? log::warn(why) : log::info(why + "; trying again"));
      first_failure = now;
      repeat_every = kFirstRepeat;
      next_repeat = now + repeat_every;
      failures = 1;
    } else if (r == FederationEngine::Reform::kFailed) {
      ++failures;
      if (now >= next_repeat) {
        const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(now - first_failure).count();
        log::info(why + "; still no group after " + std::to_string(failures) + " tries in " + std::to_string(seconds) +
                  " s; trying again");
        repeat_every = std::min<Clock::duration>(repeat_every * 2, kLongestRepeat);
        next_repeat = now + repeat_every;
      }
    }
    if (r == FederationEngine::Reform::kPaused) publish_state(shm::FederationState::kPaused);
    last = r;
    // Paused: up to a second between tries (each writes a few keys to the
    // store), and never as long as a try waits for the others
    // (--fed-timeout-ms): two paused hosts whose pauses outlasted each
    // other's tries never met, each trying while the other paused.
    const auto pause = std::chrono::milliseconds(
        r == FederationEngine::Reform::kPaused ? std::min<uint64_t>(1000, config_.timeout_ms / 2) : 50);
    sleep_until(Clock::now() + pause, [this] { return stopping(); });
  }
}

bool FederationLink::regroup() {
  while (true) {
    if (engine_->elastic() && !form_group()) return false;
    switch (exchange(/*join=*/true)) {
      case Outcome::kMerged:
        return true;
      case Outcome::kOver:
        return false;
      case Outcome::kRegroup:
        break;  // the group changed during the join: form the next
    }
  }
}

void FederationLink::thread_main() {
  if (!config_.cpus.empty()) {
    const std::string wanted = cpu_list_text(config_.cpus);
    if (const std::string why = pin_this_thread(config_.cpus); !why.empty()) {
      log::warn("federation: --fed-cpus " + wanted + ": the federation thread keeps its CPUs (" + why + ")");
    } else if (const std::vector<uint32_t> got = thread_cpus(); got == config_.cpus) {
      log::info("federation: the round loop runs on CPUs " + wanted);
    } else {  // the kernel kept the listed CPUs that are online and in the cgroup
      log::warn("federation: the round loop runs on CPUs " + cpu_list_text(got) + " of --fed-cpus " + wanted +
                " (the others are offline or outside the server's cgroup)");
    }
  }
  if (const std::string why = lower_thread_priority(config_.priority); why.empty()) {
    if (config_.priority != FederationPriority::kNormal)
      log::info("federation: the round loop runs at --fed-priority " +
                std::string(federation_priority_name(config_.priority)));
  } else {
    log::warn("federation: --fed-priority " + std::string(federation_priority_name(config_.priority)) +
              ": the federation thread keeps its priority (" + why + ")");
  }
  name_this_thread("shmps-fed");  // placed and lowered first (threads.hpp)
  kernels::set_cpu_threads(1);    // the round's finiteness check stays on this thread, not OpenMP's
  // The group first (an elastic engine forms it), then the join: the
  // members agree on the anchor.
  publish_state(shm::FederationState::kForming);
  bool going = regroup();
  while (going) {
    // The period counts from the end of the last round: its collectives end
    // together on every host (the local merge after them takes a moment),
    // so the hosts' timers realign every round, whatever triggered a round
    // early on one of them.
    const auto deadline = Clock::now() + std::chrono::milliseconds(config_.every_ms);
    // relaxed: a flag, as in request_round().
    sleep_until(deadline, [this] { return stopping() || round_now_.load(std::memory_order_relaxed); });
    if (stopping()) break;
    round_now_.store(false, std::memory_order_relaxed);  // relaxed: as above
    switch (exchange(/*join=*/false)) {
      case Outcome::kMerged:
        break;
      case Outcome::kRegroup:
        going = regroup();
        break;
      case Outcome::kOver:
        going = false;
        break;
    }
  }
  // Stopping, or the consumer's backend failed (kOff from poll()): the
  // collective that pairs with the others' next round tells them (none
  // outside a group: before a join, or while re-forming). After the
  // engine's failure or a peer's leave (end()), or once abandoned, no
  // collective.
  // relaxed: a flag; the destructor sets only it, so the loop above ended
  // on it and this read sees it; after stop(), at worst a leave is
  // announced as stop() gives up.
  if (!abandoned_.load(std::memory_order_relaxed) && !ended_) {
    if (Status s = federator_.leave(); !s.ok()) log::warn("federation: announcing the leave: " + s.message());
  }
  set_phase(Phase::kOff);
  thread_done_.store(true, std::memory_order_release);  // SYNC(fed_done)
}

}  // namespace shmps::server
