// The SPSC ring: single-threaded edge cases, wrap-around of the indices,
// corrupt-peer detection, and millions of slots between two threads and
// between two real processes (each slot exactly once, in order).
#include <sys/mman.h>

#define BOOST_TEST_MODULE test_shm_ring
#include <boost/test/unit_test.hpp>
#include <memory>
#include <thread>

#include "shmps/shm/futex.hpp"
#include "shmps/shm/ring.hpp"
#include "test_support.hpp"

using namespace shmps::shm;

namespace {

constexpr uint32_t kCapacity = 64;

// A lane in a MAP_SHARED anonymous mapping, so fork()ed children share it.
struct SharedLane {
  SharedLane() {
    bytes_ = sizeof(LaneHeader) + kCapacity * sizeof(Request);
    mem_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    BOOST_REQUIRE(mem_ != MAP_FAILED);
  }
  ~SharedLane() { ::munmap(mem_, bytes_); }
  LaneHeader* header() { return static_cast<LaneHeader*>(mem_); }
  Request* slots() { return reinterpret_cast<Request*>(static_cast<char*>(mem_) + sizeof(LaneHeader)); }
  void start_at(uint64_t index) {
    header()->head.store(index);
    header()->tail.store(index);
  }
  void* mem_;
  size_t bytes_;
};

Request make(uint64_t id) {
  Request r{};
  r.request_id = id;
  r.worker_version = id * 3;
  return r;
}

// Produces [first, first + count) ids; the consumer checks order and content.
void produce(SharedLane& lane, uint64_t start, uint64_t first, uint64_t count) {
  SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity, start);
  for (uint64_t id = first; id < first + count;) {
    const RingResult r = p.try_push(make(id));
    if (r == RingResult::kOk) {
      ++id;
      notify(lane.header()->data_ready);
    } else if (r == RingResult::kFull) {
      wait_until(
          lane.header()->space_ready, [&] { return p.has_space(); }, nullptr,
          std::chrono::steady_clock::now() + std::chrono::seconds(30));
    } else {
      throw std::runtime_error("ring corrupt");
    }
  }
}

// by_seq: takes each slot through its sequence (the request id) when it is
// published there, as the server and the worker do (ring.hpp,
// seq_published()); the tail then lags the consumer's head, which must not
// read as a corrupt ring.
uint64_t consume(SharedLane& lane, uint64_t start, uint64_t first, uint64_t count, bool by_seq = false) {
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity, start);
  uint64_t errors = 0;
  for (uint64_t expect = first; expect < first + count;) {
    Request r;
    const RingResult res = by_seq ? c.try_pop(&r, expect) : c.try_pop(&r);
    if (res == RingResult::kOk) {
      if (r.request_id != expect || r.worker_version != expect * 3) ++errors;
      ++expect;
      notify(lane.header()->space_ready);
    } else if (res == RingResult::kEmpty) {
      wait_until(
          lane.header()->data_ready,
          [&] { return (by_seq && c.seq_published(expect)) || c.refresh() == RingResult::kOk; }, nullptr,
          std::chrono::steady_clock::now() + std::chrono::seconds(30));
    } else {
      return ~uint64_t{0};
    }
  }
  return errors;
}

// A producer process and this one, from just below the uint64 wrap of the
// indices to past it; ids from 1 (by_seq needs them non-zero).
void across_the_wrap_point(bool by_seq) {
  SharedLane lane;
  const uint64_t start = ~uint64_t{0} - 500'000;
  lane.start_at(start);
  constexpr uint64_t kCount = 1'000'000;
  auto child = shmps::test::Process::fork_fn([&] {
    produce(lane, start, 1, kCount);
    return 0;
  });
  const uint64_t errors = consume(lane, start, 1, kCount, by_seq);
  BOOST_TEST(child.wait(std::chrono::seconds(60)) == 0);
  BOOST_TEST(errors == 0u);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(ring)

BOOST_AUTO_TEST_CASE(fills_to_capacity_then_reports_full_then_drains_in_order) {
  SharedLane lane;
  SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity);
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity);
  Request r;
  BOOST_TEST((c.try_pop(&r) == RingResult::kEmpty));
  for (uint64_t i = 0; i < kCapacity; ++i) BOOST_TEST((p.try_push(make(i)) == RingResult::kOk));
  BOOST_TEST((p.try_push(make(99)) == RingResult::kFull));
  BOOST_TEST(!p.has_space());
  BOOST_TEST(c.depth_estimate() == kCapacity);
  for (uint64_t i = 0; i < kCapacity; ++i) {
    BOOST_TEST((c.try_pop(&r) == RingResult::kOk));
    BOOST_TEST(r.request_id == i);
  }
  BOOST_TEST((c.try_pop(&r) == RingResult::kEmpty));
  BOOST_TEST(p.has_space());
}

// has_space_for(n): n slots free by the consumer's head, across the
// uint64 wrap; a head ahead of the tail (written by a hostile consumer)
// leaves no space, as has_space() says, and head_impossible() tells why.
BOOST_AUTO_TEST_CASE(space_for_n_counts_free_slots_and_none_past_an_impossible_head) {
  for (const uint64_t start : {uint64_t{0}, ~uint64_t{0} - 2}) {
    BOOST_TEST_CONTEXT("start " << start) {
      SharedLane lane;
      lane.start_at(start);
      SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity, start);
      SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity, start);
      BOOST_TEST(p.has_space_for(kCapacity));
      for (uint64_t i = 0; i < 5; ++i) BOOST_REQUIRE((p.try_push(make(i)) == RingResult::kOk));
      BOOST_TEST(p.has_space_for(kCapacity - 5));
      BOOST_TEST(!p.has_space_for(kCapacity - 4));
      BOOST_TEST(!p.head_impossible());
      Request r;
      BOOST_REQUIRE((c.try_pop(&r) == RingResult::kOk));
      BOOST_TEST(p.has_space_for(kCapacity - 4));  // the released slot is seen
      lane.header()->head.store(start + 6);        // one past the tail: read when more than 60 are asked for
      BOOST_TEST(!p.has_space_for(kCapacity - 3));
      BOOST_TEST(!p.has_space_for(1));
      BOOST_TEST(p.head_impossible());
    }
  }
}

BOOST_AUTO_TEST_CASE(indices_wrap_around_uint64) {
  SharedLane lane;
  const uint64_t start = ~uint64_t{0} - 100;  // wraps after 100 slots
  lane.start_at(start);
  SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity, start);
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity, start);
  uint64_t next = 0;
  for (uint64_t round = 0; round < 10; ++round) {
    for (uint64_t i = 0; i < 40; ++i) BOOST_REQUIRE((p.try_push(make(round * 40 + i)) == RingResult::kOk));
    for (uint64_t i = 0; i < 40; ++i) {
      Request r;
      BOOST_REQUIRE((c.try_pop(&r) == RingResult::kOk));
      BOOST_TEST(r.request_id == next++);
    }
  }
  BOOST_TEST(c.head() < start);  // it did wrap
  // Full is still detected across the wrap point.
  for (uint64_t i = 0; i < kCapacity; ++i) BOOST_REQUIRE((p.try_push(make(i)) == RingResult::kOk));
  BOOST_TEST((p.try_push(make(0)) == RingResult::kFull));
}

BOOST_AUTO_TEST_CASE(garbage_peer_indices_are_reported_corrupt_not_followed) {
  SharedLane lane;
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity);
  lane.header()->tail.store(kCapacity + 1);  // a producer claiming more than fits
  Request r;
  BOOST_TEST((c.try_pop(&r) == RingResult::kCorrupt));
  BOOST_TEST(c.head() == 0u);               // nothing consumed
  lane.header()->tail.store(~uint64_t{0});  // "behind" the head
  BOOST_TEST((c.try_pop(&r) == RingResult::kCorrupt));

  SharedLane lane2;
  SpscProducer<Request> p(lane2.header(), lane2.slots(), kCapacity);
  for (uint64_t i = 0; i < kCapacity; ++i) BOOST_REQUIRE((p.try_push(make(i)) == RingResult::kOk));
  lane2.header()->head.store(kCapacity * 5);  // a consumer "ahead" of the producer
  BOOST_TEST((p.try_push(make(0)) == RingResult::kCorrupt));
}

BOOST_AUTO_TEST_CASE(two_threads_two_million_slots_exactly_once_in_order) {
  SharedLane lane;
  constexpr uint64_t kCount = 2'000'000;
  std::thread producer([&] { produce(lane, 0, 0, kCount); });
  const uint64_t errors = consume(lane, 0, 0, kCount);
  producer.join();
  BOOST_TEST(errors == 0u);
}

BOOST_AUTO_TEST_CASE(two_processes_four_million_slots_exactly_once_in_order) {
  SharedLane lane;
  constexpr uint64_t kCount = 4'000'000;
  auto child = shmps::test::Process::fork_fn([&] {
    produce(lane, 0, 0, kCount);
    return 0;
  });
  const uint64_t errors = consume(lane, 0, 0, kCount);
  BOOST_TEST(child.wait(std::chrono::seconds(60)) == 0);
  BOOST_TEST(errors == 0u);
}

BOOST_AUTO_TEST_CASE(staged_slot_is_invisible_to_a_sequence_poller_until_published) {
  SharedLane lane;
  SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity);
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity);
  BOOST_TEST(!c.seq_published(1));
  BOOST_TEST((p.stage(make(1)) == RingResult::kOk));
  BOOST_TEST(!c.seq_published(1));  // a producer killed here published nothing
  p.publish();
  BOOST_TEST(c.seq_published(1));
  Request r;
  BOOST_TEST((c.try_pop(&r, 1) == RingResult::kOk));
  BOOST_TEST(r.worker_version == 3u);
  BOOST_TEST((c.refresh() == RingResult::kEmpty));
  // Taken ahead of a tail that lags by a slot: empty, not corrupt.
  BOOST_TEST((p.stage(make(2)) == RingResult::kOk));
  p.publish();
  lane.header()->tail.store(1);  // as if the tail's store had not arrived yet
  BOOST_TEST((c.try_pop(&r, 2) == RingResult::kOk));
  BOOST_TEST((c.refresh() == RingResult::kEmpty));
  lane.header()->tail.store(2);
  BOOST_TEST((c.refresh() == RingResult::kEmpty));
  // A tail more than a ring behind is still garbage.
  lane.header()->tail.store(2 - 2 * kCapacity);
  BOOST_TEST((c.refresh() == RingResult::kCorrupt));
}

// A producer that reuses a sequence: after a full ring of 1..kCapacity, it
// publishes 1 again at slot 0, and slot 1 still holds 2 from the first
// round, the sequence that would come next. Taking by sequence must not
// take that stale slot, however often it is asked; the tail still counts.
BOOST_AUTO_TEST_CASE(a_reused_sequence_cannot_take_a_stale_slot) {
  SharedLane lane;
  SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity);
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity);
  Request r;
  for (uint64_t id = 1; id <= kCapacity; ++id) {
    BOOST_REQUIRE((p.try_push(make(id)) == RingResult::kOk));
    BOOST_REQUIRE((c.try_pop(&r, id) == RingResult::kOk));
  }
  BOOST_REQUIRE((p.try_push(make(1)) == RingResult::kOk));
  BOOST_TEST((c.try_pop(&r, 1) == RingResult::kOk));  // through the tail
  BOOST_TEST(r.request_id == 1u);
  BOOST_TEST(!c.seq_published(2));  // slot 1 holds 2, of the first round
  BOOST_TEST((c.try_pop(&r, 2) == RingResult::kEmpty));
  BOOST_TEST((c.try_pop(&r, 2) == RingResult::kEmpty));
  // A new sequence above all taken is taken by its sequence again.
  BOOST_REQUIRE((p.try_push(make(kCapacity + 1)) == RingResult::kOk));
  lane.header()->tail.store(kCapacity + 1);  // as if the tail's store had not arrived yet
  BOOST_TEST(c.seq_published(kCapacity + 1));
  BOOST_TEST((c.try_pop(&r, kCapacity + 1) == RingResult::kOk));
  BOOST_TEST(r.worker_version == 3 * (kCapacity + 1));
}

// What the producer writes beside a slot (a lane's publish stamps) is
// read in try_pop's before_release, while the slot is still held: on a
// full ring the producer cannot write that slot's index anew until the
// pop returns. Both ways of taking a slot (the tail, the sequence).
BOOST_AUTO_TEST_CASE(before_release_runs_while_the_slot_is_still_held) {
  SharedLane lane;
  SpscProducer<Request> p(lane.header(), lane.slots(), kCapacity);
  SpscConsumer<Request> c(lane.header(), lane.slots(), kCapacity);
  uint64_t beside[kCapacity] = {};  // the producer's stamps, by slot index
  const auto push = [&](uint64_t id) {
    beside[p.next_index() % kCapacity] = id * 7;
    BOOST_REQUIRE((p.try_push(make(id)) == RingResult::kOk));
  };
  for (uint64_t id = 1; id <= kCapacity; ++id) push(id);
  for (uint64_t id = 1; id <= 2 * kCapacity; ++id) {
    Request r;
    uint64_t seen_index = ~uint64_t{0}, seen_beside = 0;
    bool held = false;
    const uint64_t by_seq = id % 2 == 0 ? id : 0;
    BOOST_REQUIRE((c.try_pop(&r, by_seq, [&](uint64_t index) {
      seen_index = index;
      seen_beside = beside[index % kCapacity];
      held = !p.has_space();  // the ring is full until the slot is released
    }) == RingResult::kOk));
    BOOST_TEST(r.request_id == id);
    BOOST_TEST(seen_index == id - 1);
    BOOST_TEST(seen_beside == id * 7);
    BOOST_TEST(held);
    BOOST_TEST(p.has_space());  // released now
    push(id + kCapacity);       // overwrites the stamp of the slot just taken
  }
}

BOOST_AUTO_TEST_CASE(two_threads_two_million_slots_taken_by_sequence_exactly_once_in_order) {
  SharedLane lane;
  constexpr uint64_t kCount = 2'000'000;
  std::thread producer([&] { produce(lane, 0, 1, kCount); });
  const uint64_t errors = consume(lane, 0, 1, kCount, /*by_seq=*/true);
  producer.join();
  BOOST_TEST(errors == 0u);
}

BOOST_AUTO_TEST_CASE(two_processes_across_the_wrap_point_taken_by_sequence) { across_the_wrap_point(true); }

BOOST_AUTO_TEST_CASE(two_processes_across_the_wrap_point) { across_the_wrap_point(false); }

BOOST_AUTO_TEST_CASE(futex_wait_times_out_and_wakes) {
  SharedLane lane;
  WaitWord& w = lane.header()->data_ready;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = wait_until(
      w, [] { return false; }, nullptr, t0 + std::chrono::milliseconds(50), 10);
  BOOST_TEST((r == WaitResult::kTimeout));
  BOOST_TEST((std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(50)));
  int calls = 0;
  r = wait_until(
      w, [] { return false; }, [&] { return ++calls == 2; },
      std::chrono::steady_clock::now() + std::chrono::seconds(10), 10, std::chrono::milliseconds(5));
  BOOST_TEST((r == WaitResult::kAborted));
  std::atomic<bool> flag{false};
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    flag.store(true, std::memory_order_release);
    notify(w);
  });
  r = wait_until(
      w, [&] { return flag.load(std::memory_order_acquire); }, nullptr,
      std::chrono::steady_clock::now() + std::chrono::seconds(10), 10, std::chrono::seconds(5));
  t.join();
  BOOST_TEST((r == WaitResult::kReady));
}

BOOST_AUTO_TEST_SUITE_END()
