// RawClient: a client that speaks the wire protocol straight through the
// control segment, bypassing worker_lib: the "buggy or hostile process with
// write access" of the reliability tests. It claims an entry like a worker
// (CAS Free -> Claimed), may attach, and then sends any Request it is given,
// garbage included. Errors throw std::runtime_error (a test failure).
// Not thread-safe: one RawClient per thread; it owns one lane's producer end.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "shmps/shm/ring.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps::test {

class RawClient {
 public:
  // Opens "shmps.<name>" read-write and claims the first free entry with
  // this process's pid and start time. With `attach`, does the attach handshake and
  // keeps the lease. Throws when the segment cannot be opened, no entry is
  // free, or the attach is refused or unanswered within 5 s.
  explicit RawClient(const std::string& name, bool attach = true);

  shm::Segment& segment() const { return *seg_; }
  uint32_t id() const { return id_; }
  uint64_t lease() const { return lease_; }
  shm::WorkerEntry& entry() const { return seg_->worker(id_); }
  // The producer end of our lane (its tail() is the next index written).
  shm::SpscProducer<shm::Request>& lane() { return lane_; }

  // A request of opcode `op` with our worker id and lease, the rest zero.
  shm::Request request(shm::Opcode op) const;
  // Publishes `r` as is (request_id included), rings our doorbell and wakes
  // the server. False when the lane is full or its head index is corrupt.
  bool send(const shm::Request& r);
  // Pops the next completion, waiting up to `timeout`. Throws on timeout or
  // a corrupt completion queue.
  shm::Completion receive(std::chrono::milliseconds timeout = std::chrono::seconds(5));
  // send() with the next request id, then receive(); throws when the
  // completion answers another request id.
  shm::Completion call(shm::Request r, std::chrono::milliseconds timeout = std::chrono::seconds(5));
  // Frees the entry the way worker_lib does after a detach or an eviction:
  // owner to (pid, kReleasing), start time 0, then owner to kFree
  // (release). The server resets the indices at the next attach.
  void release_entry();

 private:
  std::unique_ptr<shm::Segment> seg_;
  uint32_t id_ = 0;
  uint64_t lease_ = 0;
  uint64_t next_id_ = 1;
  shm::SpscProducer<shm::Request> lane_;
  shm::SpscConsumer<shm::Completion> cq_;
};

}  // namespace shmps::test
