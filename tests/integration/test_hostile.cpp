// Hostile or broken input: a process with write access to the control
// segment writes random bytes into everything of its own the server reads
// (its lane's slots and indices, its completion queue's indices, its worker
// entry, its buffer descriptors, its wait words) and rings doorbells of
// lanes it does not own, while well-behaved workers push and pull. The
// server must validate every field, reject and count, keep serving the
// others without a stall, and never crash or touch memory out of bounds
// (run this under the asan preset: the server binary is instrumented too).
// Besides the random run, one case per hole found by reading the server.
#define BOOST_TEST_MODULE test_hostile
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "raw_client.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/ring.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/unique_fd.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

constexpr int kGoodWorkers = 2;

// Shared between the test and its children (MAP_SHARED, anonymous).
struct Shared {
  std::atomic<uint64_t> stop;
  std::atomic<uint64_t> hostile_done;
  std::atomic<uint64_t> hostile_iterations;
  std::atomic<uint64_t> hostile_rebirths;  // entry released by the server and claimed anew
  std::atomic<uint64_t> acked[kGoodWorkers];
  std::atomic<uint64_t> pulls[kGoodWorkers];
  std::atomic<uint64_t> errors;
  std::atomic<uint64_t> torn;            // a pull whose weight != its version
  std::atomic<uint64_t> max_latency_ns;  // of one push or pull
  char first_error[256];
};

using test::connect;

// One tensor of one element, lr 1, gradient -1: the weight counts the
// applied pushes, so weight == version in every pull and at the end.
const std::vector<std::string> kCounting = {
    "--tensor",        "w:1",        "--tensor",      "b:3", "--lr",          "1",
    "--max-staleness", "4000000000", "--max-workers", "6",   "--max-buffers", "4",
    "--ring-capacity", "8"};

// A well-behaved worker: pushes -1 into tensor 0 and pulls it, measuring
// each call, until told to stop. Exit 0 unless it could not start.
int good_worker(const std::string& name, Shared* shared, int index) {
  WorkerOptions o;
  o.name = name;
  auto w = Worker::connect(o);
  if (!w.ok()) return 2;
  auto grad = (*w)->register_buffer(4);
  auto out = (*w)->register_buffer(4);
  if (!grad.ok() || !out.ok()) return 3;
  *static_cast<float*>(grad->data) = -1.0f;
  const auto fail = [&](const Status& s) {
    if (shared->errors.fetch_add(1) == 0)
      std::snprintf(shared->first_error, sizeof shared->first_error, "worker %d: %s", index, s.to_string().c_str());
  };
  const auto timed = [&](auto&& call) {
    const uint64_t t0 = shm::monotonic_ns();
    auto r = call();
    const uint64_t dt = shm::monotonic_ns() - t0;
    uint64_t seen = shared->max_latency_ns.load();
    while (dt > seen && !shared->max_latency_ns.compare_exchange_weak(seen, dt)) {
    }
    return r;
  };
  for (uint64_t n = 0; shared->stop.load() == 0; ++n) {
    auto v = timed([&] { return (*w)->push(0, grad->id, 0, 4, Dtype::kF32, 0); });
    if (!v.ok()) {
      fail(v.status());
      continue;
    }
    shared->acked[index].fetch_add(1);
    if (n % 4 != 0) continue;
    auto pv = timed([&] { return (*w)->pull(0, out->id, 0); });
    if (!pv.ok()) {
      fail(pv.status());
      continue;
    }
    shared->pulls[index].fetch_add(1);
    if (*static_cast<const float*>(out->data) != static_cast<float>(*pv)) shared->torn.fetch_add(1);
  }
  return 0;
}

// The hostile process: claims an entry like a worker, then for `duration` (at
// most `max_iterations` steps) writes random or half-plausible bytes into
// its own lane, queue, entry and buffer table and rings doorbells. It never
// creates a shm object, so no push of it can be valid: every applied
// gradient comes from a good worker.
int hostile_writer(const std::string& name, uint64_t seed, std::chrono::milliseconds duration, uint64_t max_iterations,
                   Shared* shared) {
  // Claimed, not attached (no handshake yet): the first "attached" state
  // may well be forged.
  test::RawClient raw(name, /*attach=*/false);
  shm::Segment& seg = raw.segment();
  const uint32_t id = raw.id();
  const auto& h = seg.header();
  const uint32_t cap = h.lane_capacity;
  const uint32_t max_buffers = h.max_buffers;
  const auto pid = static_cast<uint32_t>(::getpid());
  const uint64_t start_time = shm::process_start_time(::getpid());
  shm::LaneHeader& lane = seg.lane(id);
  shm::Request* slots = seg.lane_slots(id);
  shm::LaneHeader& cq = seg.completions(id);
  shm::WorkerEntry& entry = seg.worker(id);
  std::mt19937_64 rng(seed);
  const auto fill = [&](void* p, size_t n) {
    auto* b = static_cast<unsigned char*>(p);
    for (size_t k = 0; k < n; ++k) b[k] = static_cast<unsigned char>(rng());
  };
  const auto pick = [&](uint64_t n) { return rng() % n; };
  const auto ring = [&] { test::ring_doorbell(seg, id); };
  // Half of the runs start by claiming to be attached without an attach.
  if (pick(2) == 0) entry.owner.store(shm::make_owner(pid, shm::WorkerState::kAttached), std::memory_order_release);
  // Our own view of the tail; resynchronised from the segment now and then.
  uint64_t tail = raw.lane().tail();
  // A forged index (0: none) and the server's value it replaced.
  uint64_t cq_tail_forged = 0, lane_head_forged = 0;
  uint64_t cq_tail_true = 0, lane_head_true = 0;
  // Buffer objects are "shmps.<name>.p<pid>.<n>"; we create none.
  const std::string prefix = shm::segment_object_name(name) + ".p";
  const auto deadline = std::chrono::steady_clock::now() + duration;
  uint64_t it = 0;
  // Most steps send a half-plausible request from a state the server may
  // accept (deep paths), drain the queue or re-attach; one in 33 lies
  // about something else.
  // Puts back what the server itself stored and we overwrote (its lane
  // head, its queue tail), half of the time, unless it stored anew since.
  const auto restore = [&] {
    if (pick(2) == 0) return;
    // relaxed: these are the server's own values, put back as they were.
    if (cq_tail_forged != 0 && cq.tail.load(std::memory_order_relaxed) == cq_tail_forged)
      cq.tail.store(cq_tail_true, std::memory_order_relaxed);
    if (lane_head_forged != 0 && lane.head.load(std::memory_order_relaxed) == lane_head_forged)
      lane.head.store(lane_head_true, std::memory_order_relaxed);
    cq_tail_forged = lane_head_forged = 0;
  };
  // Claims the entry again (over whatever state it is in) and rings: the
  // attach handshake, after which the server has reset our indices to 0.
  const auto reattach = [&] {
    entry.pid_start_time = start_time;
    entry.owner.store(shm::make_owner(pid, shm::WorkerState::kClaimed), std::memory_order_release);
    ring();
    tail = 0;
    cq_tail_forged = lane_head_forged = 0;
  };
  // When nothing was answered for a while (the server stopped serving us,
  // or we lost track of its indices), play dead: an owner pid that does not
  // exist makes the server release the entry and reset every index, and we
  // claim it anew from zero.
  uint64_t seen_cq_tail = cq.tail.load(std::memory_order_relaxed);  // relaxed: a progress hint
  auto last_progress = std::chrono::steady_clock::now();
  uint64_t rebirths = 0;
  const auto play_dead = [&] {
    constexpr uint32_t kNoSuchPid = 0x3ffffffe;  // above any pid_max
    entry.owner.store(shm::make_owner(kNoSuchPid, shm::WorkerState::kClaimed), std::memory_order_release);
    if (!test::eventually([&] { return entry.owner.load(std::memory_order_acquire) == 0; }, 500ms)) return;
    ++rebirths;
    uint64_t expected = 0;
    const uint64_t next = pick(4) == 0
                              ? shm::make_owner(pid, shm::WorkerState::kAttached)  // skip the handshake: just say so
                              : shm::make_owner(pid, shm::WorkerState::kClaimed);
    entry.pid_start_time = start_time;
    if (!entry.owner.compare_exchange_strong(expected, next, std::memory_order_acq_rel, std::memory_order_relaxed))
      return;
    cq_tail_forged = lane_head_forged = 0;
    tail = 0;
    ring();
  };
  for (; it < max_iterations && std::chrono::steady_clock::now() < deadline; ++it) {
    if (it % 64 == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (const uint64_t t = cq.tail.load(std::memory_order_relaxed); t != seen_cq_tail) {  // relaxed: a hint
        seen_cq_tail = t;
        last_progress = now;
      } else if (now - last_progress > 20ms) {
        play_dead();
        last_progress = std::chrono::steady_clock::now();
      }
    }
    if (it % 16 == 15) std::this_thread::sleep_for(50us);  // leave the CPUs to the others now and then
    const uint64_t roll = pick(100);
    if (roll < 80) {  // a half-plausible request, published
      shm::Request r{};
      fill(&r, sizeof r);
      r.request_id = it;
      if (pick(16) != 0) r.worker_id = id;
      if (pick(8) != 0) r.lease = entry.lease;
      r.opcode = static_cast<uint32_t>(pick(10));
      // A granted detach leaves the server expecting us to reset our
      // indices; mostly ask for something else, to stay served.
      if (r.opcode == static_cast<uint32_t>(shm::Opcode::kDetach) && pick(8) != 0)
        r.opcode = static_cast<uint32_t>(shm::Opcode::kPing);
      if (pick(8) != 0) r.flags = 0;
      if (pick(4) != 0) r.buffer_id = static_cast<uint32_t>(pick(max_buffers + 2));
      const uint32_t tensors[] = {0, 1, shm::kAllTensors, 7, r.tensor_id};
      r.tensor_id = tensors[pick(5)];
      const uint64_t lengths[] = {4, 12, 16, 8, 2, r.byte_length};
      r.byte_length = lengths[pick(6)];
      if (pick(4) != 0) r.byte_offset = pick(64);
      if (pick(4) != 0) r.worker_version = pick(3);
      if (pick(4) != 0) r.dtype = static_cast<uint32_t>(pick(5));
      // Follow the indices the server may have reset (release, re-attach),
      // and mostly respect back-pressure, so the lane stays servable.
      if (pick(2) != 0) tail = lane.tail.load(std::memory_order_relaxed);  // relaxed: our own field
      const uint64_t head = lane.head.load(std::memory_order_acquire);     // SYNC(slot_released)
      if (tail - head > cap && pick(4) != 0) tail = head;  // our garbage tail: start over from the server's head
      if (tail - head >= cap && pick(64) != 0) {
        cq.head.store(cq.tail.load(std::memory_order_acquire), std::memory_order_release);
        continue;
      }
      slots[tail % cap] = r;
      lane.tail.store(++tail, std::memory_order_release);  // SYNC(slot_published)
      ring();
      continue;
    }
    if (roll < 94) {  // read the completion queue properly (after putting a forged tail back)
      restore();
      cq.head.store(cq.tail.load(std::memory_order_acquire), std::memory_order_release);  // SYNC(slot_released)
      continue;
    }
    if (roll < 97) {  // once evicted or released: attach again, or just claim to be attached
      const uint64_t attached = shm::make_owner(pid, shm::WorkerState::kAttached);
      if (entry.owner.load(std::memory_order_acquire) == attached) continue;
      if (pick(2) != 0)
        reattach();
      else
        entry.owner.store(attached, std::memory_order_release);
      continue;
    }
    switch (pick(10)) {
      case 0:  // random bytes into a random slot
        fill(&slots[pick(cap)], sizeof(shm::Request));
        break;
      case 1: {  // lane indices: the producer's tail, even the consumer's head
        const uint64_t choices[] = {rng(), tail + pick(2 * cap + 2), tail - pick(4), lane.head.load()};
        tail = choices[pick(4)];
        if (pick(8) == 0) {
          if (lane_head_forged == 0)
            lane_head_true = lane.head.load(std::memory_order_relaxed);  // relaxed: a value to put back
          lane_head_forged = rng() | 1;
          lane.head.store(lane_head_forged, std::memory_order_relaxed);  // relaxed: garbage on purpose
        }
        lane.tail.store(tail, std::memory_order_release);
        ring();
        break;
      }
      case 2: {  // the completion queue's indices (the true tail is kept, to put back later)
        const uint64_t t = cq.tail.load(std::memory_order_acquire);
        const uint64_t choices[] = {rng(), t - pick(2 * cap), t + pick(4)};
        cq.head.store(choices[pick(3)], std::memory_order_release);
        if (pick(4) == 0) {
          if (cq_tail_forged == 0) cq_tail_true = t;
          cq_tail_forged = rng() | 1;
          cq.tail.store(cq_tail_forged, std::memory_order_relaxed);  // relaxed: garbage on purpose
        }
        break;
      }
      case 3: {  // the owner word: any state, any pid
        const uint32_t pids[] = {pid, pid, 0, 1, static_cast<uint32_t>(rng()), static_cast<uint32_t>(::getppid())};
        const uint64_t owner = pick(6) == 0 ? rng() : (uint64_t{pids[pick(6)]} << 32) | pick(6);
        entry.owner.store(owner, std::memory_order_release);
        ring();
        break;
      }
      case 4: {  // lease and start time
        if (pick(2) != 0) entry.lease = rng();
        const uint64_t starts[] = {0, start_time, rng()};
        entry.pid_start_time = starts[pick(3)];
        break;
      }
      case 5: {  // the server's counters and the stats reply area
        fill(&entry.stats_reply, sizeof entry.stats_reply);
        entry.pushes_applied.store(rng(), std::memory_order_relaxed);  // relaxed: garbage on purpose
        entry.last_request_ns.store(rng(), std::memory_order_relaxed);
        fill(entry.reserved0, sizeof entry.reserved0);
        // relaxed: garbage on purpose (the server reads it only for a pull it
        // holds under --staleness-policy wait: test_staleness).
        entry.cancel_request.store(pick(2) != 0 ? rng() : pick(64), std::memory_order_relaxed);
        break;
      }
      case 6: {  // a buffer descriptor: garbage, or a name of the right shape for no object
        shm::BufferDesc& d = seg.buffer(id, static_cast<uint32_t>(pick(max_buffers)));
        fill(&d, sizeof d);
        if (pick(2) != 0) {
          d.kind = static_cast<uint32_t>(pick(4));
          const std::string names[] = {prefix + std::to_string(pid) + ".nosuch" + std::to_string(pick(100)),
                                       shm::segment_object_name(name), prefix + "1.0", "../../etc/passwd",
                                       std::string(63, 'x')};
          const std::string& n = names[pick(5)];
          std::memcpy(d.handle, n.c_str(), n.size() + 1);
          d.offset = pick(3) == 0 ? rng() : pick(64);
          d.length = pick(3) == 0 ? rng() : pick(4096);
        }
        break;
      }
      case 7: {  // our wait words
        fill(&lane.data_ready, sizeof lane.data_ready);
        fill(&cq.space_ready, sizeof cq.space_ready);
        shm::notify(cq.data_ready);
        ring();
        break;
      }
      case 8: {  // doorbells of lanes that are not ours, past max_workers too
        seg.header().doorbell[pick(shm::kMaxWorkersLimit / 64)].fetch_or(rng() & rng(), std::memory_order_seq_cst);
        shm::notify(seg.header().server_wake);
        break;
      }
      default:
        ring();
        break;
    }
  }
  shared->hostile_iterations.store(it);
  shared->hostile_rebirths.store(rebirths);
  return 0;
}

// The address space process `pid` has mapped (VmSize), in KiB; 0 when
// it cannot be read.
uint64_t mapped_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7));
  return 0;
}

// A shm object of `bytes` made as cheaply as any local user can:
// ftruncate alone, so a tmpfs object of terabytes holds no page. With
// `at`, `value` is written there (that page alone is filled).
void make_sparse_object(const std::string& object, uint64_t bytes, uint64_t at = 0, const void* value = nullptr,
                        size_t value_bytes = 0) {
  const int fd = ::shm_open(object.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  BOOST_REQUIRE_MESSAGE(fd >= 0, object << ": " << std::strerror(errno));
  const bool sized = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0;
  const bool written =
      value_bytes == 0 || ::pwrite(fd, value, value_bytes, static_cast<off_t>(at)) == static_cast<ssize_t>(value_bytes);
  ::close(fd);
  BOOST_REQUIRE_MESSAGE(sized && written, object << ": " << std::strerror(errno));
}

// Registers [offset, offset + length) of `object` as raw's buffer `id`.
shm::Completion register_window(test::RawClient& raw, uint32_t id, const std::string& object, uint64_t offset,
                                uint64_t length) {
  shm::BufferDesc& d = raw.segment().buffer(raw.id(), id);
  std::memset(&d, 0, sizeof d);
  d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
  d.offset = offset;
  d.length = length;
  std::snprintf(reinterpret_cast<char*>(d.handle), sizeof d.handle, "%s", object.c_str());
  shm::Request r = raw.request(shm::Opcode::kRegisterBuffer);
  r.buffer_id = id;
  return raw.call(r);
}

// Removes the named shm objects at scope exit, whatever a check left.
struct ObjectsRemoved {
  std::vector<std::string> names;
  ~ObjectsRemoved() {
    for (const std::string& n : names) shm::ShmObject::remove(n);
  }
};

uint64_t sum_rejected(const shm::StatsBlock& s) {
  uint64_t n = 0;
  for (const auto& r : s.rejected) n += r.load();
  return n;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(hostile)

BOOST_AUTO_TEST_CASE(random_writes_into_own_entry_lane_and_queue_hurt_nobody_else) {
  uint64_t seed = 20261130;
  if (const char* env = std::getenv("SHMPS_HOSTILE_SEED")) seed = std::strtoull(env, nullptr, 0);
  BOOST_TEST_MESSAGE("hostile seed " << seed << " (set SHMPS_HOSTILE_SEED to replay)");
  test::ServerProcess server(test::unique_name("hostile"), kCounting);
  Shared* shared = test::map_shared<Shared>();
  std::vector<test::Process> good;
  for (int i = 0; i < kGoodWorkers; ++i)
    good.push_back(test::Process::fork_fn([&, i] { return good_worker(server.name(), shared, i); }));
  BOOST_REQUIRE(test::eventually([&] { return shared->acked[0].load() > 50 && shared->acked[1].load() > 50; }));

  auto evil = test::Process::fork_fn([&] { return hostile_writer(server.name(), seed, 2500ms, 2'000'000, shared); });
  BOOST_TEST(evil.wait(20s) == 0);
  std::this_thread::sleep_for(200ms);  // the good ones keep going past the hostile's exit
  shared->stop.store(1);
  for (auto& p : good) BOOST_TEST(p.wait(20s) == 0);
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");

  const uint64_t acked = shared->acked[0].load() + shared->acked[1].load();
  BOOST_TEST_MESSAGE("hostile iterations " << shared->hostile_iterations.load() << " (entry reclaimed "
                                           << shared->hostile_rebirths.load() << " times), good pushes " << acked
                                           << ", pulls " << shared->pulls[0].load() + shared->pulls[1].load()
                                           << ", max latency " << shared->max_latency_ns.load() / 1000 << " us");
  BOOST_TEST(shared->hostile_iterations.load() > 1000u);
  BOOST_TEST(shared->errors.load() == 0u, shared->first_error);
  BOOST_TEST(shared->torn.load() == 0u);
  BOOST_TEST(shared->max_latency_ns.load() < 1'000'000'000u,
             "a good worker waited " << shared->max_latency_ns.load() / 1'000'000 << " ms");

  // The server counted what it refused, and works for a newcomer.
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  const shm::StatsBlock& st = (*seg)->stats();
  BOOST_TEST_MESSAGE("rejected " << sum_rejected(st) << ", lanes_corrupt " << st.lanes_corrupt.load() << ", requests "
                                 << st.requests.load());
  BOOST_TEST(sum_rejected(st) > 0u);
  BOOST_TEST(st.lanes_corrupt.load() > 0u);
  auto w = connect(server.name(), 3s);
  BOOST_TEST(w->ping().ok());
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE_MESSAGE(buf.ok(), buf.status().to_string());
  uint64_t version = 0;
  auto v = w->pull(0, buf->id, 0);
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  version = *v;
  // Only the good workers' pushes were applied, each exactly once.
  BOOST_TEST(version == acked);
  BOOST_TEST(*static_cast<const float*>(buf->data) == static_cast<float>(acked));
  BOOST_TEST(st.gradients_applied.load() == acked);
  ::munmap(shared, sizeof(Shared));
}

// An entry whose owner word says kAttached although the server never
// attached it (no handshake): its requests must not be served, and those
// that name buffers above all (the server set none up for it). Either no
// answer or an error is fine; a success or a dead server is not.
BOOST_AUTO_TEST_CASE(forged_attached_state_is_refused) {
  test::ServerProcess server(test::unique_name("forged"), kCounting);
  test::RawClient raw(server.name(), /*attach=*/false);
  raw.entry().lease = 42;
  raw.entry().owner.store(shm::make_owner(static_cast<uint32_t>(::getpid()), shm::WorkerState::kAttached));
  uint64_t sent = 0;
  for (const shm::Opcode op : {shm::Opcode::kPing, shm::Opcode::kRegisterBuffer, shm::Opcode::kUnregisterBuffer,
                               shm::Opcode::kPush, shm::Opcode::kPull, shm::Opcode::kStats, shm::Opcode::kDetach}) {
    shm::Request r = raw.request(op);
    r.request_id = ++sent;
    r.lease = 42;
    r.byte_length = 4;
    r.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    BOOST_REQUIRE(raw.send(r));
  }
  std::this_thread::sleep_for(300ms);  // several housekeeping sweeps
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
  for (uint64_t n = 0; n < sent; ++n) {
    shm::Completion c{};
    try {
      c = raw.receive(0ms);
    } catch (const std::exception&) {
      break;  // not served: fine
    }
    BOOST_TEST(c.code != 0u, "request " << c.request_id << " (opcode " << c.opcode << ") of a forged entry was served");
  }
  auto w = connect(server.name(), 3s);
  BOOST_TEST(w->ping().ok());
}

// A peer writes another living process's attached word over a worker's entry:
// the server ends that session (the word is not the one it attached), and
// the worker sees its session over at its next call, kUnknownWorker at
// once, not a timeout waiting for an answer that never comes.
BOOST_AUTO_TEST_CASE(an_attached_word_of_another_pid_written_over_a_workers_entry_ends_its_session) {
  test::ServerProcess server(test::unique_name("overwr"), kCounting);
  auto w = connect(server.name(), 3s);
  BOOST_REQUIRE(w->ping().ok());
  auto seg = shm::Segment::open(server.name(), /*read_only=*/false);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  // A living process's word, with its start time: the server leaves the
  // entry to it (as to any living claimer), so the word stays.
  shm::WorkerEntry& entry = (*seg)->worker(w->worker_id());
  entry.pid_start_time = shm::process_start_time(::getppid());
  entry.owner.store(shm::make_owner(static_cast<uint32_t>(::getppid()), shm::WorkerState::kAttached));
  const auto start = std::chrono::steady_clock::now();
  const Status s = w->ping();
  BOOST_TEST(s.code() == ErrorCode::kUnknownWorker, s.to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - start < 1s));
}

// A worker evicted for corrupt indices frees its entry as worker_lib does
// (indices 0, owner kFree); the next worker to claim that entry must be
// served, not judged by the evicted worker's indices.
BOOST_AUTO_TEST_CASE(entry_freed_after_an_eviction_serves_the_next_worker) {
  test::ServerProcess server(test::unique_name("reuse"), {"--tensor", "w:1", "--max-workers", "1"});
  {
    test::RawClient raw(server.name());
    for (int i = 0; i < 5; ++i) BOOST_REQUIRE(raw.call(raw.request(shm::Opcode::kPing)).code == 0u);
    raw.segment().lane(raw.id()).tail.store(raw.lane().tail() + 1000);
    raw.segment().header().doorbell[0].fetch_or(1);
    shm::notify(raw.segment().header().server_wake);
    BOOST_REQUIRE(test::eventually([&] {
      return shm::owner_state(raw.entry().owner.load()) == static_cast<uint32_t>(shm::WorkerState::kDetached);
    }));
    raw.release_entry();
  }
  WorkerOptions o;
  o.name = server.name();
  o.timeout = 3s;
  auto w = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  BOOST_TEST((*w)->ping().ok());
}

// The server takes a request whose id is the one after the last before its
// tail arrives (ring.hpp, seq_published()). A worker that reuses an id must
// not make it take the stale slots behind: after a full ring of pings with
// ids 1..cap, a ping that reuses id 1 leaves slot 1 holding id 2 from the
// first round at the head, the id that would come next. Every published
// request gets exactly one answer (fuzz_requests found the replay).
BOOST_AUTO_TEST_CASE(reused_request_id_does_not_replay_stale_slots) {
  test::ServerProcess server(test::unique_name("replay"),
                             {"--tensor", "w:1", "--max-workers", "1", "--ring-capacity", "8"});
  test::RawClient raw(server.name());
  const uint32_t cap = raw.segment().layout().lane_capacity;
  BOOST_REQUIRE(cap == 8u);
  for (uint32_t i = 0; i < cap; ++i) BOOST_REQUIRE(raw.call(raw.request(shm::Opcode::kPing)).code == 0u);
  shm::Request again = raw.request(shm::Opcode::kPing);
  again.request_id = 1;  // slot 0's id, of the first round
  BOOST_REQUIRE(raw.send(again));
  const shm::Completion c = raw.receive();
  BOOST_TEST(c.request_id == 1u);
  // Nothing else was published: nothing else may be answered.
  std::this_thread::sleep_for(200ms);
  const auto& cq = raw.segment().completions(raw.id());
  BOOST_TEST(cq.tail.load() == cq.head.load(),
             "answers to requests never published: " << cq.tail.load() - cq.head.load());
  BOOST_TEST(raw.call(raw.request(shm::Opcode::kPing)).code == 0u);
}

// An attached worker that zeroes its own owner word and leaves: the entry
// looks free; the next claimer must be served from a clean state.
BOOST_AUTO_TEST_CASE(entry_zeroed_by_its_owner_serves_the_next_worker) {
  test::ServerProcess server(test::unique_name("zeroed"), {"--tensor", "w:1", "--max-workers", "1"});
  auto evil = test::Process::fork_fn([&] {
    test::RawClient raw(server.name());
    for (int i = 0; i < 5; ++i)
      if (raw.call(raw.request(shm::Opcode::kPing)).code != 0) return 2;
    raw.entry().owner.store(0);
    return 0;
  });
  BOOST_REQUIRE(evil.wait(10s) == 0);
  WorkerOptions o;
  o.name = server.name();
  o.timeout = 3s;
  auto w = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  BOOST_TEST((*w)->ping().ok());
  auto s = (*w)->stats();
  BOOST_REQUIRE(s.ok());
  BOOST_TEST(s->workers_attached == 1u);
}

// The same, with the next claimer stopped between its claim and writing
// its start time (worker_lib's window, held open by a fault point): the
// entry still holds the start time the zeroing process left, which must
// not get the living claimer judged dead and its claim freed.
BOOST_AUTO_TEST_CASE(a_start_time_left_in_a_zeroed_entry_does_not_free_the_next_claim) {
  test::ServerProcess server(test::unique_name("leftstart"), {"--tensor", "w:1", "--max-workers", "1"});
  auto evil = test::Process::fork_fn([&] {
    test::RawClient raw(server.name());
    if (raw.call(raw.request(shm::Opcode::kPing)).code != 0) return 2;
    raw.entry().owner.store(0);  // its start time stays in the entry
    return 0;
  });
  BOOST_REQUIRE(evil.wait(10s) == 0);
  auto segment = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(segment.ok(), segment.status().to_string());
  const shm::WorkerEntry& entry = (*segment)->worker(0);
  BOOST_REQUIRE(entry.pid_start_time != 0u);
  BOOST_REQUIRE(test::eventually([&] { return (*segment)->stats().workers_attached.load() == 0u; }));
  auto claimer = test::Process::fork_fn([&] {
    ::setenv("SHMPS_FAULT", "after_claim:1:stop", 1);
    return test::try_connect(server.name(), 5s) ? 0 : 1;
  });
  BOOST_REQUIRE(test::eventually([&] { return test::process_state(claimer.pid()) == 'T'; }, 5s));
  const uint64_t claim = shm::make_owner(static_cast<uint32_t>(claimer.pid()), shm::WorkerState::kClaimed);
  BOOST_REQUIRE(entry.owner.load() == claim);
  std::this_thread::sleep_for(300ms);  // several housekeeping passes judge the claim
  BOOST_TEST(entry.owner.load() == claim, "the living claimer's entry was freed");
  claimer.resume();
  BOOST_TEST(claimer.wait(10s) == 0);  // attached
}

// A claim whose start time never comes (forged to name a living process,
// here pid 1, or left by a claimer killed between its claim and its start
// time whose pid was taken since), and a word left in kReleasing naming a
// living process, can only be judged by the pid: alive for that process's
// life. The server frees such a word after kUnidentifiedOwnerNs (2 s), so
// a connect to a one-entry server, which waits for the entry, gets it.
BOOST_AUTO_TEST_CASE(a_word_with_no_start_time_naming_a_living_process_is_freed_after_a_bound) {
  for (const shm::WorkerState forged : {shm::WorkerState::kClaimed, shm::WorkerState::kReleasing}) {
    BOOST_TEST_CONTEXT("(pid 1, " << shm::worker_state_name(static_cast<uint32_t>(forged)) << ")") {
      test::ServerProcess server(test::unique_name("nostart"), {"--tensor", "w:1", "--max-workers", "1"});
      auto forger = test::Process::fork_fn([&] {
        auto seg = shm::Segment::open(server.name(), /*read_only=*/false);
        if (!seg.ok()) return 2;
        uint64_t expected = 0;
        if (!(*seg)->worker(0).owner.compare_exchange_strong(expected, shm::make_owner(1, forged))) return 3;
        test::ring_doorbell(**seg, 0);
        return 0;
      });
      BOOST_REQUIRE(forger.wait(10s) == 0);
      const auto t0 = std::chrono::steady_clock::now();
      auto w = Worker::connect(test::worker_options(server.name(), 8s, false));
      const auto took = std::chrono::steady_clock::now() - t0;
      BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
      BOOST_TEST((took < 5s),
                 "connected after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
      BOOST_TEST((*w)->ping().ok());
    }
  }
}

// A claim freed under its worker before the server attached it (by the
// server, which found no start time of its to judge it by, or by a peer):
// the entry is not the worker's any more, and its attach must claim one
// again rather than wait for the word it will never see. The worker is
// held between its claim and its start time (a fault point) while its
// claim is freed.
BOOST_AUTO_TEST_CASE(a_worker_whose_claim_is_freed_before_the_attach_claims_again) {
  test::ServerProcess server(test::unique_name("lostclaim"), {"--tensor", "w:1", "--max-workers", "1"});
  auto claimer = test::Process::fork_fn([&] {
    ::setenv("SHMPS_FAULT", "after_claim:1:stop", 1);
    auto w = test::try_connect(server.name(), 5s);
    return w && w->ping().ok() ? 0 : 1;
  });
  BOOST_REQUIRE(test::eventually([&] { return test::process_state(claimer.pid()) == 'T'; }, 5s));
  auto segment = shm::Segment::open(server.name(), /*read_only=*/false);
  BOOST_REQUIRE_MESSAGE(segment.ok(), segment.status().to_string());
  shm::WorkerEntry& entry = (*segment)->worker(0);
  const uint64_t claim = shm::make_owner(static_cast<uint32_t>(claimer.pid()), shm::WorkerState::kClaimed);
  uint64_t expected = claim;
  BOOST_REQUIRE(entry.owner.compare_exchange_strong(expected, 0));
  claimer.resume();
  BOOST_TEST(claimer.wait(10s) == 0, "the worker did not attach after its claim was freed");
}

// A registered buffer is shared memory the worker still controls: a worker
// that shrinks the object after registration must get an error, not kill
// the server with SIGBUS when it reads the gradient.
BOOST_AUTO_TEST_CASE(buffer_truncated_after_registration_does_not_kill_the_server) {
  // The host backend's SIGBUS guard (the CUDA backend pins host buffers
  // with cudaHostRegister: a truncation cannot take their pages away).
  std::vector<std::string> args = kCounting;
  args.insert(args.end(), {"--backend", "host"});
  test::ServerProcess server(test::unique_name("trunc"), args);
  test::RawClient raw(server.name());
  // Named as worker_lib names buffers: "shmps.<name>.p<pid>.<n>".
  const std::string object = shm::buffer_object_name(server.name(), ::getpid(), 0);
  auto obj = shm::ShmObject::create(object, 4096, 0600);
  BOOST_REQUIRE(obj.ok());
  shm::BufferDesc& d = raw.segment().buffer(raw.id(), 0);
  d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
  d.length = 4096;
  std::snprintf(reinterpret_cast<char*>(d.handle), sizeof d.handle, "%s", object.c_str());
  BOOST_REQUIRE(raw.call(raw.request(shm::Opcode::kRegisterBuffer)).code == 0u);
  static_cast<float*>((*obj)->data())[0] = -1.0f;
  const int fd = ::shm_open(object.c_str(), O_RDWR, 0);
  BOOST_REQUIRE(fd >= 0);
  BOOST_REQUIRE(::ftruncate(fd, 0) == 0);
  ::close(fd);
  shm::ShmObject::remove(object);
  shm::Request r = raw.request(shm::Opcode::kPush);
  r.byte_length = 4;
  r.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
  try {
    const shm::Completion c = raw.call(r, 2s);
    BOOST_TEST(c.code != 0u, "a push from a truncated buffer was applied");
  } catch (const std::exception& e) {
    BOOST_TEST(false, e.what());
  }
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died reading a truncated buffer");
  auto w = connect(server.name(), 3s);
  BOOST_TEST(w->ping().ok());
}

// A worker that registers a buffer and shrinks its object before each
// push, over and over, gets each push refused and the buffer dropped; the
// server's log takes that as any rejection, at most one line per cause a
// second (naming the buffer), the rest counted: the lines and the counts
// account for every drop, and the journal is not flooded.
BOOST_AUTO_TEST_CASE(buffers_dropped_again_and_again_do_not_flood_the_log) {
  constexpr int kDrops = 300;
  const std::string name = test::unique_name("dropflood");
  test::TempDir dir("dropflood");
  const std::string log_path = (dir.path / "server.log").string();
  test::ServerProcess server(name, {"--tensor", "w:4", "--lr", "1", "--backend", "host"}, log_path);
  test::RawClient raw(server.name());
  const std::string object = shm::buffer_object_name(server.name(), ::getpid(), 1);
  ObjectsRemoved objects{{object}};
  const UniqueFd fd(::shm_open(object.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
  BOOST_REQUIRE(fd.fd >= 0);
  const auto started = std::chrono::steady_clock::now();
  for (int k = 0; k < kDrops; ++k) {
    BOOST_REQUIRE(::ftruncate(fd.fd, 8192) == 0);
    BOOST_REQUIRE_EQUAL(register_window(raw, 0, object, 0, 16).code, 0u);
    BOOST_REQUIRE(::ftruncate(fd.fd, 0) == 0);
    shm::Request push = raw.request(shm::Opcode::kPush);
    push.byte_length = 16;
    push.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    const shm::Completion c = raw.call(push);
    BOOST_REQUIRE_MESSAGE(c.code == static_cast<uint32_t>(ErrorCode::kBadRange), "push " << k << ": " << c.message);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  BOOST_REQUIRE_EQUAL(server.stop(), 0);  // its last counts are written as it stops

  const std::string text = test::read_file(log_path);
  const std::regex counted(
      R"((?:\(\+(\d+) more 'bad_range' since the last report\))|(?:(\d+) more 'bad_range' rejections in the last))");
  const std::string rejection = "rejected push from worker 0 (pid " + std::to_string(::getpid()) +
                                "): bad_range: buffer 0: the buffer object shrank under the server (SIGBUS); dropped";
  uint64_t lines = 0, drop_lines = 0, rejection_lines = 0, suppressed = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find("shrank") != std::string::npos) ++drop_lines;
    if (line.find(rejection) != std::string::npos) ++rejection_lines;
    for (auto it = std::sregex_iterator(line.begin(), line.end(), counted); it != std::sregex_iterator(); ++it)
      suppressed += std::stoull((*it)[1].matched ? (*it)[1].str() : (*it)[2].str());
    ++lines;
  }
  BOOST_TEST(drop_lines >= 1u, text);
  BOOST_TEST(rejection_lines == drop_lines, "each line about a drop is its rejection's, naming the buffer:\n" << text);
  BOOST_TEST(drop_lines <= static_cast<uint64_t>(seconds) + 2,
             drop_lines << " lines about dropped buffers for " << kDrops << " drops in " << seconds << " s");
  BOOST_TEST(drop_lines + suppressed == uint64_t{kDrops}, text);
  BOOST_TEST(lines < 40u, text);
}

// Any process that may write the segment can make a shm object of
// terabytes for free (ftruncate of a tmpfs file) and describe a few bytes
// of it. The server maps the window a descriptor names, not the object:
// 16 such registrations of 16 bytes of 8 TiB objects (128 TiB in all, the
// whole of a 47-bit address space) leave its address space about as it
// was, each window reads the bytes at its offset, and a worker's
// registrations of 1 MiB go on working.
BOOST_AUTO_TEST_CASE(a_window_of_a_huge_sparse_object_maps_the_window_alone) {
  constexpr uint32_t kHuge = 16;
  constexpr uint64_t kObjectBytes = uint64_t{8} << 40;
  test::ServerProcess server(test::unique_name("huge"), {"--tensor", "w:4", "--lr", "1", "--max-staleness",
                                                         "4000000000", "--max-buffers", std::to_string(kHuge)});
  test::RawClient raw(server.name());
  const pid_t server_pid = server.process().pid();
  const uint64_t before_kib = mapped_kib(server_pid);
  BOOST_REQUIRE(before_kib != 0);
  ObjectsRemoved objects;
  const float gradient[4] = {-1.0f, -1.0f, -1.0f, -1.0f};
  for (uint32_t b = 0; b < kHuge; ++b) {
    objects.names.push_back(shm::buffer_object_name(server.name(), ::getpid(), b + 1));
    // Near the end, across a page boundary: 8 bytes before one, 8 after.
    const uint64_t offset = kObjectBytes - 4096 * (b + 2) - 8;
    make_sparse_object(objects.names.back(), kObjectBytes, offset, gradient, sizeof gradient);
    const shm::Completion c = register_window(raw, b, objects.names.back(), offset, sizeof gradient);
    BOOST_REQUIRE_MESSAGE(c.code == 0u, "window " << b << " of an 8 TiB object: " << c.message);
  }
  const uint64_t grown_kib = mapped_kib(server_pid) - before_kib;
  BOOST_TEST(grown_kib < uint64_t{1} << 20,
             "the server's address space grew by " << grown_kib << " KiB for " << kHuge << " windows of 16 bytes");
  // Each window is the bytes at its offset: 16 pushes of -1 make weights of 16.
  for (uint32_t b = 0; b < kHuge; ++b) {
    shm::Request r = raw.request(shm::Opcode::kPush);
    r.buffer_id = b;
    r.byte_length = sizeof gradient;
    r.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    const shm::Completion c = raw.call(r);
    BOOST_TEST(c.code == 0u, "push from window " << b << ": " << c.message);
  }
  auto w = connect(server.name(), 3s);
  for (int n = 0; n < 3; ++n) {
    auto buf = w->register_buffer(size_t{1} << 20);
    BOOST_REQUIRE_MESSAGE(buf.ok(), "a worker's registration of 1 MiB: " << buf.status().to_string());
    BOOST_REQUIRE(w->pull(0, buf->id, 0).ok());
    const auto* weights = static_cast<const float*>(buf->data);
    BOOST_TEST(weights[0] == float{kHuge});
    BOOST_TEST(weights[3] == float{kHuge});
  }
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
}

// The windows a descriptor names cost their maker nothing, but the server
// maps each: a worker's registered buffers span at most
// --max-worker-buffer-bytes (auto: 8 x the model's fp32 bytes, at least
// 1 GiB). A registration past it is kNoCapacity naming the option and the
// numbers, and registers nothing; an unregister gives its bytes back. Six
// hostile processes filling their budgets with windows of an 8 TiB object
// (without the budget: the server's whole address space, after which no
// buffer could be registered) leave room for another worker's buffer,
// which it registers, pushes from and pulls into.
BOOST_AUTO_TEST_CASE(a_workers_buffers_stay_within_its_budget_and_leave_room_for_the_others) {
  constexpr uint64_t kObjectBytes = uint64_t{8} << 40;
  constexpr uint64_t kBudget = uint64_t{1} << 30;  // auto for a model of 16 bytes
  constexpr int kHostile = 6;
  test::ServerProcess server(test::unique_name("budget"), {"--tensor", "w:4", "--lr", "1", "--max-staleness",
                                                           "4000000000", "--max-workers", "8", "--max-buffers", "16"});
  const pid_t server_pid = server.process().pid();
  const uint64_t before_kib = mapped_kib(server_pid);
  BOOST_REQUIRE(before_kib != 0);
  ObjectsRemoved objects;
  test::RawClient raw(server.name());
  objects.names.push_back(shm::buffer_object_name(server.name(), ::getpid(), 1));
  const std::string object = objects.names.back();
  make_sparse_object(object, kObjectBytes);
  const auto refused = [&](uint32_t id, uint64_t length, uint64_t registered) {
    const shm::Completion c = register_window(raw, id, object, 0, length);
    BOOST_TEST(c.code == static_cast<uint32_t>(ErrorCode::kNoCapacity), "a window of " << length << ": " << c.message);
    // The answer's message is its first 63 bytes (the server's log has it whole).
    const std::string whole = "past --max-worker-buffer-bytes " + std::to_string(kBudget) + ": " +
                              std::to_string(registered) + " B registered + " + std::to_string(length) +
                              " B; nothing registered (unregister a buffer, or raise the option)";
    BOOST_TEST(std::string(c.message) == whole.substr(0, sizeof c.message - 1));
    shm::Request pull = raw.request(shm::Opcode::kPull);
    pull.buffer_id = id;
    pull.byte_length = 16;
    pull.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    const shm::Completion pulled = raw.call(pull);
    BOOST_TEST(pulled.code == static_cast<uint32_t>(ErrorCode::kUnknownBuffer), "pull: " << pulled.message);
  };
  refused(0, kObjectBytes, 0);
  BOOST_REQUIRE_EQUAL(register_window(raw, 0, object, 0, kBudget / 2).code, 0u);
  BOOST_REQUIRE_EQUAL(register_window(raw, 1, object, kBudget, kBudget / 2).code, 0u);
  refused(2, 1, kBudget);
  shm::Request unregister = raw.request(shm::Opcode::kUnregisterBuffer);
  unregister.buffer_id = 0;
  BOOST_REQUIRE_EQUAL(raw.call(unregister).code, 0u);
  refused(2, kBudget / 2 + 1, kBudget / 2);
  BOOST_REQUIRE_EQUAL(register_window(raw, 2, object, 0, kBudget / 2).code, 0u);

  // Five more such processes, each as greedy as it can be: up to 16
  // windows, from the whole object down, the length halved after each
  // refusal; past the first refusal a length that does not divide the
  // budget (an eighth of it and a page), so that several windows fill it.
  struct Filled {
    std::atomic<uint32_t> done;
    std::atomic<uint64_t> bytes[kHostile];
    std::atomic<uint32_t> windows[kHostile];
  };
  auto* filled = test::map_shared<Filled>();
  std::vector<test::Process> hostile;
  for (int h = 1; h < kHostile; ++h) {
    hostile.push_back(test::Process::fork_fn([&, h] {
      test::RawClient greedy(server.name());
      const std::string own = shm::buffer_object_name(server.name(), ::getpid(), 1);
      const int fd = ::shm_open(own.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(kObjectBytes)) != 0) return 2;
      ::close(fd);
      uint64_t length = kObjectBytes, total = 0;
      uint32_t b = 0;
      while (b < 16 && length >= 4096) {
        if (register_window(greedy, b, own, 0, length).code == 0) {
          total += length;
          ++b;
        } else {
          length = length == kObjectBytes ? kBudget / 8 + 4096 : length / 2;
        }
      }
      filled->bytes[h].store(total);
      filled->windows[h].store(b);
      filled->done.fetch_add(1);
      while (true) ::pause();
    }));
    objects.names.push_back(shm::buffer_object_name(server.name(), hostile.back().pid(), 1));
  }
  BOOST_REQUIRE(test::eventually([&] { return filled->done.load() == uint32_t{kHostile - 1}; }, 60s));
  for (int h = 1; h < kHostile; ++h) {
    BOOST_TEST(filled->bytes[h].load() <= kBudget, "hostile " << h);
    BOOST_TEST(filled->bytes[h].load() > kBudget - kBudget / 16, "hostile " << h << " filled its budget");
    BOOST_TEST(filled->windows[h].load() > 8u, "hostile " << h << " registered several windows");
  }
  const uint64_t grown_kib = mapped_kib(server_pid) - before_kib;
  BOOST_TEST(grown_kib < (kHostile + 1) * (kBudget >> 10), "the server's address space grew by "
                                                               << grown_kib << " KiB for " << kHostile << " budgets of "
                                                               << kBudget << " bytes");

  // Another worker, in a process of its own, registers, pushes and pulls.
  auto honest = test::Process::fork_fn([&] {
    auto w = Worker::connect(test::worker_options(server.name(), 5s, false));
    if (!w.ok()) return 2;
    auto buf = (*w)->register_buffer(size_t{1} << 20);
    if (!buf.ok()) {
      std::fprintf(stderr, "honest register_buffer(1 MiB): %s\n", buf.status().to_string().c_str());
      return 3;
    }
    std::fill_n(static_cast<float*>(buf->data), 4, -1.0f);
    if (!(*w)->push(0, buf->id, 0, 16, Dtype::kF32, 0).ok()) return 4;
    auto v = (*w)->pull(0, buf->id, 0);
    return v.ok() && *v == 1u && static_cast<const float*>(buf->data)[0] == 1.0f ? 0 : 5;
  });
  BOOST_TEST(honest.wait(20s) == 0);
  for (auto& p : hostile) p.kill_and_reap();
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
}

// Two descriptors name two windows of one object, neither at a page
// boundary: a pull writes its window and no byte beside it, a push reads
// its own, and a shrink of the object under the second window is caught
// by the guard (the push refused, the server alive).
BOOST_AUTO_TEST_CASE(two_windows_of_one_object_each_read_and_write_their_own_bytes) {
  test::ServerProcess server(test::unique_name("windows"),
                             {"--tensor", "w:4", "--lr", "1", "--max-staleness", "4000000000", "--backend", "host"});
  test::RawClient raw(server.name());
  const std::string object = shm::buffer_object_name(server.name(), ::getpid(), 1);
  ObjectsRemoved objects{{object}};
  constexpr size_t kBytes = 4 * 4096;
  constexpr uint64_t kPullAt = 12, kPushAt = 2 * 4096 - 8;
  auto obj = shm::ShmObject::create(object, kBytes, 0600);
  BOOST_REQUIRE(obj.ok());
  auto* bytes = static_cast<unsigned char*>((*obj)->data());
  std::memset(bytes, 0x5a, kBytes);
  const float gradient[4] = {-1.0f, -2.0f, -3.0f, -4.0f};
  std::memcpy(bytes + kPushAt, gradient, sizeof gradient);
  BOOST_REQUIRE_EQUAL(register_window(raw, 0, object, kPullAt, sizeof gradient).code, 0u);
  BOOST_REQUIRE_EQUAL(register_window(raw, 1, object, kPushAt, sizeof gradient).code, 0u);
  shm::Request push = raw.request(shm::Opcode::kPush);
  push.buffer_id = 1;
  push.byte_length = sizeof gradient;
  push.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
  BOOST_REQUIRE_EQUAL(raw.call(push).code, 0u);
  shm::Request pull = raw.request(shm::Opcode::kPull);
  pull.buffer_id = 0;
  pull.byte_length = sizeof gradient;
  pull.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
  BOOST_REQUIRE_EQUAL(raw.call(pull).code, 0u);
  float pulled[4];
  std::memcpy(pulled, bytes + kPullAt, sizeof pulled);
  BOOST_TEST(pulled[0] == 1.0f);
  BOOST_TEST(pulled[3] == 4.0f);
  for (size_t k = 0; k < kBytes; ++k)
    if ((k < kPullAt || k >= kPullAt + sizeof pulled) && (k < kPushAt || k >= kPushAt + sizeof gradient))
      BOOST_REQUIRE_MESSAGE(bytes[k] == 0x5a, "byte " << k << " beside the windows was written");
  const int fd = ::shm_open(object.c_str(), O_RDWR, 0);
  BOOST_REQUIRE(fd >= 0);
  BOOST_REQUIRE(::ftruncate(fd, 4096) == 0);  // the second window's pages are gone
  ::close(fd);
  const shm::Completion refused = raw.call(push, 2s);
  BOOST_TEST(refused.code == static_cast<uint32_t>(ErrorCode::kBadRange), refused.message);
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died reading a shrunk window");
  BOOST_TEST(raw.call(pull).code == 0u);  // the first window's page is still there
}

// A registration of a buffer id the server still holds. worker_lib stamps
// each descriptor with the request that carries it, and writes an id anew
// only when it holds the id free (its registration there timed out, and
// the server served it after all): a stamped registration replaces the
// old mapping. An unstamped one (request id 0, a raw client) is refused
// as a double registration and changes nothing.
BOOST_AUTO_TEST_CASE(a_stamped_registration_of_a_held_buffer_id_replaces_its_mapping) {
  test::ServerProcess server(test::unique_name("rereg"), kCounting);  // 4 floats in all, weights 0
  test::RawClient raw(server.name());
  const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
  constexpr size_t kBytes = 4 * sizeof(float);
  auto first = shm::ShmObject::create(prefix + "0", kBytes, 0600);
  auto second = shm::ShmObject::create(prefix + "1", kBytes, 0600);
  BOOST_REQUIRE(first.ok() && second.ok());
  const auto pulled_into = [&](const shm::ShmObject& obj) {
    std::memset((*first)->data(), 0x5a, kBytes);
    std::memset((*second)->data(), 0x5a, kBytes);
    shm::Request r = raw.request(shm::Opcode::kPull);
    r.tensor_id = shm::kAllTensors;
    r.byte_length = kBytes;
    r.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    BOOST_REQUIRE(raw.call(r).code == 0u);
    const auto* written = static_cast<const float*>(obj.data());
    const auto* other = static_cast<const unsigned char*>((&obj == first->get() ? *second : *first)->data());
    return written[0] == 0.0f && written[3] == 0.0f && other[0] == 0x5a && other[kBytes - 1] == 0x5a;
  };
  shm::BufferDesc& d = raw.segment().buffer(raw.id(), 0);
  const auto describe = [&](const std::string& object, uint64_t request_id) {
    std::memset(&d, 0, sizeof d);
    d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
    d.length = kBytes;
    std::snprintf(reinterpret_cast<char*>(d.handle), sizeof d.handle, "%s", object.c_str());
    d.request_id = request_id;
  };
  uint64_t next = raw.call(raw.request(shm::Opcode::kPing)).request_id + 1;
  describe(prefix + "0", next++);
  BOOST_REQUIRE(raw.call(raw.request(shm::Opcode::kRegisterBuffer)).code == 0u);
  BOOST_TEST(pulled_into(**first));
  ++next;
  describe(prefix + "1", 0);
  const shm::Completion refused = raw.call(raw.request(shm::Opcode::kRegisterBuffer));
  ++next;
  BOOST_TEST(refused.code == static_cast<uint32_t>(ErrorCode::kBadRequest));
  BOOST_TEST(std::string(refused.message).find("already registered") != std::string::npos, refused.message);
  BOOST_TEST(pulled_into(**first));  // still the first object
  ++next;
  describe(prefix + "1", next++);
  const shm::Completion replaced = raw.call(raw.request(shm::Opcode::kRegisterBuffer));
  BOOST_TEST(replaced.code == 0u, replaced.message);
  BOOST_TEST(pulled_into(**second));
  shm::ShmObject::remove(prefix + "0");
  shm::ShmObject::remove(prefix + "1");
}

// With protected_hardlinks a process may link any object it may read and
// write under any name in /dev/shm, so under its own buffer prefix too:
// the control segment, or another worker's buffer. The server must map
// neither as that worker's buffer (a pull would write the weights over
// the segment's header, or into the other worker's memory): the
// registration is refused (kBadRequest, naming the object), nothing is
// registered, and the header and the other buffer keep their bytes. The
// same once the other worker's own name is gone and the link is the
// object's one name: what the object is refuses it, not how many names it
// has.
BOOST_AUTO_TEST_CASE(a_hard_link_to_the_segment_or_another_workers_buffer_is_not_registered) {
  test::ServerProcess server(test::unique_name("hlink"), kCounting);  // 4 floats, all 0
  struct Victim {
    std::atomic<uint32_t> ready;
    char object[shm::kNameBytes];
  };
  auto* v =
      static_cast<Victim*>(::mmap(nullptr, sizeof(Victim), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  BOOST_REQUIRE(v != MAP_FAILED);
  // Another process's worker, with one buffer of 4 floats of 42.
  auto victim = test::Process::fork_fn([&] {
    auto w = Worker::connect(test::worker_options(server.name(), 5s, false));
    if (!w.ok()) return 2;
    auto buf = (*w)->register_buffer(16);
    if (!buf.ok()) return 3;
    std::fill_n(static_cast<float*>(buf->data), 4, 42.0f);
    const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
      if (e.path().filename().string().starts_with(prefix))
        std::snprintf(v->object, sizeof v->object, "%s", e.path().filename().c_str());
    v->ready.store(1);
    while (true) ::pause();
  });
  BOOST_REQUIRE(test::eventually([&] { return v->ready.load() == 1u; }, 10s));
  const std::string victims_object = v->object;
  BOOST_REQUIRE(!victims_object.empty());
  const std::string dir = "/dev/shm/";
  const std::string segment_object = shm::segment_object_name(server.name());
  test::RawClient raw(server.name());
  const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
  ObjectsRemoved links{{prefix + "0", prefix + "1", prefix + "2"}};
  const auto pull_into = [&](uint32_t id) {
    shm::Request r = raw.request(shm::Opcode::kPull);
    r.buffer_id = id;
    r.tensor_id = shm::kAllTensors;
    r.byte_length = 16;
    r.dtype = static_cast<uint32_t>(shm::Dtype::kF32);
    return raw.call(r);
  };
  // The answer's message is its first 63 bytes (the server's log has it
  // whole): the object's name and what it is come first.
  const auto refused = [&](uint32_t id, const std::string& link, const std::string& what) {
    const shm::Completion c = register_window(raw, id, link, 0, 16);
    BOOST_TEST(c.code == static_cast<uint32_t>(ErrorCode::kBadRequest), "register " << link << ": " << c.message);
    BOOST_TEST(std::string(c.message).starts_with("buffer '" + link + "' " + what), c.message);
    const shm::Completion pulled = pull_into(id);
    BOOST_TEST(pulled.code == static_cast<uint32_t>(ErrorCode::kUnknownBuffer), pulled.message);
  };
  const auto victims_bytes_intact = [&](const std::string& object) {
    auto o = shm::ShmObject::open(object, /*read_only=*/true);
    BOOST_REQUIRE_MESSAGE(o.ok(), o.status().to_string());
    const auto* f = static_cast<const float*>((*o)->data());
    return f[0] == 42.0f && f[3] == 42.0f;
  };

  // The control segment.
  BOOST_REQUIRE(::link((dir + segment_object).c_str(), (dir + prefix + "0").c_str()) == 0);
  refused(0, prefix + "0", "has 2 names");
  BOOST_TEST(raw.segment().header().magic == shm::kMagic, "the pull wrote over the segment's header");
  BOOST_TEST(raw.segment().header().layout_version.load() == shm::kLayoutVersion);
  BOOST_REQUIRE(::unlink((dir + prefix + "0").c_str()) == 0);

  // Another worker's buffer, under both names.
  BOOST_REQUIRE(::link((dir + victims_object).c_str(), (dir + prefix + "1").c_str()) == 0);
  refused(1, prefix + "1", "has 2 names");
  BOOST_TEST(victims_bytes_intact(victims_object), "the pull wrote into the other worker's buffer");
  // Its own name removed (its user may): the link is its one name.
  BOOST_REQUIRE(::unlink((dir + victims_object).c_str()) == 0);
  refused(1, prefix + "1", "is worker 0's");
  BOOST_TEST(victims_bytes_intact(prefix + "1"), "the pull wrote into the other worker's buffer");
  BOOST_REQUIRE(::link((dir + prefix + "1").c_str(), (dir + victims_object).c_str()) == 0);
  BOOST_REQUIRE(::unlink((dir + prefix + "1").c_str()) == 0);

  // A buffer of its own is still registered and pulled into.
  auto own = shm::ShmObject::create(prefix + "2", 16, 0600);
  BOOST_REQUIRE(own.ok());
  std::memset((*own)->data(), 0x5a, 16);
  const shm::Completion ok = register_window(raw, 2, prefix + "2", 0, 16);
  BOOST_TEST(ok.code == 0u, ok.message);
  BOOST_TEST(pull_into(2).code == 0u);
  BOOST_TEST(static_cast<const float*>((*own)->data())[0] == 0.0f);
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
  victim.kill_and_reap();
  ::munmap(v, sizeof(Victim));
}

// A worker that writes a living process's pid into its owner word, with a
// start time that does not match, looks dead to the server, which
// releases the entry; it must not unlink that living process's buffer
// objects (their names let its buffers be registered again after a server
// restart).
BOOST_AUTO_TEST_CASE(forged_owner_pid_does_not_unlink_a_living_workers_buffers) {
  test::ServerProcess server(test::unique_name("unlink"), kCounting);
  auto victim = connect(server.name());
  auto buf = victim->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
  const auto victims_objects = [&] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
    return n;
  };
  BOOST_REQUIRE_EQUAL(victims_objects(), 1u);
  auto forger = test::Process::fork_fn([&] {
    test::RawClient raw(server.name());
    raw.entry().pid_start_time = 12345;  // not the victim's
    raw.entry().owner.store(shm::make_owner(static_cast<uint32_t>(::getppid()), shm::WorkerState::kClaimed));
    // Released (the owner looks dead) within a housekeeping period or two.
    return test::eventually([&] { return raw.entry().owner.load() == 0; }, 2s) ? 0 : 1;
  });
  BOOST_REQUIRE_EQUAL(forger.wait(10s), 0);
  BOOST_TEST(victims_objects() == 1u, "the victim's buffer object was unlinked");
  BOOST_TEST(victim->ping().ok());
}

// Any process that may write the segment may also shrink it (ftruncate)
// or write over its header. The server touches lost pages at its next
// heartbeat, which without its guard kills it with SIGBUS; with it the
// server grows the object back (the lost pages as zeros). Its periodic
// check (every second) finds what it did not touch: a shrink by less than
// a page, a shrink undone at once, a header zeroed, an object grown. Each time it rewrites
// the header and the tensor table and serves newcomers with the weights
// it had.
BOOST_AUTO_TEST_CASE(control_segment_shrunk_or_written_over_under_a_live_server_is_repaired) {
  test::ServerProcess server(test::unique_name("shrunk"), kCounting);
  float expected = 0.0f;
  // Pushes -1 `pushes` times (the weight counts them), then pulls the
  // weight; its worker detaches on return, so nothing of this process maps
  // the segment while it is harmed. The first connection may meet the
  // harm not yet repaired (the server checks the segment every second): it
  // is retried for 10 s, and a failure names the last connect's error.
  const auto push_and_pull = [&](int pushes) -> float {
    std::unique_ptr<Worker> w;
    Status last;
    BOOST_REQUIRE_MESSAGE(test::eventually(
                              [&] {
                                auto attached = Worker::connect(test::worker_options(server.name(), 500ms, false));
                                if (!attached.ok()) last = attached.status();
                                if (attached.ok()) w = std::move(attached).value();
                                return w != nullptr;
                              },
                              10s),
                          "no newcomer attached: the segment was not repaired; the last connect: " << last.to_string());
    auto grad = w->register_buffer(4);
    auto out = w->register_buffer(4);
    BOOST_REQUIRE(grad.ok() && out.ok());
    *static_cast<float*>(grad->data) = -1.0f;
    for (int i = 0; i < pushes; ++i) BOOST_REQUIRE(w->push(0, grad->id, 0, 4, Dtype::kF32, 0).ok());
    BOOST_REQUIRE(w->pull(0, out->id, 0).ok());
    return *static_cast<const float*>(out->data);
  };
  expected += 5.0f;
  BOOST_TEST(push_and_pull(5) == expected);

  const std::string object = shm::segment_object_name(server.name());
  const int fd = ::shm_open(object.c_str(), O_RDWR, 0);
  BOOST_REQUIRE(fd >= 0);
  const auto size = [fd] {
    struct stat st {};
    return ::fstat(fd, &st) == 0 ? st.st_size : off_t{-1};
  };
  const off_t full = size();
  BOOST_REQUIRE(full > 4096);
  const std::vector<std::pair<std::string, std::function<void()>>> harms = {
      {"shrunk to 0", [&] { BOOST_REQUIRE(::ftruncate(fd, 0) == 0); }},
      {"shrunk by half", [&] { BOOST_REQUIRE(::ftruncate(fd, full / 2) == 0); }},
      {"shrunk by 100 bytes", [&] { BOOST_REQUIRE(::ftruncate(fd, full - 100) == 0); }},
      {"shrunk to 0 and grown back at once",
       [&] { BOOST_REQUIRE(::ftruncate(fd, 0) == 0 && ::ftruncate(fd, full) == 0); }},
      // Every opener checks the object's size against the header's: a
      // grown object refused each attach until the server cut it back.
      {"grown by a page", [&] { BOOST_REQUIRE(::ftruncate(fd, full + 4096) == 0); }},
      {"header zeroed",
       [&] {
         void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
         BOOST_REQUIRE(p != MAP_FAILED);
         std::memset(p, 0, 4096);
         ::munmap(p, 4096);
       }},
  };
  for (const auto& [what, harm] : harms) {
    BOOST_TEST_CONTEXT(what << " (" << full << " bytes)") {
      harm();
      BOOST_TEST(test::eventually([&] { return size() == full; }, 3s), "the segment's size was not restored");
      expected += 3.0f;
      BOOST_TEST(push_and_pull(3) == expected);  // the header and table are whole, the weights kept
      BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died of the harm");
      // The stats block's gauges the server knows come back with the
      // repair (the counters restart from what is left).
      auto w = connect(server.name(), 3s);
      BOOST_TEST(test::eventually(
                     [&] {
                       auto st = w->stats();
                       return st.ok() && st->version == static_cast<uint64_t>(expected) && st->workers_attached == 1;
                     },
                     3s),
                 "the version and attached gauges were not restored");
    }
  }
  ::close(fd);
  BOOST_TEST(server.stop() == 0);
}

// Shrunk and grown back at once, again and again: a fault the server takes
// in the gap finds the object whole when its SIGBUS guard looks, and the
// access is retried rather than the fault taken as one of another cause
// (which killed the server, about once in a thousand harms).
BOOST_AUTO_TEST_CASE(a_segment_shrunk_and_grown_back_again_and_again_does_not_kill_the_server) {
  test::ServerProcess server(test::unique_name("regrown"), {"--tensor", "w:1", "--idle-spin-us", "0"});
  const int fd = ::shm_open(shm::segment_object_name(server.name()).c_str(), O_RDWR, 0);
  BOOST_REQUIRE(fd >= 0);
  struct stat st {};
  BOOST_REQUIRE(::fstat(fd, &st) == 0);
  int harms = 0;
  for (; harms < 5000 && server.process().wait(0ms) == -1; ++harms) {
    BOOST_REQUIRE(::ftruncate(fd, 0) == 0 && ::ftruncate(fd, st.st_size) == 0);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ::close(fd);
  BOOST_TEST(harms == 5000, "the server died after " << harms << " harms");
  BOOST_TEST(server.process().wait(0ms) == -1);
  // Repaired within its check's period: a newcomer attaches and pushes.
  std::unique_ptr<Worker> w;
  BOOST_TEST(test::eventually([&] { return (w = test::try_connect(server.name(), 500ms)) != nullptr; }, 10s));
  if (w) BOOST_TEST(w->ping().ok());
}

// Any process that may write the segment can rewrite its header's counts
// and offsets after the server and the workers checked them. Neither may
// follow them: the server keeps serving, the attached worker keeps
// pushing, a newcomer is refused with the header's fault named, until the
// server's periodic check writes the header again.
BOOST_AUTO_TEST_CASE(header_geometry_rewritten_under_a_live_server_moves_nobody) {
  test::ServerProcess server(test::unique_name("geometry"), kCounting);
  Shared* shared = test::map_shared<Shared>();
  auto good = test::Process::fork_fn([&] { return good_worker(server.name(), shared, 0); });
  BOOST_REQUIRE(test::eventually([&] { return shared->acked[0].load() > 50; }));

  auto seg = shm::Segment::open(server.name(), /*read_only=*/false);
  BOOST_REQUIRE(seg.ok());
  shm::SegmentHeader& h = (*seg)->header();
  const auto scribble = [&h] {
    for (uint64_t* field : {&h.tensor_table_offset, &h.worker_table_offset, &h.lanes_offset, &h.lane_stride,
                            &h.completions_offset, &h.completion_stride, &h.stats_offset, &h.total_elements})
      *field = 0x7fff'ffff'ffffULL;
    h.worker_entry_size = 0xffff'ffff;
    h.lane_capacity = 1u << 16;
    h.max_workers = 0xffff'ffff;
    h.max_buffers = 0xffff'ffff;
    h.tensor_count = 0xffff'ffff;
  };
  scribble();
  const uint64_t at_scribble = shared->acked[0].load();
  // A newcomer right after the scribble is refused, naming the fault (the
  // server's check, once a second, may repair it first: then again).
  Status late;
  for (int tries = 0; tries < 3 && late.code() != ErrorCode::kLayoutMismatch; ++tries) {
    scribble();
    late = Worker::connect(test::worker_options(server.name(), 1s, false)).status();
  }
  BOOST_TEST((late.code() == ErrorCode::kLayoutMismatch), late.to_string());
  BOOST_TEST(test::eventually([&] { return shared->acked[0].load() > at_scribble + 200; }),
             "the attached worker stopped being served");
  shared->stop.store(1);
  BOOST_TEST(good.wait(20s) == 0);
  BOOST_TEST(shared->errors.load() == 0u, shared->first_error);
  BOOST_TEST(shared->torn.load() == 0u);
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");

  // The server's check writes its header again: a newcomer attaches.
  std::unique_ptr<Worker> w;
  BOOST_TEST(test::eventually([&] { return (w = test::try_connect(server.name(), 500ms)) != nullptr; }, 3s),
             "the header was not repaired");
  if (w) BOOST_TEST(w->ping().ok());
  ::munmap(shared, sizeof(Shared));
}

// Any process that may write the segment can forge the server's state
// word kStopped. A worker that sees it ends its session, as it must for a
// server that stopped; the server's check writes kRunning back within a
// second, and a reconnecting worker attaches again to the same server
// (same generation, alive and running) instead of waiting for another.
BOOST_AUTO_TEST_CASE(a_forged_stopped_state_does_not_lock_reconnecting_workers_out) {
  test::ServerProcess server(test::unique_name("forged"), kCounting);
  auto w = connect(server.name(), 5s, /*reconnect=*/true);
  auto grad = w->register_buffer(4);
  auto out = w->register_buffer(4);
  BOOST_REQUIRE(grad.ok() && out.ok());
  *static_cast<float*>(grad->data) = -1.0f;
  BOOST_REQUIRE(w->push(0, grad->id, 0, 4, Dtype::kF32, 0).ok());
  auto seg = shm::Segment::open(server.name(), /*read_only=*/false);
  BOOST_REQUIRE(seg.ok());
  (*seg)->header().server_state.store(static_cast<uint32_t>(shm::ServerState::kStopped));
  const uint64_t generation = w->generation();
  // Each call sees the forged word until the server writes it back.
  for (int i = 0; i < 3; ++i) {
    const auto pushed = w->push(0, grad->id, 0, 4, Dtype::kF32, 0);
    BOOST_REQUIRE_MESSAGE(pushed.ok(), pushed.status().to_string());
  }
  BOOST_REQUIRE(w->pull(0, out->id, 0).ok());
  BOOST_TEST(*static_cast<const float*>(out->data) == 4.0f);
  BOOST_TEST(w->generation() == generation);
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
  w.reset();
  BOOST_TEST(server.stop() == 0);
}

// /dev/shm is world-writable: any local user may fill it with names of a
// server's buffer objects ("shmps.<name>.p<pid>.<n>"). Names of a living
// pid (1) cost the server's sweep a look at that pid; names of a pid no
// process can have are removed by it. Neither may stall requests: the
// second-slowest ping among the names is within 100 ms of the
// second-slowest without them, over as many sweeps (a sweep on the
// consumer thread stalls one ping per sweep by its length). Nor may they
// flood the log: the removals take a line per sweep, not one per name.
BOOST_AUTO_TEST_CASE(a_dev_shm_full_of_buffer_names_neither_stalls_requests_nor_floods_the_log) {
  constexpr uint32_t kLiving = 40000;
  constexpr uint32_t kDead = 2000;
  constexpr pid_t kNoSuchPid = 0x3ffffffe;  // above any pid_max
  const std::string name = test::unique_name("flood");
  const std::string log_path = "/tmp/" + name + ".log";
  struct Cleanup {
    std::string name, log;
    ~Cleanup() {
      const std::string prefix = shm::segment_object_name(name) + ".p";
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
        if (e.path().filename().string().rfind(prefix, 0) == 0) ::unlink(e.path().c_str());
      ::unlink(log.c_str());
    }
  } cleanup{name, log_path};
  const auto plant = [&](pid_t pid, uint32_t count) {
    for (uint32_t k = 0; k < count; ++k) {
      const std::string path = "/dev/shm/" + shm::buffer_object_name(name, pid, k);
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      BOOST_REQUIRE_MESSAGE(fd >= 0, path << ": " << std::strerror(errno));
      ::close(fd);
    }
  };
  test::ServerProcess server(name, {"--tensor", "w:4"}, log_path);
  auto w = connect(name, 3s);
  // Pings for `span` (over three sweeps or more), one every 0.5 ms.
  const auto second_slowest_ping_ns = [&](std::chrono::milliseconds span) {
    std::vector<uint64_t> took;
    for (const auto until = std::chrono::steady_clock::now() + span; std::chrono::steady_clock::now() < until;) {
      const uint64_t t0 = shm::monotonic_ns();
      BOOST_REQUIRE(w->ping().ok());
      took.push_back(shm::monotonic_ns() - t0);
      std::this_thread::sleep_for(500us);
    }
    std::sort(took.begin(), took.end(), std::greater<>());
    return took.size() > 1 ? took[1] : uint64_t{0};
  };
  const uint64_t quiet_ns = second_slowest_ping_ns(3500ms);
  plant(1, kLiving);
  std::this_thread::sleep_for(1100ms);  // a sweep has seen them all
  const uint64_t crowded_ns = second_slowest_ping_ns(3500ms);
  BOOST_TEST_MESSAGE("second-slowest ping: " << quiet_ns / 1000 << " us without the names, " << crowded_ns / 1000
                                             << " us with them");
  BOOST_TEST(crowded_ns < quiet_ns + 100'000'000, "second-slowest ping " << crowded_ns / 1000 << " us with " << kLiving
                                                                         << " names of pid 1 in /dev/shm, "
                                                                         << quiet_ns / 1000 << " us without");
  const auto sweep_lines = [&] {
    std::vector<std::string> lines;
    std::istringstream log(test::read_file(log_path));
    for (std::string line; std::getline(log, line);)
      if (line.find("orphaned buffer object") != std::string::npos) lines.push_back(line);
    return lines;
  };
  BOOST_REQUIRE(sweep_lines().empty());
  plant(kNoSuchPid, kDead);
  const std::string dead_prefix = shm::buffer_object_prefix(name, kNoSuchPid);
  const auto dead_left = [&] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(dead_prefix, 0) == 0) ++n;
    return n;
  };
  BOOST_REQUIRE_MESSAGE(test::eventually([&] { return dead_left() == 0; }, 10s),
                        dead_left() << " of " << kDead << " names of a dead pid left");
  std::this_thread::sleep_for(200ms);  // the sweep that removed the last has logged
  const std::vector<std::string> lines = sweep_lines();
  BOOST_TEST(lines.size() <= 3u, lines.size() << " log lines for " << kDead << " names removed");
  size_t said = 0;  // "removed <n> orphaned buffer objects: ..."
  for (const std::string& line : lines)
    if (const size_t at = line.find("removed "); at != std::string::npos && std::isdigit(line[at + 8]) != 0)
      said += std::stoul(line.substr(at + 8));
  BOOST_TEST(said == size_t{kDead});
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
}

// A client that sends more than its lane's capacity without reading its
// answers fills its completion queue; the server can serve that lane no
// further until it reads them. It must not spin on the lane meanwhile (its
// CPU time over a second stays a fraction of it: it sleeps), and once the
// client has read, the rest is answered (the server looks again every
// heartbeat).
BOOST_AUTO_TEST_CASE(a_client_that_reads_no_answers_does_not_keep_the_server_busy) {
  test::ServerProcess server(test::unique_name("unread"), kCounting);
  test::RawClient c(server.name());
  const uint32_t capacity = c.segment().layout().lane_capacity;
  uint64_t id = 100;
  const auto send_pings = [&] {
    for (uint32_t n = 0; n < capacity; ++n) {
      shm::Request r = c.request(shm::Opcode::kPing);
      r.request_id = id++;
      BOOST_REQUIRE(test::eventually([&] { return c.send(r); }, 3s));
    }
  };
  send_pings();  // answered: the completion queue is full
  BOOST_REQUIRE(test::eventually([&] { return c.segment().lane(c.id()).head.load() == capacity; }, 3s));
  send_pings();  // waits in the lane
  const auto cpu_ticks = [&] {
    std::ifstream stat("/proc/" + std::to_string(server.process().pid()) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    std::istringstream fields(text.substr(text.rfind(')') + 2));
    std::string field;
    uint64_t utime = 0, stime = 0;
    for (int k = 3; k <= 15 && fields >> field; ++k) {
      if (k == 14) utime = std::stoull(field);
      if (k == 15) stime = std::stoull(field);
    }
    return utime + stime;
  };
  const uint64_t before = cpu_ticks();
  std::this_thread::sleep_for(1s);
  const uint64_t used = cpu_ticks() - before;
  const auto per_second = static_cast<uint64_t>(::sysconf(_SC_CLK_TCK));
  BOOST_TEST(used * 4 < per_second, "the server used " << used << " of " << per_second << " ticks in a second");
  BOOST_REQUIRE_MESSAGE(server.process().wait(0ms) == -1, "the server died");
  for (uint32_t n = 0; n < 2 * capacity; ++n) {
    const shm::Completion done = c.receive(3s);
    BOOST_TEST(done.request_id == 100 + n);
    BOOST_TEST(done.code == 0u);
  }
  BOOST_TEST(server.stop() == 0);
}

// A server (or anything writing the segment) that marks a worker's entry
// detached and keeps feeding its completion queue in id order: the worker
// ends its session without taking answers to requests it never sent, so
// the call returns at once and nothing grows.
BOOST_AUTO_TEST_CASE(a_queue_fed_after_the_entry_is_detached_does_not_hold_the_worker) {
  shm::SegmentSpec spec;
  spec.name = test::unique_name("feed");
  spec.tensors = {{"w", {1}}};
  spec.max_workers = 1;
  spec.max_buffers = 1;
  spec.lane_capacity = 8;
  spec.config.optimizer_kind = 1;
  spec.config.backend = 1;
  auto created = shm::Segment::create(spec, 1);
  BOOST_REQUIRE(created.ok());
  struct Removed {
    std::string name;
    ~Removed() { shm::Segment::remove(name); }
  } removed{spec.name};
  shm::Segment& seg = **created;
  seg.header().server_state.store(static_cast<uint32_t>(shm::ServerState::kRunning));
  seg.publish();

  // The fake server, in this process (so it looks alive): accepts the
  // attach, then, told to, marks the entry detached and feeds the queue
  // for 2 s.
  std::atomic<bool> evict{false};
  std::atomic<uint64_t> fed{0};
  std::thread fake([&] {
    shm::WorkerEntry& e = seg.worker(0);
    uint32_t pid = 0;
    while (!evict.load()) {
      uint64_t owner = e.owner.load();
      if (shm::owner_state(owner) == static_cast<uint32_t>(shm::WorkerState::kClaimed)) {
        pid = shm::owner_pid(owner);
        e.lease = 7;
        e.owner.compare_exchange_strong(owner, shm::make_owner(pid, shm::WorkerState::kAttached));
      }
      std::this_thread::sleep_for(1ms);
    }
    e.owner.store(shm::make_owner(pid, shm::WorkerState::kDetached));
    shm::SpscProducer<shm::Completion> queue(&seg.completions(0), seg.completion_slots(0), spec.lane_capacity);
    const auto until = std::chrono::steady_clock::now() + 2s;
    for (uint64_t id = 1; std::chrono::steady_clock::now() < until;) {
      shm::Completion c{};
      c.request_id = id;
      if (queue.try_push(c) == shm::RingResult::kOk) {
        ++id;
        fed.fetch_add(1);
      } else {
        std::this_thread::sleep_for(100us);
      }
    }
  });
  struct Joined {  // a failed BOOST_REQUIRE below must not leave the thread joinable
    std::atomic<bool>& evict;
    std::thread& thread;
    ~Joined() {
      evict.store(true);
      if (thread.joinable()) thread.join();
    }
  } joined{evict, fake};
  auto w = Worker::connect(test::worker_options(spec.name, 2s, false));
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  evict.store(true);
  BOOST_REQUIRE(test::eventually([&] { return fed.load() >= spec.lane_capacity; }));
  const auto t0 = std::chrono::steady_clock::now();
  Status s = (*w)->ping();
  const auto took = std::chrono::steady_clock::now() - t0;
  BOOST_TEST((s.code() == ErrorCode::kUnknownWorker), s.to_string());
  BOOST_TEST((took < 1s), "the ping took " << std::chrono::duration<double>(took).count() << " s");
  fake.join();
  BOOST_TEST(fed.load() == uint64_t{spec.lane_capacity},
             "the worker took " << fed.load() - spec.lane_capacity << " answers to requests it never sent");
}

BOOST_AUTO_TEST_SUITE_END()
