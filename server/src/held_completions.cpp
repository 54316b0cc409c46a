#include "held_completions.hpp"

#include <algorithm>
#include <string>

namespace shmps::server {

void HeldCompletions::hold(uint32_t i, const shm::Completion& c, Fence fence, std::shared_ptr<PeerBuffer> buffer,
                           uint64_t now_ns) {
  queues_[i].push_back({c, fence, std::move(buffer), now_ns});
  ++count_;
}

Result<std::optional<shm::Completion>> HeldCompletions::pop_ready(uint32_t i, Backend& backend, uint64_t now_ns) {
  std::deque<Held>& q = queues_[i];
  if (q.empty()) return std::optional<shm::Completion>();
  Held& h = q.front();
  if (h.fence != 0) {
    Result<bool> done = backend.fence_done(h.fence);
    if (done.ok() && !*done) {
      // A stream waiting on the event of a worker killed before its own
      // stream reached the record may wait forever: give up loudly.
      if (now_ns - h.since_ns > kStallNs)
        return Status{ErrorCode::kCuda, "device work of worker " + std::to_string(i) + " has not finished in " +
                                            std::to_string(kStallNs / 1'000'000'000) +
                                            " s (a dead worker's event never recorded?)"};
      return std::optional<shm::Completion>();
    }
    if (!done.ok()) {
      h.completion.code = static_cast<uint32_t>(done.status().code());
      shm::set_message(h.completion, done.status().message());
    }
  }
  return pop_any(i);
}

std::optional<shm::Completion> HeldCompletions::pop_any(uint32_t i) {
  std::deque<Held>& q = queues_[i];
  if (q.empty()) return std::nullopt;
  const shm::Completion c = q.front().completion;
  q.pop_front();
  --count_;
  return c;
}

void HeldCompletions::orphan(uint32_t i) {
  for (Held& h : queues_[i])
    if (h.fence != 0) orphaned_.push_back({shm::Completion{}, h.fence, std::move(h.buffer), h.since_ns});
  count_ -= queues_[i].size();
  queues_[i].clear();
}

Status HeldCompletions::release_finished(Backend& backend, uint64_t now_ns) {
  uint64_t stalled_since = now_ns;
  std::erase_if(orphaned_, [&](const Held& h) {
    Result<bool> done = backend.fence_done(h.fence);
    if (done.ok() && !*done) stalled_since = std::min(stalled_since, h.since_ns);
    return !done.ok() || *done;
  });
  if (now_ns - stalled_since > kStallNs)
    return Status{ErrorCode::kCuda, "device work of a session that ended has not finished in " +
                                        std::to_string(kStallNs / 1'000'000'000) +
                                        " s (a dead worker's event never recorded?)"};
  return Status::Ok();
}

void HeldCompletions::clear() {
  for (auto& q : queues_) q.clear();
  orphaned_.clear();
  count_ = 0;
}

}  // namespace shmps::server
