#include "raw_client.hpp"

#include <unistd.h>

#include <stdexcept>

#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "test_support.hpp"

namespace shmps::test {

RawClient::RawClient(const std::string& name, bool attach) {
  auto s = shm::Segment::open(name, /*read_only=*/false);
  if (!s.ok()) throw std::runtime_error("RawClient: " + s.status().to_string());
  seg_ = std::move(s).value();
  const auto& h = seg_->header();
  const uint64_t claim = shm::make_owner(static_cast<uint32_t>(::getpid()), shm::WorkerState::kClaimed);
  for (id_ = 0; id_ < h.max_workers; ++id_) {
    uint64_t expected = 0;
    // acq_rel: SYNC(worker_claim), as worker_lib claims.
    if (seg_->worker(id_).owner.compare_exchange_strong(expected, claim, std::memory_order_acq_rel,
                                                        std::memory_order_relaxed))
      break;
  }
  if (id_ == h.max_workers) throw std::runtime_error("RawClient: no free worker entry");
  seg_->worker(id_).pid_start_time = shm::process_start_time(::getpid());
  lane_ = shm::SpscProducer<shm::Request>(&seg_->lane(id_), seg_->lane_slots(id_), h.lane_capacity);
  cq_ = shm::SpscConsumer<shm::Completion>(&seg_->completions(id_), seg_->completion_slots(id_), h.lane_capacity);
  if (!attach) return;
  // The attach handshake, as worker_lib does it: ring, then wait for the
  // server to turn the claim into (pid, kAttached) and to issue a lease.
  auto& hdr = seg_->header();
  hdr.doorbell[id_ / 64].fetch_or(uint64_t{1} << (id_ % 64), std::memory_order_seq_cst);  // SYNC(doorbell)
  shm::notify(hdr.server_wake);
  const uint64_t want = shm::make_owner(static_cast<uint32_t>(::getpid()), shm::WorkerState::kAttached);
  if (!eventually(
          [&] { return seg_->worker(id_).owner.load(std::memory_order_acquire) == want; },  // SYNC(worker_attached)
          std::chrono::seconds(5)))
    throw std::runtime_error("RawClient: the server did not attach this entry within 5 s");
  lease_ = seg_->worker(id_).lease;
}

shm::Request RawClient::request(shm::Opcode op) const {
  shm::Request r{};
  r.opcode = static_cast<uint32_t>(op);
  r.worker_id = id_;
  r.lease = lease_;
  return r;
}

bool RawClient::send(const shm::Request& r) {
  if (lane_.try_push(r) != shm::RingResult::kOk) return false;
  auto& h = seg_->header();
  h.doorbell[id_ / 64].fetch_or(uint64_t{1} << (id_ % 64), std::memory_order_seq_cst);  // SYNC(doorbell)
  shm::notify(h.server_wake);
  return true;
}

shm::Completion RawClient::receive(std::chrono::milliseconds timeout) {
  shm::Completion c{};
  shm::RingResult r = shm::RingResult::kEmpty;
  eventually([&] { return (r = cq_.try_pop(&c)) != shm::RingResult::kEmpty; }, timeout);
  if (r == shm::RingResult::kEmpty) throw std::runtime_error("RawClient: no completion within the timeout");
  if (r == shm::RingResult::kCorrupt) throw std::runtime_error("RawClient: completion queue indices are corrupt");
  return c;
}

shm::Completion RawClient::call(shm::Request r, std::chrono::milliseconds timeout) {
  r.request_id = next_id_++;
  if (!send(r)) throw std::runtime_error("RawClient: request lane full or corrupt");
  const shm::Completion c = receive(timeout);
  if (c.request_id != r.request_id)
    throw std::runtime_error("RawClient: completion for request " + std::to_string(c.request_id) + ", expected " +
                             std::to_string(r.request_id));
  return c;
}

void RawClient::release_entry() {
  shm::WorkerEntry& e = seg_->worker(id_);
  shm::release_owner(e, e.owner.load(std::memory_order_relaxed),  // relaxed: the CAS decides
                     [&] { e.pid_start_time = 0; });
}

}  // namespace shmps::test
