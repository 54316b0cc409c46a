// Completions held back until the device work before them is done
// (backend.hpp, "Completion"): per worker, in request order, so that once
// one of a worker's completions is held every later one queues behind it.
// Device work of a session that ended while it ran (a worker died or was
// evicted mid-push) is kept as orphaned until its fence is done, holding
// its buffer mapped. The host backend never holds anything. Consumer
// thread only.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "backend.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

class HeldCompletions {
 public:
  // Device work this late means the stream is stuck.
  static constexpr uint64_t kStallNs = kDeviceStallNs;

  explicit HeldCompletions(uint32_t workers) : queues_(workers) {}

  // Whether worker i's next completion must wait: it follows device work
  // (fence != 0) or an earlier completion of i that is held.
  bool must_hold(uint32_t i, Fence fence) const { return fence != 0 || !queues_[i].empty(); }
  // Holds worker i's completion `c` behind `fence` (0: behind those of i
  // held before it only), with the buffer its device work uses.
  void hold(uint32_t i, const shm::Completion& c, Fence fence, std::shared_ptr<PeerBuffer> buffer, uint64_t now_ns);
  size_t held(uint32_t i) const { return queues_[i].size(); }
  // True when nothing is held or orphaned: nothing for the loop to poll.
  bool idle() const { return count_ == 0 && orphaned_.empty(); }
  bool any_held() const { return count_ != 0; }

  // Worker i's oldest held completion once its device work is done (a
  // fence that failed writes its error into the completion); nullopt while
  // it runs, or when none is held. Never blocks. Error (kCuda): the work has
  // not finished in kStallNs (a dead worker's event never recorded?), and
  // everything queued behind it stalls with it: the server must stop.
  Result<std::optional<shm::Completion>> pop_ready(uint32_t i, Backend& backend, uint64_t now_ns);
  // Worker i's oldest held completion, done or not (after synchronize()).
  std::optional<shm::Completion> pop_any(uint32_t i);
  // Worker i's session ended: its completions go unposted; its device work
  // still running becomes orphaned.
  void orphan(uint32_t i);
  // Lets go of the orphaned work whose fence is done (or failed). Error
  // (kCuda), as pop_ready's: orphaned work has not finished in kStallNs;
  // the stream is stuck and everything enqueued after it with it.
  Status release_finished(Backend& backend, uint64_t now_ns);
  // Shutdown: forgets everything.
  void clear();

 private:
  struct Held {
    shm::Completion completion;
    Fence fence = 0;                     // 0: ready as soon as those before it are
    std::shared_ptr<PeerBuffer> buffer;  // the buffer its device work uses
    uint64_t since_ns = 0;               // when it was held back (CLOCK_MONOTONIC)
  };
  std::vector<std::deque<Held>> queues_;  // by worker
  std::vector<Held> orphaned_;
  uint64_t count_ = 0;  // sum of the queues' sizes
};

}  // namespace shmps::server
