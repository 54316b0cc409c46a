// FederationLink: the federation thread, and its handoff with the
// consumer thread. The thread times the rounds and runs them (Federator,
// over the engine); the weights stay the consumer's: it copies them into
// the exchange buffer when the thread asks for a snapshot, and adds the
// correction A' - S when the round is done, each between two requests.
// The phase word and a few flags are what both threads share; the
// exchange buffer belongs to whoever the phase says (docs/federation.md,
// "A round"). While serving, the consumer takes no lock the thread holds:
// the thread may run at a lowered priority (--fed-priority), and a lock it
// held while preempted would stall serving.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "federation.hpp"
#include "shmps/server/federation.hpp"
#include "shmps/shm/layout.hpp"

namespace shmps::server {

class FederationLink {
 public:
  // Who owns the exchange buffer, and what the consumer should do next.
  // kIdle -> kWantSnapshot (thread) -> kExchanging (consumer: snapshot
  // taken) -> kMergeReady (thread: correction computed) -> kIdle
  // (consumer: merged); or kExchanging -> kDiscarded (thread: the round
  // was abandoned, the group re-forms) -> kIdle (consumer); any -> kOff (federation ended, for good:
  // the thread's end, or the consumer's backend failed).
  enum class Phase : uint32_t { kIdle, kWantSnapshot, kExchanging, kMergeReady, kDiscarded, kOff };
  // What poll() did.
  enum class Polled { kNothing, kSnapshot, kMerge, kDiscard };

  // `stats`: the segment's stats block; `consumer_wake`: the word the
  // consumer sleeps on (the segment's server_wake), notified whenever the
  // thread hands it work.
  FederationLink(const FederationConfig& config, std::unique_ptr<FederationEngine> engine,
                 const ModelFingerprint& fingerprint, shm::StatsBlock& stats, shm::WaitWord& consumer_wake);
  // Joins a thread that never ran a collective or waits for a consumer
  // that is gone, then closes the engine (logged where that waits for the
  // other members: FederationEngine::close_waits_for_every_member()); after
  // a stop() that returned false the link must be leaked instead (its
  // thread may still be inside a collective).
  ~FederationLink();

  Membership membership() const noexcept { return membership_; }
  // Before start(): resume from the state a checkpoint stored with the
  // weights the server restored, `weights` (Federator::restore()).
  Status restore(FederationState state, std::vector<float> weights = {});
  // Before start(): the weights are those of a checkpoint without
  // federation state (`checkpoint` names it). The join that replaces them
  // (with rank 0's weights, or the group's anchor) says so in a warning.
  void restored_without_state(std::string checkpoint) { unfederated_checkpoint_ = std::move(checkpoint); }
  // Starts the thread at the model's `version` (the drift counts from
  // it); its first job is the join (Federator::join).
  void start(uint64_t version);

  // Consumer thread, every turn of the loop (one relaxed load when there
  // is nothing to do): takes the snapshot or merges the correction when
  // the thread asks, between two requests. `version`: the model's now.
  // Errors: the backend's (the caller treats them as a device failure);
  // federation then ends here, and the thread tells the others it leaves.
  Result<Polled> poll(Backend& backend, uint64_t version);
  // Consumer thread: whether the thread waits for poll() (for the idle
  // loop's decision to sleep). Acquire, as a stop flag is read.
  bool wants_consumer() const noexcept;
  // Whether federation is over, for good (kOff): the host serves alone.
  bool off() const noexcept { return phase() == Phase::kOff; }
  // Consumer thread: whether a push must wait now (a round in flight
  // without overlap, or the drift cap reached: that one also asks for a
  // round at once). Other requests never wait. A hold lasts at most
  // hold_limit_ms() (a host that hangs keeps a round open for as long as
  // the engine lets it, MPI's for ever): then pushes are served until the
  // next merge, logged once, since local training must not stop because a
  // remote host did (the merge keeps what they applied, as with overlap).
  bool holding_pushes(uint64_t version);
  // Two of the group's longest periods plus the engine's timeout.
  uint64_t hold_limit_ms() const noexcept;
  // The group's longest round period (ours until the join tells it).
  uint32_t group_period_ms() const noexcept;
  // Consumer thread: the federation's state as of the weights now (the
  // model at `version`), for a checkpoint (none before the join, unless
  // restored). False while a round is between its snapshot and its merge,
  // or the thread is still ending: the weights and the anchor do not match
  // then; try later.
  bool checkpoint_state(uint64_t version, std::optional<FederationState>* out) const;
  // Consumer thread, every heartbeat: the drift (local updates not yet in
  // a merged round) into the stats block.
  void publish_drift(uint64_t version);

  // Consumer thread, at shutdown: asks the thread to announce its leave
  // (the collective that pairs with the others' next round) and joins it,
  // serving its snapshot and merge meanwhile. A thread still inside a
  // collective after stop_bound() (a peer gone: MPI cannot cancel) is
  // reported and left behind, never touching the stats block again; false
  // then: leak the link, and with it the engine (not finalised). *merges:
  // the rounds merged meanwhile (they change the weights, not the version).
  bool stop(Backend& backend, uint64_t version, uint64_t* merges);
  // How long stop() may wait for the thread before leaving it behind: two
  // of the group's longest periods plus 5 s, and two engine timeouts more
  // where the engine re-forms groups (a settle, agreement and rendezvous).
  std::chrono::milliseconds stop_bound() const;

 private:
  // Both threads: the phase; every change wakes the thread, and the phases
  // that hand the consumer work (the thread's) also wake the consumer.
  void set_phase(Phase p);
  Phase phase() const noexcept;
  void request_round();  // consumer: wake the timer now

  // The federation thread's.
  void thread_main();
  // How a round (or a join) ended.
  enum class Outcome {
    kMerged,   // the consumer merged its correction
    kRegroup,  // abandoned (the engine failed, a host left or waits to join): an elastic engine re-forms
    kOver,     // federation ended, or the link is stopping or abandoned
  };
  // One round (or the join): asks for the snapshot, runs the Federator
  // over it, hands the correction back and waits for the merge.
  Outcome exchange(bool join);
  // The join over a checkpoint older than the group's round: logs the
  // local updates it kept (RoundResult::restored_drift_rebased) or dropped
  // (restored_drift_dropped), and whether the record shows the
  // checkpoint's merged.
  void log_restored_drift(const RoundResult& r) const;
  // Hands an abandoned round's snapshot back (kDiscarded) and waits for
  // the consumer to take it.
  Outcome discard();
  // An elastic engine: forms a group (reform()), trying again until one
  // forms or the link stops (false); paused meanwhile without a majority.
  bool form_group();
  // Forms a group where the engine can and joins it, again after a join
  // the group's change abandoned. False when federation is over.
  bool regroup();
  // Consumer: the thread must not touch the consumer's side again.
  void abandon();
  // Either thread: stop() or abandon() was called.
  bool stopping() const noexcept;
  // The thread: sleeps on thread_wake_ until ready() or `deadline`; true
  // when ready().
  bool sleep_until(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& ready);
  // Waits until the consumer moved the phase to `want`; false when it
  // ended federation instead (kOff) or the link is abandoned.
  bool wait_for(Phase want);
  // Runs `update` on the stats block unless the link was abandoned (the
  // segment may be unmapped then). True when it ran.
  template <class F>
  bool with_stats(F update);
  void end(const std::string& why);  // kOff, for good, with the reason logged
  // StatsBlock::fed_state (and 0 members outside a group).
  void publish_state(shm::FederationState state);
  void publish(const RoundResult& r, uint64_t round_ns);

  // ---- constant after construction
  const FederationConfig config_;
  std::unique_ptr<FederationEngine> engine_;
  const Membership membership_;
  shm::StatsBlock& stats_;  // only through with_stats() on the thread
  shm::WaitWord& consumer_wake_;
  Federator federator_;

  // ---- the federation thread's
  bool ended_ = false;  // end() ran: federation is over without a leave to announce
  // Local updates in the snapshots since the last merged round: a round
  // abandoned, or a join, merges none of them (they stay in W - A).
  uint64_t unmerged_updates_ = 0;
  // Of the unmerged local updates restored, those in the restore base's
  // drift (restore(); written before start() only: checkpoint_state()
  // reads it too).
  uint64_t restored_unmerged_ = 0;
  // restored_without_state()'s checkpoint, until the first join that
  // went through ("": none).
  std::string unfederated_checkpoint_;

  // ---- owned by whoever `phase_` names (SYNC(fed_phase))
  std::vector<float> exchange_;
  uint64_t snapshot_updates_ = 0;  // local updates in this snapshot since the previous one
  // Of the local updates up to this snapshot, those the merge keeps in
  // W - A' (in no merged round: a join that keeps the drift); 0 after a
  // round. The drift counts them (merged_version_).
  uint64_t merge_kept_updates_ = 0;

  // ---- consumer thread only
  uint64_t last_snapshot_version_ = 0;
  uint64_t snapshot_version_ = 0;
  // The drift counts from it: the snapshot version of the last merged
  // round, less the local updates of that snapshot the merge kept (and,
  // before the first merge, the version at start() less a restored
  // checkpoint's unmerged updates).
  uint64_t merged_version_ = 0;
  uint64_t merges_ = 0;         // rounds merged by poll()
  uint64_t hold_since_ns_ = 0;  // when the current hold of pushes began; 0: none
  // merges_ when a hold past hold_limit_ms() was lifted: pushes are not
  // held again before the next merge. UINT64_MAX: none lifted.
  uint64_t lifted_at_merges_ = UINT64_MAX;

  // ---- both threads
  std::atomic<uint32_t> phase_{static_cast<uint32_t>(Phase::kIdle)};
  // The drift cap or every_versions asks for a round before the timer: set
  // by request_round(), cleared by the thread as the timer fires and by the
  // consumer as it takes a snapshot.
  std::atomic<bool> round_now_{false};
  std::atomic<bool> thread_done_{false};
  std::atomic<uint32_t> group_every_ms_{0};  // the group's longest period, once joined (stop()'s timeout)
  // Joined to a group now (an elastic one re-forming or paused is not):
  // the drift cap holds pushes only then, since only a group's merge
  // releases them.
  std::atomic<bool> in_group_{false};
  std::atomic<bool> stop_{false};  // leave, then end the thread
  // The thread must not touch the consumer's side again (the segment may
  // be unmapped): set under mu_, which the thread holds while it touches
  // the segment; the consumer takes mu_ only to set it.
  std::atomic<bool> abandoned_{false};
  std::mutex mu_;
  // The thread sleeps on it (timer, phase changes, stop); process-local.
  shm::WaitWord thread_wake_{{0}, {0}};
  std::thread thread_;
};

}  // namespace shmps::server
