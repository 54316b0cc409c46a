// libFuzzer target: the server's request path, in process. One
// shmps::server::Server (host backend, two tiny tensors, a segment name
// unique to the process) and one raw client in worker entry 0 are set up
// once. Before each input the client's entry is brought back to a known
// state (released by the server, claimed, attached by the handshake, two
// buffers registered); then the input is read as records that the client writes
// into its own part of the segment: buffer descriptors, requests (raw, or
// with worker id, lease and sizes fixed up so that deeper paths are
// reached), pokes of its entry and indices, doorbells, and
// Server::poll_once() calls, after which its completion queue is drained.
// Checked: the server never faults (ASan+UBSan, vector annotations), and
// while the client has not lied about its indices every completion answers
// the oldest unanswered request. Single-threaded, as libFuzzer calls it.
//
// Record format (tag byte, then its payload; a short tail is zero-padded):
//   tag % 8 == 0: buffer descriptor: slot byte, 192 descriptor bytes;
//                 tag & 0x80: kind/name/length fixed up to a real object
//   1:            raw request, 64 bytes, published as is
//   2, 3:         request, 64 bytes, fixed up by the tag's bits
//   4:            entry poke: field byte, 8 value bytes
//   5:            index poke: which byte, 8 value bytes
//   6:            doorbell bits: word byte, 8 bits bytes
//   7:            poll_once() and drain
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "reader.hpp"
#include "shmps/server/server.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"

namespace {

using namespace shmps;
using fuzz::Reader;

constexpr uint32_t kEntry = 0;
constexpr uint32_t kNoSuchPid = 0x3ffffffe;  // above any pid_max: never alive
constexpr size_t kObjects = 3;               // 0 and 1 registered before each input, 2 spare
constexpr size_t kObjectBytes[kObjects] = {64, 4096, 40};

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_requests: %s\n", what);
  __builtin_trap();
}

class Harness {
 public:
  Harness() {
    remove_leftovers();
    name_ = "fuzz_req_" + std::to_string(::getpid());
    server::ServerConfig config;
    config.name = name_;
    config.tensors = {{"w", {4, 2}}, {"b", {3}}};
    config.optimizer.kind = kernels::OptimizerKind::kSgd;
    config.optimizer.lr = 0.5f;
    config.optimizer.momentum = 0.9f;
    config.max_staleness = 4;
    config.lane_capacity = 8;
    config.max_workers = 2;
    config.max_buffers = 4;
    config.backend = server::BackendKind::kHost;
    config.log_level = server::LogLevel::kError;  // rejections and evictions are the point here
    auto created = server::Server::create(config);
    if (!created.ok()) fail(created.status().to_string().c_str());
    server_ = std::move(created).value();
    auto opened = shm::Segment::open(name_, /*read_only=*/false);
    if (!opened.ok()) fail(opened.status().to_string().c_str());
    seg_ = std::move(opened).value();
    cap_ = seg_->layout().lane_capacity;
    max_buffers_ = seg_->layout().max_buffers;
    pid_ = static_cast<uint32_t>(::getpid());
    start_time_ = shm::process_start_time(::getpid());
    for (size_t k = 0; k < kObjects; ++k) {
      object_names_[k] = shm::segment_object_name(name_) + ".p" + std::to_string(pid_) + "." + std::to_string(k);
      shm::ShmObject::remove(object_names_[k]);
    }
  }

  // Objects of earlier runs that crashed (a crash skips the atexit
  // handler): "shmps.fuzz_req_<pid>[...]" of a pid that is gone.
  static void remove_leftovers() {
    const std::string prefix = "shmps.fuzz_req_";
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string file = e.path().filename().string();
      if (file.rfind(prefix, 0) != 0) continue;
      const auto pid = std::strtol(file.c_str() + prefix.size(), nullptr, 10);
      if (pid > 0 && !shm::pid_in_use(static_cast<pid_t>(pid))) shm::ShmObject::remove(file);
    }
  }

  // Unlinks what the process created: libFuzzer leaves through exit().
  void remove_names() {
    for (const auto& n : object_names_) shm::ShmObject::remove(n);
    shm::Segment::remove(name_);
  }

  void run(const uint8_t* data, size_t size) {
    reset();
    Reader in{data, size};
    for (int records = 0; !in.done() && records < 256; ++records) record(in);
    server_->poll_once();
    drain();
    server_->poll_once();
    drain();
  }

 private:
  shm::WorkerEntry& entry() const { return seg_->worker(kEntry); }
  shm::LaneHeader& lane() const { return seg_->lane(kEntry); }
  shm::LaneHeader& cq() const { return seg_->completions(kEntry); }

  void ring(uint32_t lane_index) {
    seg_->header().doorbell[lane_index / 64].fetch_or(uint64_t{1} << (lane_index % 64),
                                                      std::memory_order_seq_cst);  // SYNC(doorbell)
    shm::notify(seg_->header().server_wake);
  }

  // Publishes `r` at our tail (polling first when the lane is full).
  // False when it is still full.
  bool publish(const shm::Request& r) {
    // acquire: SYNC(slot_released), the slot we overwrite was copied out.
    if (tail_ - lane().head.load(std::memory_order_acquire) >= cap_) {
      server_->poll_once();
      drain();
      if (tail_ - lane().head.load(std::memory_order_acquire) >= cap_) return false;
    }
    seg_->lane_slots(kEntry)[tail_ % cap_] = r;
    lane().tail.store(++tail_, std::memory_order_release);  // SYNC(slot_published)
    ring(kEntry);
    if (honest_) expected_.push_back(r.request_id);
    return true;
  }

  // Pops every completion there is; checks their order while honest.
  void drain() {
    while (true) {
      const uint64_t t = cq().tail.load(std::memory_order_acquire);  // SYNC(slot_published)
      if (t == head_) return;
      if (t - head_ > cap_) {  // the server reset the queue, or a poke lied: stop checking
        honest_ = false;
        return;
      }
      const shm::Completion c = seg_->completion_slots(kEntry)[head_ % cap_];
      cq().head.store(++head_, std::memory_order_release);  // SYNC(slot_released)
      if (!honest_) continue;
      if (expected_.empty()) fail("a completion for no request");
      if (c.request_id != expected_.front()) fail("completions out of request order");
      expected_.pop_front();
    }
  }

  // Synchronous request of the setup: must succeed.
  shm::Completion setup_call(shm::Request r) {
    r.request_id = next_id_++;
    if (!publish(r)) fail("setup: lane full");
    server_->poll_once();
    const uint64_t t = cq().tail.load(std::memory_order_acquire);
    if (t != head_ + 1) fail("setup: no completion");
    const shm::Completion c = seg_->completion_slots(kEntry)[head_ % cap_];
    cq().head.store(++head_, std::memory_order_release);
    expected_.clear();
    if (c.code != 0) {
      std::fprintf(stderr, "setup request %u: %s\n", r.opcode, c.message);
      fail("setup: request refused");
    }
    return c;
  }

  void describe(uint32_t slot, size_t object) {
    shm::BufferDesc& d = seg_->buffer(kEntry, slot);
    std::memset(&d, 0, sizeof d);
    d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
    d.length = kObjectBytes[object];
    std::memcpy(d.handle, object_names_[object].c_str(), object_names_[object].size() + 1);
  }

  // The entry as a fresh worker's: released by the server (its owner made
  // a pid that is not alive), claimed, attached by the handshake, buffers 0
  // and 1 registered.
  void reset() {
    entry().owner.store(shm::make_owner(kNoSuchPid, shm::WorkerState::kClaimed), std::memory_order_release);
    seg_->header().doorbell[0].store(0, std::memory_order_relaxed);  // relaxed: the server's loop is not running
    server_->poll_once();  // housekeeping: not alive -> released, indices reset
    uint64_t expected_owner = 0;
    if (!entry().owner.compare_exchange_strong(expected_owner, shm::make_owner(pid_, shm::WorkerState::kClaimed),
                                               std::memory_order_acq_rel, std::memory_order_relaxed))
      fail("reset: the entry was not released");
    entry().pid_start_time = start_time_;
    tail_ = head_ = 0;
    honest_ = true;
    expected_.clear();
    // The buffer objects, created again when the server unlinked them (a
    // poked owner word can make it take our pid for a dead one's), with
    // finite gradients in object 0 and a NaN in object 1.
    for (size_t k = 0; k < kObjects; ++k) {
      if (!objects_[k] || ::access(("/dev/shm/" + object_names_[k]).c_str(), F_OK) != 0) {
        objects_[k].reset();
        shm::ShmObject::remove(object_names_[k]);
        auto obj = shm::ShmObject::create(object_names_[k], kObjectBytes[k], 0600);
        if (!obj.ok()) fail(obj.status().to_string().c_str());
        objects_[k] = std::move(obj).value();
      }
      auto* f = static_cast<float*>(objects_[k]->data());
      for (size_t e = 0; e < kObjectBytes[k] / sizeof(float); ++e) f[e] = 0.25f - 0.125f * static_cast<float>(e % 5);
    }
    static_cast<float*>(objects_[1]->data())[7] = __builtin_nanf("");
    // The attach handshake: ring; the server resets our indices, issues a
    // lease and moves the owner word to (pid, kAttached).
    ring(kEntry);
    server_->poll_once();
    // acquire: SYNC(worker_attached), the reset indices and the lease.
    if (entry().owner.load(std::memory_order_acquire) != shm::make_owner(pid_, shm::WorkerState::kAttached))
      fail("reset: the server did not attach the entry");
    lease_ = entry().lease;
    for (uint32_t b = 0; b < 2; ++b) {
      describe(b, b);
      shm::Request reg = request(shm::Opcode::kRegisterBuffer);
      reg.buffer_id = b;
      setup_call(reg);
    }
  }

  shm::Request request(shm::Opcode op) const {
    shm::Request r{};
    r.opcode = static_cast<uint32_t>(op);
    r.worker_id = kEntry;
    r.lease = lease_;
    return r;
  }

  uint64_t tensor_elements(uint32_t tensor_id) const {
    if (tensor_id == shm::kAllTensors) return seg_->layout().total_elements;
    if (tensor_id < seg_->layout().tensor_count) return seg_->layout().tensors[tensor_id].element_count;
    return 1;
  }

  void record(Reader& in) {
    const uint8_t tag = in.byte();
    switch (tag % 8) {
      case 0: {  // a buffer descriptor
        const uint32_t slot = in.byte() % max_buffers_;
        shm::BufferDesc& d = seg_->buffer(kEntry, slot);
        in.bytes(&d, sizeof d);
        if (tag & 0x80) {
          const size_t object = d.reserved[0] % kObjects;
          d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
          std::memset(d.handle, 0, sizeof d.handle);
          std::memcpy(d.handle, object_names_[object].c_str(), object_names_[object].size());
          if (tag & 0x40) d.length = kObjectBytes[object];
          if (tag & 0x20) d.offset %= 64;
        }
        break;
      }
      case 1: {  // a raw request
        shm::Request r;
        in.bytes(&r, sizeof r);
        publish(r);
        break;
      }
      case 2:
      case 3: {  // a request fixed up to pass the first checks
        shm::Request r;
        in.bytes(&r, sizeof r);
        r.request_id = next_id_++;
        r.worker_id = kEntry;
        if (tag & 0x80) r.lease = lease_;
        r.flags = 0;
        r.opcode = 1 + r.opcode % shm::kOpcodeMax;
        r.buffer_id %= max_buffers_ + 1;
        const uint32_t tensors[] = {0, 1, shm::kAllTensors, r.tensor_id};
        r.tensor_id = tensors[r.tensor_id % 4];
        if (tag & 0x40) r.dtype = 1 + r.dtype % shm::kDtypeMax;
        if (tag & 0x20) {
          const uint64_t esize = r.opcode == static_cast<uint32_t>(shm::Opcode::kPush) && r.dtype != 1 ? 2 : 4;
          r.byte_length = tensor_elements(r.tensor_id) * esize;
        }
        if (tag & 0x10) r.byte_offset %= 128;
        if (tag & 0x08) {
          const uint64_t v = server_->version();
          const uint64_t back = r.worker_version % 8;
          r.worker_version = back > v ? 0 : v - back;
        }
        publish(r);
        break;
      }
      case 4: {  // our entry's fields
        const uint8_t field = in.byte();
        const uint64_t value = in.value<uint64_t>();
        switch (field % 6) {
          case 0:
            entry().owner.store((uint64_t{pid_} << 32) | (value % 6), std::memory_order_release);
            break;
          case 1:
            entry().owner.store(value, std::memory_order_release);
            break;
          case 2:
            entry().lease = value;
            break;
          case 3:
            entry().pid_start_time = (value & 1) != 0 ? start_time_ : value;
            break;
          case 4:
            std::memcpy(&entry().stats_reply, &value, sizeof value);
            break;
          case 5:
            entry().pushes_applied.store(value, std::memory_order_relaxed);
            break;  // relaxed: garbage on purpose
        }
        if (field % 6 == 2) lease_ = value;  // later fixed-up requests carry it
        break;
      }
      case 5: {  // an index: after this, completions may come in any order
        const uint8_t which = in.byte();
        const uint64_t value = in.value<uint64_t>();
        const uint64_t v = (which & 4) != 0 ? value : tail_ + (value % (2 * uint64_t{cap_} + 1)) - cap_;
        honest_ = false;
        // relaxed: garbage on purpose; the release stores of the ring order nothing here.
        switch (which % 4) {
          case 0:
            tail_ = v;
            lane().tail.store(v, std::memory_order_release);
            ring(kEntry);
            break;
          case 1:
            lane().head.store(v, std::memory_order_relaxed);
            break;
          case 2:
            head_ = v;
            cq().head.store(v, std::memory_order_relaxed);
            break;
          case 3:
            cq().tail.store(v, std::memory_order_relaxed);
            break;
        }
        break;
      }
      case 6: {  // doorbells, of other lanes and past max_workers too
        const uint8_t word = in.byte();
        const uint64_t bits = in.value<uint64_t>();
        seg_->header().doorbell[word % (shm::kMaxWorkersLimit / 64)].fetch_or(bits, std::memory_order_seq_cst);
        shm::notify(seg_->header().server_wake);
        break;
      }
      case 7:
        server_->poll_once();
        drain();
        break;
    }
  }

  std::string name_;
  std::unique_ptr<server::Server> server_;
  std::unique_ptr<shm::Segment> seg_;
  std::string object_names_[kObjects];
  std::unique_ptr<shm::ShmObject> objects_[kObjects];
  uint32_t cap_ = 0, max_buffers_ = 0, pid_ = 0;
  uint64_t start_time_ = 0;
  uint64_t lease_ = 0;
  uint64_t next_id_ = 1;
  uint64_t tail_ = 0, head_ = 0;   // our lane's producer index, our queue's consumer index
  bool honest_ = true;             // no index poke since reset(): order is checked
  std::deque<uint64_t> expected_;  // request ids published and not answered yet
};

Harness* harness = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  harness = new Harness();  // lives until exit; names are unlinked at exit
  std::atexit([] { harness->remove_names(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  harness->run(data, size);
  return 0;
}
