// FederationLink: the federation thread, and its handoff with the
// consumer thread. The thread times the rounds and runs them (Federator,
// over the engine); the weights stay the consumer's: it copies them into
// the exchange buffer when the thread asks for a snapshot, and adds the
// correction A' - S when the round is done, each between two requests.
// The phase word is the only state both threads touch; the exchange buffer
// belongs to whoever the phase says (docs/federation.md, "A round").
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
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
  // (consumer: merged); any -> kOff (thread: federation ended, for good).
  enum class Phase : uint32_t { kIdle, kWantSnapshot, kExchanging, kMergeReady, kOff };

  FederationLink(const FederationConfig& config, std::unique_ptr<FederationEngine> engine,
                 const ModelFingerprint& fingerprint, shm::StatsBlock& stats);
  ~FederationLink();  // stop(), if the server did not

  Membership membership() const noexcept { return membership_; }
  // Starts the thread at the model's `version` (the drift counts from
  // it); its first job is the join (Federator::join).
  void start(uint64_t version);

  // Consumer thread, every turn of the loop (one relaxed load when there
  // is nothing to do): takes the snapshot or merges the correction when
  // the thread asks, between two requests. `version`: the model's now.
  // True when it did either. Errors: the backend's (the caller treats them
  // as a device failure).
  Result<bool> poll(Backend& backend, uint64_t version);
  // Consumer thread: whether the lanes must wait now (a round in flight
  // without overlap, or the drift cap reached: that one also asks for a
  // round at once).
  bool holding(uint64_t version);
  // Consumer thread, every heartbeat: the drift (local updates not yet in
  // a merged round) into the stats block.
  void publish_drift(uint64_t version);

  // Consumer thread, at shutdown: asks the thread to announce its leave
  // (the collective that pairs with the others' next round) and joins it,
  // serving its snapshot and merge meanwhile. A thread stuck in a
  // collective past `timeout_ms` (a peer gone: MPI cannot cancel) is
  // reported and left behind; false then, and the engine must not be
  // finalised.
  bool stop(Backend& backend, uint64_t version, uint32_t timeout_ms);

 private:
  // Both threads: the phase, changed under mu_ so that no wait misses it.
  void set_phase(Phase p);
  Phase phase() const noexcept;
  void request_round();  // consumer: wake the timer now

  // The federation thread's.
  void thread_main();
  // Waits until the consumer moved the phase to `want`; false when the
  // link is being destroyed without a consumer (then the thread ends).
  bool wait_for(Phase want);
  // One round (or the join): asks for the snapshot, runs the Federator
  // over it, hands the correction back and waits for the merge. False when
  // federation ended (the reason logged, kOff) or the link is abandoned.
  bool exchange(bool join);
  void end(const std::string& why);  // kOff, for good, with the reason logged
  void publish(const RoundResult& r, uint64_t round_ns);

  // ---- constant after construction
  const FederationConfig config_;
  std::unique_ptr<FederationEngine> engine_;
  const Membership membership_;
  shm::StatsBlock& stats_;
  Federator federator_;

  // ---- owned by whoever `phase_` names (SYNC(fed_phase))
  std::vector<float> exchange_;
  uint64_t snapshot_updates_ = 0;  // local updates in this snapshot since the previous one

  // ---- consumer thread only
  uint64_t last_snapshot_version_ = 0;
  uint64_t snapshot_version_ = 0;
  uint64_t merged_version_ = 0;  // the snapshot version of the last merged round: drift counts from it

  // ---- both threads
  std::atomic<uint32_t> phase_{static_cast<uint32_t>(Phase::kIdle)};
  // Set under mu_; the consumer's request_round() reads it without, as a
  // hint that spares it the lock.
  std::atomic<bool> round_now_{false};  // the drift cap or every_versions asks for a round before the timer
  std::atomic<bool> thread_done_{false};
  std::mutex mu_;           // with cv_: the thread's waits (timer, phase changes, stop)
  bool stop_ = false;       // under mu_: leave, then end the thread
  bool abandoned_ = false;  // under mu_: destroyed with the thread waiting for a consumer
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace shmps::server
