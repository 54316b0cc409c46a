#include "pull_gate.hpp"

#include <limits>

#include "shmps/shm/proc.hpp"

namespace shmps::server {

PullGate::PullGate(const ServerConfig& config, const Sessions& sessions, const shm::Segment& segment)
    : config_(config),
      sessions_(sessions),
      segment_(segment),
      slots_(config.max_workers),
      gating_(config.staleness_policy == shm::StalenessPolicy::kWait) {}

PullGate::Slot& PullGate::slot(uint32_t i) {
  Slot& s = slots_[i];
  const uint64_t lease = sessions_[i].attached() ? sessions_[i].lease : 0;
  if (s.lease != lease) {
    if (s.parked) {
      --parked_;
      const uint64_t now = shm::monotonic_ns();
      ended_.push_back({i, s.request, now > s.parked_at ? now - s.parked_at : 0, false, false, true, {}});
    }
    s = Slot{};
    s.lease = lease;
  }
  return s;
}

uint64_t PullGate::slowest(uint32_t* who) {
  uint64_t low = std::numeric_limits<uint64_t>::max();
  *who = std::numeric_limits<uint32_t>::max();
  for (uint32_t w : sessions_.attached_lanes()) {
    const Slot& s = slot(w);
    if (s.counts && s.clock < low) {
      low = s.clock;
      *who = w;
    }
  }
  return low;
}

void PullGate::follow_policy() {
  const bool gating = config_.staleness_policy == shm::StalenessPolicy::kWait;
  // Switched to wait (SIGHUP): the clocks drawn apart under another policy
  // start level, so that the bound holds from the switch on instead of
  // holding the fast workers until the slow ones made up the whole gap.
  if (gating && !gating_)
    for (Slot& s : slots_) s.clock = 0;
  gating_ = gating;
}

void PullGate::pushed(uint32_t i) {
  follow_policy();
  Slot& s = slot(i);
  if (!s.counts) {
    // Its first push places it at the slowest clock (1 for the first
    // worker to push), so a worker that attaches late is not behind by the
    // pushes made before it came, nor ahead of a worker of as many pushes.
    uint32_t who = 0;
    const uint64_t low = slowest(&who);
    s.clock = who == std::numeric_limits<uint32_t>::max() ? 1 : low;
    s.counts = true;
    return;
  }
  ++s.clock;
}

bool PullGate::must_wait(uint32_t i) {
  follow_policy();
  if (!gating_) return false;
  const Slot& s = slot(i);
  if (!s.counts) return false;
  uint32_t who = 0;
  const uint64_t low = slowest(&who);
  return s.clock - low > config_.max_staleness;  // low <= s.clock: i counts
}

void PullGate::park(uint32_t i, const shm::Request& req, uint64_t since) {
  Slot& s = slot(i);
  if (!s.parked) ++parked_;
  s.parked = true;
  s.request = req;
  s.parked_at = since;
}

bool PullGate::cancelled(uint32_t i) {
  const Slot& s = slot(i);
  if (!s.parked) return false;
  // relaxed: a word polled at every turn while the pull is parked; the
  // doorbell the worker rings after writing it makes a sleeping server
  // take a turn. Only compared with the id of the pull held.
  const uint64_t upto = segment_.worker(i).cancel_request.load(std::memory_order_relaxed);
  return upto != 0 && s.request.request_id <= upto;
}

std::string PullGate::holding_text(uint32_t i) {
  uint32_t who = 0;
  const uint64_t low = slowest(&who);
  return "at clock " + std::to_string(slots_[i].clock) + ", more than " + std::to_string(config_.max_staleness) +
         " ahead of worker " + std::to_string(who) + " at " + std::to_string(low);
}

void PullGate::release(uint64_t now, std::vector<Released>* out) { release_if(now, false, out); }

void PullGate::release_all(uint64_t now, std::vector<Released>* out) { release_if(now, true, out); }

void PullGate::release_if(uint64_t now, bool all, std::vector<Released>* out) {
  for (uint32_t i = 0; i < slots_.size() && parked_ != 0; ++i)
    if (slots_[i].parked) slot(i);  // a session that ended drops its pull here
  out->insert(out->end(), ended_.begin(), ended_.end());
  ended_.clear();
  for (uint32_t i = 0; i < slots_.size() && parked_ != 0; ++i) {
    if (!slots_[i].parked) continue;
    Slot& s = slots_[i];
    const uint64_t waited = now > s.parked_at ? now - s.parked_at : 0;
    const bool cancel = !all && cancelled(i);
    const bool wait = !all && !cancel && must_wait(i);
    if (wait && waited < s.request.wait_ns) continue;
    out->push_back({i, s.request, waited, wait, cancel, false, wait ? holding_text(i) : std::string()});
    s.parked = false;
    --parked_;
  }
}

}  // namespace shmps::server
