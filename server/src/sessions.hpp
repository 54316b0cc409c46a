// The server's side of each worker-table entry: the attach handshake, the
// session (lease, lanes, registered buffers), its end (detach, eviction,
// death) and the reaping of dead owners. The server's own record is the
// authority: what the segment says is a claim to check against it, never a
// fact (a worker may overwrite its entry at any time). Consumer thread only.
#pragma once

#include <sched.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "held_completions.hpp"
#include "rate_log.hpp"
#include "shmps/server/config.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/ring.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::server {

// How long an owner word may name a running process without a start time
// to judge it by (a claim before its start time, a word in kReleasing, a
// word forged so) before the server frees the entry (Sessions::reap()). A
// claimer writes its start time right after its claim, and a releaser
// frees the word right after clearing it: steps a /proc read long. A word
// still so after 2 s is one no process will move on: a claimer killed in
// between whose pid was taken since, or a word forged to name a living
// process (pid 1), which would otherwise hold the entry for that process's
// life. A stopped process is not timed (it keeps its entry, as an evicted
// one does). 2 s is also well within the default 10 s connect timeout,
// which a connect finding no entry spends waiting for it.
inline constexpr uint64_t kUnidentifiedOwnerNs = 2'000'000'000;

struct WorkerSlot {
  shm::SpscConsumer<shm::Request> lane;
  const uint64_t* stamps = nullptr;  // the lane's publish_ns[] (Segment::lane_stamps): worker-written, any value
  shm::SpscProducer<shm::Completion> completions;
  // By buffer id. Shared: a request whose device work still runs holds its
  // buffer, so an unregister, detach or death closes the mapping only once
  // that work is done (the deleter counts mappings_closed then).
  std::vector<std::shared_ptr<PeerBuffer>> buffers;
  uint64_t owner = 0;  // the owner word we attached (pid, kAttached); 0: none
  uint64_t pid_start_time = 0;
  uint64_t lease = 0;
  uint64_t stopped_since_ns = 0;  // when we first saw its process stopped; 0: running
  uint64_t next_request_id = 0;   // the id after the last request taken; 0: unknown (new session)
  uint64_t held_push_at = 0;      // 1 + the lane index of the push last counted as held for a merge; 0: none
  // An owner word of the entry, not ours, judged by its pid alone and
  // found running (reap()), and when it was first seen so (monotonic ns);
  // 0: none.
  uint64_t unidentified_owner = 0;
  uint64_t unidentified_since_ns = 0;
  bool shares_cpus = true;  // its affinity mask, read at attach, meets the server's
  bool attached() const { return owner != 0; }
  uint32_t pid() const { return shm::owner_pid(owner); }
  // The registered buffer of that id, or null (unknown or out of range).
  PeerBuffer* buffer(uint32_t id) const { return id < buffers.size() ? buffers[id].get() : nullptr; }
};

class Sessions {
 public:
  Sessions(const ServerConfig& config, shm::Segment& segment, HeldCompletions& held, WorkerLineLog& lines);

  WorkerSlot& operator[](uint32_t i) { return slots_[i]; }
  const WorkerSlot& operator[](uint32_t i) const { return slots_[i]; }
  // The attached slots' indices, and the same as doorbell-word bitmaps.
  const std::vector<uint32_t>& attached_lanes() const { return attached_lanes_; }
  uint64_t attached_bits(uint32_t word) const { return attached_bits_[word]; }

  // Reconciles our record of entry i with its owner word. True when its
  // lane may be served: attached by us and unchanged. A Claimed entry gets
  // the attach handshake; an entry that changed under an attached session
  // (freed, re-claimed or overwritten by its process) ends that session.
  bool sync(uint32_t i);
  // Drops our side of an attached session (held completions, buffers,
  // counts), logging `why` unless empty; the entry's words are left as
  // they are.
  void end(uint32_t i, const std::string& why);
  // Closes worker i's buffers, then (pid, kAttached) -> (pid, kDetached),
  // by CAS: an entry that changed under us is left alone (sync() notices
  // it).
  void mark_detached(uint32_t i);
  // After a successful detach: the worker frees the entry once it has read
  // the answer; we log it and drop our side.
  void finish_detach(uint32_t i);
  // Resets entry i's lane and completion queue (indices and request ids).
  void reset_lanes(uint32_t i);

  // Adds a mapped buffer under `id` (checked free by the caller); its
  // mapping is closed, and counted, when the last holder lets go.
  void add_buffer(uint32_t i, uint32_t id, std::unique_ptr<PeerBuffer> buffer);
  void close_buffer(uint32_t i, uint32_t id);
  // What the shm object of `id` is when worker i may not register it: the
  // control segment, or a buffer another attached worker registered (worker
  // i's own may be registered again, as another window); empty otherwise.
  // A look at every registered buffer (max_workers x max_buffers at most),
  // once per registration.
  std::string taken_as(const shm::ShmObject::Identity& id, uint32_t i) const;

  enum class Owner {
    kNone,    // a free entry (a session whose entry was freed without a detach is ended)
    kReaped,  // its owner was dead, or unidentified too long: the entry is free again (its buffer objects:
              // OrphanSweeper::sweep_soon())
    kLiving,  // a living owner: its lane may be served
    kStopped  // an attached worker stopped longer than --stopped-worker-timeout-ms: evict it (*why)
  };
  // Housekeeping of entry i at `now` (monotonic ns). An owner word we do
  // not serve is judged by (pid, start time), or by its pid alone where it
  // names no start time (a claim before it, kReleasing): one whose process
  // is gone is freed, and so is one whose process runs and which stays
  // that way for kUnidentifiedOwnerNs (with a log line).
  Owner reap(uint32_t i, uint64_t now, std::string* why);
  void log(LogLevel level, const std::string& line) { lines_.write(level, line, shm::monotonic_ns()); }

  // The threads for an update of a large tensor that worker i asked for
  // (ServerConfig::apply_threads): the configured number, or for auto the
  // server's CPUs less one per other attached worker that may run on them
  // and is computing: nothing queued, and no pull held back (`held_pull(w)`,
  // PullGate::holds_pull_of: it waits on the server), at least 1. One read
  // of each attached lane's tail; no system call.
  template <class HeldPull>
  uint32_t apply_threads(uint32_t i, const HeldPull& held_pull) const {
    if (config_.apply_threads != 0) return config_.apply_threads;
    uint32_t computing = 0;
    for (uint32_t w : attached_lanes_)
      if (w != i && slots_[w].shares_cpus && slots_[w].lane.depth_estimate() == 0 && !held_pull(w)) ++computing;
    return computing < server_cpu_count_ ? server_cpu_count_ - computing : 1;
  }

  // Publishes the requests queued in all attached lanes now
  // (StatsBlock::ring_depth) and raises the high-water mark.
  void publish_depth();
  // Raises StatsBlock::ring_high_water to `depth` (a lower bound of the
  // total, e.g. one lane's) if it is above.
  void note_depth(uint64_t depth) {
    if (depth <= high_water_) return;
    high_water_ = depth;
    segment_.stats().ring_high_water.store(depth, std::memory_order_relaxed);  // relaxed: statistic
  }

 private:
  // Every buffer of worker i (the session stays): a mapping that device
  // work still uses closes when that work is done.
  void close_buffers(uint32_t i);
  void attach(uint32_t i, uint64_t claimed);
  void release_entry(uint32_t i, uint64_t dead_owner);
  // Tracks how long attached worker i's process has been stopped: true
  // past --stopped-worker-timeout-ms, with the reason in *why. A stopped
  // worker blocks nobody else (each has its own lane), but it holds its
  // entry, its buffer mappings and, in training, a version it will push late.
  bool stopped_too_long(uint32_t i, shm::ProcessState state, uint64_t now, std::string* why);

  const ServerConfig& config_;
  shm::Segment& segment_;
  HeldCompletions& held_;
  WorkerLineLog& lines_;
  std::vector<WorkerSlot> slots_;
  std::vector<uint32_t> attached_lanes_;
  std::vector<uint64_t> attached_bits_;
  uint64_t lease_counter_ = 0;
  uint64_t high_water_ = 0;  // mirror of StatsBlock::ring_high_water
  cpu_set_t server_cpus_;    // the server's affinity mask at start
  uint32_t server_cpu_count_ = 1;
};

}  // namespace shmps::server
