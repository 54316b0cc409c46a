#include "sessions.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include "shmps/server/log.hpp"
#include "shmps/shm/futex.hpp"

namespace shmps::server {

using shm::Completion;
using shm::Request;
using shm::WorkerState;

Sessions::Sessions(const ServerConfig& config, shm::Segment& segment, HeldCompletions& held, WorkerLineLog& lines)
    : config_(config),
      segment_(segment),
      held_(held),
      lines_(lines),
      slots_(config.max_workers),
      attached_bits_((config.max_workers + 63) / 64, 0) {
  for (uint32_t i = 0; i < config.max_workers; ++i) reset_lanes(i);
  CPU_ZERO(&server_cpus_);
  if (sched_getaffinity(0, sizeof server_cpus_, &server_cpus_) == 0) {
    server_cpu_count_ = std::max(1, CPU_COUNT(&server_cpus_));
  } else {
    // More CPUs than a cpu_set_t names (over 1024): all of them, and every
    // worker counts as sharing them.
    CPU_ZERO(&server_cpus_);
    server_cpu_count_ = std::max(1u, std::thread::hardware_concurrency());
  }
}

bool Sessions::sync(uint32_t i) {
  WorkerSlot& slot = slots_[i];
  // acquire: SYNC(worker_claim) pairs with the claiming CAS, so the
  // claimer's pid_start_time is visible.
  const uint64_t owner = segment_.worker(i).owner.load(std::memory_order_acquire);
  if (slot.attached()) {
    if (owner == slot.owner) return true;
    end(i, "its entry was freed or overwritten by its process without a detach");
  }
  if (shm::owner_state(owner) == static_cast<uint32_t>(WorkerState::kClaimed)) attach(i, owner);
  return false;
}

// The attach handshake: a worker claims a free entry (CAS to (pid,
// kClaimed)), writes its start time and rings its doorbell. We check the
// process, reset the lane and queue indices (whatever earlier owners left
// there), issue a lease and move the owner word to (pid, kAttached) with a
// CAS; the worker waits for exactly that word (SYNC(worker_attached)).
void Sessions::attach(uint32_t i, uint64_t claimed) {
  shm::WorkerEntry& entry = segment_.worker(i);
  const pid_t pid = static_cast<pid_t>(shm::owner_pid(claimed));
  const uint64_t start = entry.pid_start_time;
  if (pid <= 0 || start == 0 || !shm::process_alive(pid, start)) return;  // not ready yet, or reaped soon
  WorkerSlot& slot = slots_[i];
  reset_lanes(i);
  uint64_t lease = (++lease_counter_ << 16) ^ (segment_.layout().generation & 0xFFFF) ^ (uint64_t{i} << 56);
  if (lease == 0) lease = 1;
  entry.lease = lease;
  // relaxed: published by the release CAS below.
  entry.pushes_applied.store(0, std::memory_order_relaxed);
  entry.pushes_rejected.store(0, std::memory_order_relaxed);
  entry.pulls.store(0, std::memory_order_relaxed);
  entry.applied_bytes.store(0, std::memory_order_relaxed);
  entry.pulls_waited.store(0, std::memory_order_relaxed);
  entry.wait_ns.store(0, std::memory_order_relaxed);
  entry.pushes_scaled.store(0, std::memory_order_relaxed);
  entry.scale_factor_sum_micro.store(0, std::memory_order_relaxed);
  entry.pulls_timed_out.store(0, std::memory_order_relaxed);
  entry.last_request_ns.store(0, std::memory_order_relaxed);  // no request of this session yet
  entry.cancel_request.store(0, std::memory_order_relaxed);   // no earlier owner's cancel
  const uint64_t attached = shm::make_owner(static_cast<uint32_t>(pid), WorkerState::kAttached);
  uint64_t expected = claimed;
  // acq_rel: SYNC(worker_attached) the release publishes the reset
  // indices and the lease to the worker that sees kAttached; fails if the
  // entry changed since we read it (then nothing is attached).
  if (!entry.owner.compare_exchange_strong(expected, attached, std::memory_order_acq_rel, std::memory_order_relaxed))
    return;
  slot.owner = attached;
  slot.lease = lease;
  attached_lanes_.push_back(i);
  attached_bits_[i / 64] |= uint64_t{1} << (i % 64);
  slot.pid_start_time = start;
  // Read once: a worker that moves later is counted where it was.
  cpu_set_t worker_cpus;
  slot.shares_cpus = true;
  if (CPU_COUNT(&server_cpus_) > 0 && sched_getaffinity(pid, sizeof worker_cpus, &worker_cpus) == 0) {
    cpu_set_t both;
    CPU_AND(&both, &worker_cpus, &server_cpus_);
    slot.shares_cpus = CPU_COUNT(&both) > 0;
  }
  slot.buffers.clear();
  slot.buffers.resize(config_.max_buffers);
  segment_.stats().workers_attached.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
  shm::notify(segment_.completions(i).data_ready);
  log(LogLevel::kInfo, "worker " + std::to_string(i) + " attached (pid " + std::to_string(pid) + ")");
}

void Sessions::end(uint32_t i, const std::string& why) {
  WorkerSlot& slot = slots_[i];
  if (!slot.attached()) return;
  if (!why.empty())
    log(LogLevel::kWarn, "worker " + std::to_string(i) + " (pid " + std::to_string(slot.pid()) + "): " + why);
  held_.orphan(i);
  close_buffers(i);
  slot.buffers.clear();
  slot.owner = 0;
  slot.lease = 0;
  slot.stopped_since_ns = 0;
  slot.held_push_at = 0;
  std::erase(attached_lanes_, i);
  attached_bits_[i / 64] &= ~(uint64_t{1} << (i % 64));
  segment_.stats().workers_attached.fetch_sub(1, std::memory_order_relaxed);  // relaxed: statistic
}

void Sessions::mark_detached(uint32_t i) {
  // Its buffers first: the worker takes kDetached (or the answer posted
  // after it) as leave to destroy its events and its caller to free the
  // memory, and CUDA IPC requires the importer to close an event or a
  // mapping before its exporter destroys or frees it (as an unregister
  // does). A mapping that device work still uses closes when that work is
  // done.
  close_buffers(i);
  uint64_t expected = slots_[i].owner;
  // SYNC(worker_detached): release pairs with the worker's acquire load of
  // owner after it reads the detach completion (published after this).
  segment_.worker(i).owner.compare_exchange_strong(expected, shm::make_owner(slots_[i].pid(), WorkerState::kDetached),
                                                   std::memory_order_release, std::memory_order_relaxed);
}

void Sessions::finish_detach(uint32_t i) {
  log(LogLevel::kInfo, "worker " + std::to_string(i) + " detached (pid " + std::to_string(slots_[i].pid()) + ")");
  end(i, "");
}

void Sessions::reset_lanes(uint32_t i) {
  // relaxed: published by the owner store that follows (release).
  segment_.lane(i).tail.store(0, std::memory_order_relaxed);
  segment_.lane(i).head.store(0, std::memory_order_relaxed);
  segment_.completions(i).tail.store(0, std::memory_order_relaxed);
  segment_.completions(i).head.store(0, std::memory_order_relaxed);
  // Both ends take slots by request id (ring.hpp, seq_published()): no id
  // of an earlier session may be left in them (a new Worker counts from 1
  // again).
  Completion* answers = segment_.completion_slots(i);
  Request* requests = segment_.lane_slots(i);
  for (uint32_t k = 0; k < config_.lane_capacity; ++k) {
    std::atomic_ref<uint64_t>(answers[k].request_id).store(0, std::memory_order_relaxed);       // relaxed: as above
    std::atomic_ref<uint64_t>(requests[k].request_id).store(0, std::memory_order_relaxed);      // relaxed: as above
    std::atomic_ref<uint64_t>(segment_.lane_stamps(i)[k]).store(0, std::memory_order_relaxed);  // relaxed: as above
  }
  WorkerSlot& slot = slots_[i];
  slot.lane = shm::SpscConsumer<Request>(&segment_.lane(i), segment_.lane_slots(i), config_.lane_capacity);
  slot.stamps = segment_.lane_stamps(i);
  slot.next_request_id = 0;
  slot.completions =
      shm::SpscProducer<Completion>(&segment_.completions(i), segment_.completion_slots(i), config_.lane_capacity);
}

void Sessions::add_buffer(uint32_t i, uint32_t id, std::unique_ptr<PeerBuffer> buffer) {
  // The deleter runs when the last holder lets go: at close_buffer(), or
  // later when device work still used it.
  shm::StatsBlock* st = &segment_.stats();
  slots_[i].buffers[id] = std::shared_ptr<PeerBuffer>(buffer.release(), [st](PeerBuffer* p) {
    delete p;
    st->mappings_closed.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
  });
  // relaxed: statistics.
  st->buffers_registered.fetch_add(1, std::memory_order_relaxed);
  st->mappings_opened.fetch_add(1, std::memory_order_relaxed);
}

void Sessions::close_buffer(uint32_t i, uint32_t id) {
  WorkerSlot& slot = slots_[i];
  if (id >= slot.buffers.size() || !slot.buffers[id]) return;
  slot.buffers[id].reset();  // the deleter counts mappings_closed once nothing holds it
  segment_.stats().buffers_registered.fetch_sub(1, std::memory_order_relaxed);  // relaxed: statistic
}

void Sessions::close_buffers(uint32_t i) {
  for (uint32_t b = 0; b < slots_[i].buffers.size(); ++b) close_buffer(i, b);
}

std::string Sessions::taken_as(const shm::ShmObject::Identity& id, uint32_t i) const {
  const auto same = [&](const shm::ShmObject& o) { return o.device() == id.device && o.inode() == id.inode; };
  if (same(segment_.object())) return "the control segment /dev/shm/" + segment_.object().name();
  for (uint32_t w : attached_lanes_) {
    if (w == i) continue;
    for (uint32_t b = 0; b < slots_[w].buffers.size(); ++b) {
      const PeerBuffer* peer = slots_[w].buffer(b);
      const shm::ShmObject* object = peer != nullptr ? peer->host_object() : nullptr;
      if (object != nullptr && same(*object))
        return "worker " + std::to_string(w) + "'s buffer " + std::to_string(b) + " (pid " +
               std::to_string(slots_[w].pid()) + ", '" + object->name() + "')";
    }
  }
  return "";
}

// Returns entry i, whose owner process is dead, to kFree as a worker gives
// its entry back: a CAS from the owner word we judged to (pid, kReleasing),
// so a claimer never loses its claim and nothing is cleared under one; the
// entry's words cleared; a CAS to kFree. SYNC(worker_release).
void Sessions::release_entry(uint32_t i, uint64_t dead_owner) {
  end(i, "");
  shm::WorkerEntry& entry = segment_.worker(i);
  shm::release_owner(entry, dead_owner, [&] {
    entry.lease = 0;
    entry.pid_start_time = 0;
    std::memset(segment_.buffer_table_bytes(i), 0, config_.max_buffers * sizeof(shm::BufferDesc));
  });
}

Sessions::Owner Sessions::reap(uint32_t i, uint64_t now, std::string* why) {
  shm::WorkerEntry& entry = segment_.worker(i);
  WorkerSlot& slot = slots_[i];
  const uint64_t owner = entry.owner.load(std::memory_order_acquire);  // SYNC(worker_claim)
  if (owner == 0) {
    if (slot.attached()) end(i, "its entry was freed without a detach");
    slot.unidentified_owner = 0;
    return Owner::kNone;
  }
  const pid_t pid = static_cast<pid_t>(shm::owner_pid(owner));
  const bool was_attached = owner == slot.owner;
  const bool releasing = shm::owner_state(owner) == static_cast<uint32_t>(WorkerState::kReleasing);
  const bool claim = !was_attached && shm::owner_state(owner) == static_cast<uint32_t>(WorkerState::kClaimed);
  // A claimer writes its start time just after its claim: until then the
  // entry may hold the one the last session's process left (it freed its
  // word without clearing it), which would judge the claimer dead. A claim
  // with that start time is judged by its pid alone. So is a word in
  // kReleasing, whose start time its holder clears.
  uint64_t start = was_attached ? slot.pid_start_time : entry.pid_start_time;
  if ((claim && start == slot.pid_start_time) || releasing) start = 0;
  const shm::ProcessState state = shm::entry_owner_state(pid, start);
  // Judged by a pid alone, a word stays "alive" as long as whatever process
  // holds that pid: it is given kUnidentifiedOwnerNs to move on.
  const bool unidentified = !was_attached && start == 0 && state == shm::ProcessState::kRunning;
  if (unidentified) {
    if (slot.unidentified_owner != owner) {
      slot.unidentified_owner = owner;
      slot.unidentified_since_ns = now;
    }
    if (now - slot.unidentified_since_ns < kUnidentifiedOwnerNs) return Owner::kLiving;
    const char* word = shm::worker_state_name(shm::owner_state(owner));
    log(LogLevel::kWarn,
        "worker " + std::to_string(i) + ": entry held as " +
            (word != nullptr ? std::string(word) : "state " + std::to_string(shm::owner_state(owner))) + " by pid " +
            std::to_string(pid) + " (a running process) with no start time to judge it by for " +
            std::to_string((now - slot.unidentified_since_ns) / 1'000'000) +
            " ms (a claimer or releaser killed in between whose pid was taken since, or a forged word); releasing it");
    slot.unidentified_owner = 0;
    release_entry(i, owner);
    return Owner::kReaped;
  }
  slot.unidentified_owner = 0;
  if (state != shm::ProcessState::kGone)
    return was_attached && stopped_too_long(i, state, now, why) ? Owner::kStopped : Owner::kLiving;
  // An owner word we do not serve that is no claim is one whose session
  // we ended (an eviction, an entry overwritten): it died after it.
  log(was_attached ? LogLevel::kWarn : LogLevel::kInfo, "worker " + std::to_string(i) + " (pid " + std::to_string(pid) +
                                                            ") died" +
                                                            (was_attached ? ""
                                                             : claim      ? " before attaching"
                                                             : releasing  ? " giving its entry back"
                                                                          : " after its session ended") +
                                                            "; releasing its entry");
  if (was_attached) segment_.stats().workers_died.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistic
  release_entry(i, owner);
  return Owner::kReaped;
}

bool Sessions::stopped_too_long(uint32_t i, shm::ProcessState state, uint64_t now, std::string* why) {
  WorkerSlot& slot = slots_[i];
  if (state != shm::ProcessState::kStopped) {
    slot.stopped_since_ns = 0;
    return false;
  }
  if (slot.stopped_since_ns == 0) slot.stopped_since_ns = now;
  const uint64_t timeout_ns = uint64_t{config_.stopped_worker_timeout_ms} * 1'000'000;
  if (timeout_ns == 0 || now - slot.stopped_since_ns < timeout_ns) return false;
  *why = "its process has been stopped (SIGSTOP, Ctrl-Z or a debugger) for " +
         std::to_string((now - slot.stopped_since_ns) / 1'000'000) + " ms (--stopped-worker-timeout-ms " +
         std::to_string(config_.stopped_worker_timeout_ms) + "); " + std::to_string(slot.lane.depth_estimate()) +
         " queued request(s) dropped unanswered";
  return true;
}

void Sessions::publish_depth() {
  uint64_t depth = 0;
  for (uint32_t i : attached_lanes_) depth += slots_[i].lane.depth_estimate();
  segment_.stats().ring_depth.store(depth, std::memory_order_relaxed);  // relaxed: statistics for readers
  note_depth(depth);
}

}  // namespace shmps::server
