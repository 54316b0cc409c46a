// --staleness-policy wait: stale synchronous parallel (SSP, Petuum's
// Bösen). Each worker's clock counts its applied pushes; a pull by a worker
// more than max_staleness clocks ahead of the slowest worker is held back
// (parked) until the slowest catches up, that worker stops counting (it
// detached, died or was evicted), the policy changes, or the pull's own
// wait (Request::wait_ns) runs out, or its worker cancels it
// (WorkerEntry::cancel_request: its wait was interrupted). While its pull
// is parked, the rest of that worker's lane waits behind it (requests are
// served in order).
// docs/design.md, "Staleness policies". Consumer thread only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sessions.hpp"
#include "shmps/server/config.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {

class PullGate {
 public:
  PullGate(const ServerConfig& config, const Sessions& sessions, const shm::Segment& segment);

  // Worker i's push was applied: its clock advances (its first places it
  // at the slowest clock), and it counts toward the slowest from now on.
  void pushed(uint32_t i);
  // True when a pull by worker i must be held back now.
  bool must_wait(uint32_t i);
  // Holds worker i's pull `req`, published at `since` (its wait counts
  // from then: the worker's own deadline runs from its submit).
  void park(uint32_t i, const shm::Request& req, uint64_t since);
  bool parked(uint32_t i) { return slot(i).parked; }  // false once its session ended
  // Whether worker i's session (attached now) has a pull held: the worker
  // waits on the server. No bookkeeping, so a const caller may ask.
  bool holds_pull_of(uint32_t i) const {
    return slots_[i].parked && sessions_[i].attached() && slots_[i].lease == sessions_[i].lease;
  }
  // Worker i's parked pull is one its worker withdrew: its id is at most
  // WorkerEntry::cancel_request.
  bool cancelled(uint32_t i);
  // True while a pull is held, or one dropped with its session is still to
  // be counted by release().
  bool any_parked() const { return parked_ != 0 || !ended_.empty(); }
  // The pulls held now (one of a session that ended counts until the gate
  // next looks at its worker's slot).
  uint32_t parked_count() const { return parked_; }

  // A parked pull whose wait ended.
  struct Released {
    uint32_t worker;
    shm::Request request;
    uint64_t waited_ns;
    bool timed_out;  // its wait_ns ran out first: answer kTimeout with `why`
    bool cancelled;  // its worker gave up waiting: answer kInterrupted
    // Its session ended first (the worker detached, died or was evicted):
    // counted as waited, answered to nobody (worker i may be another now).
    bool ended;
    // "at clock 4, more than 2 ahead of worker 0 at 1": it fits a
    // completion's message (63 characters) for clocks below 10^7.
    std::string why;
  };
  // The parked pulls that may go on at `now` (appended to *out), and those
  // dropped with their session since the last call (`ended`).
  void release(uint64_t now, std::vector<Released>* out);
  // Every parked pull of a live session, whatever its wait (shutdown), and
  // as release(), those dropped with their session (`ended`).
  void release_all(uint64_t now, std::vector<Released>* out);

 private:
  struct Slot {
    uint64_t lease = 0;  // the session the clock belongs to (0: none yet)
    uint64_t clock = 0;
    bool counts = false;  // has pushed in this session
    bool parked = false;
    shm::Request request{};
    uint64_t parked_at = 0;
  };
  // Worker i's slot, reset when its session is not the one it was kept for:
  // a new session starts at the slowest counting clock and counts from its
  // first push, so a joining worker (or one that only pulls, an evaluator)
  // holds nobody back.
  Slot& slot(uint32_t i);
  // The slowest counting worker's clock and index (UINT32_MAX: none).
  uint64_t slowest(uint32_t* who);
  std::string holding_text(uint32_t i);
  // Notes a switch of the policy (a reload) into wait: the clocks restart
  // level there.
  void follow_policy();
  void release_if(uint64_t now, bool all, std::vector<Released>* out);

  const ServerConfig& config_;
  const Sessions& sessions_;
  const shm::Segment& segment_;
  std::vector<Slot> slots_;
  uint32_t parked_ = 0;
  std::vector<Released> ended_;  // dropped by slot() with their session, for release()
  bool gating_;                  // the policy was wait when last looked at
};

}  // namespace shmps::server
