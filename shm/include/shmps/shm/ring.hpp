// The two ends of a single-producer single-consumer ring in shared memory: a
// request lane (worker -> server) or a completion queue (server -> worker).
// Each end keeps its own index locally and never trusts the peer's copy
// blindly: an index from the peer that would put more than `capacity` slots
// in flight is reported as kCorrupt, and a slot is copied out before it is
// released, so a late or buggy peer can never change what was validated.
// One producer object and one consumer object per ring, each used by one
// thread at a time; the two may live in different processes.
//
// A slot's first 8 bytes are a uint64 the protocol uses as a sequence (the
// request id of a Request or a Completion). publish() writes them, after
// the rest of the slot and before the tail, with a release store
// (SYNC(slot_seq)), so a consumer that knows which value comes next may
// poll the slot itself (seq_published()) instead of the tail: one cache
// line crosses between the cores instead of two. A staged slot stays
// invisible either way until publish(). The consumer takes a slot by its
// sequence only above every sequence it has released, so a producer that
// repeats sequences (buggy or hostile) cannot make it take a stale slot of
// the last round again.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "shmps/shm/layout.hpp"

namespace shmps::shm {

enum class RingResult { kOk, kEmpty, kFull, kCorrupt };

template <typename Slot>
class SpscProducer {
  static_assert(sizeof(Slot) >= sizeof(uint64_t) && alignof(Slot) >= alignof(uint64_t));

 public:
  SpscProducer() = default;
  // capacity: power of two. Starts at index `start` (normally 0; tests
  // start near the uint64 wrap point).
  SpscProducer(LaneHeader* header, Slot* slots, uint32_t capacity, uint64_t start = 0)
      : header_(header), slots_(slots), mask_(capacity - 1), tail_(start), cached_head_(start) {}

  // Writes `slot` and publishes it. kFull when capacity slots are in flight,
  // kCorrupt when the consumer's head is impossible.
  // `bytes`: how many leading bytes of `slot` to write; the rest of the
  // ring's slot keeps what an earlier push left there (a protocol that uses
  // it says which bytes a consumer may then read: layout.hpp, Completion).
  RingResult try_push(const Slot& slot, size_t bytes = sizeof(Slot)) noexcept {
    const RingResult r = stage(slot, bytes);
    if (r == RingResult::kOk) publish();
    return r;
  }

  // The two halves of try_push, apart so tests can kill a producer between
  // them: stage() writes the next slot without publishing it (a consumer
  // cannot see it; a second stage() overwrites it); publish() makes it
  // visible.
  RingResult stage(const Slot& slot, size_t bytes = sizeof(Slot)) noexcept {
    if (tail_ - cached_head_ > mask_) {
      // SYNC(slot_released): acquire pairs with the consumer's release store
      // of head, so the slot we are about to overwrite was fully copied out.
      cached_head_ = header_->head.load(std::memory_order_acquire);
      const uint64_t in_flight = tail_ - cached_head_;  // unsigned: correct across wrap
      if (in_flight > mask_ + 1) return RingResult::kCorrupt;
      if (in_flight == mask_ + 1) return RingResult::kFull;
    }
    auto* dst = reinterpret_cast<unsigned char*>(&slots_[tail_ & mask_]);
    const auto* src = reinterpret_cast<const unsigned char*>(&slot);
    const size_t n = std::clamp(bytes, sizeof(uint64_t), sizeof(Slot));
    std::memcpy(dst + sizeof(uint64_t), src + sizeof(uint64_t), n - sizeof(uint64_t));
    std::memcpy(&staged_seq_, src, sizeof staged_seq_);  // written by publish()
    return RingResult::kOk;
  }
  void publish() noexcept {
    auto* seq = reinterpret_cast<uint64_t*>(&slots_[tail_ & mask_]);
    // SYNC(slot_seq): release pairs with seq_published()'s acquire: the
    // bytes stage() wrote are visible to a consumer that sees this value.
    std::atomic_ref<uint64_t>(*seq).store(staged_seq_, std::memory_order_release);
    ++tail_;
    // SYNC(slot_published): release pairs with the consumer's acquire load
    // of tail; it publishes the slot bytes written by stage().
    header_->tail.store(tail_, std::memory_order_release);
  }

  // The free-running index the next stage() writes.
  uint64_t next_index() const noexcept { return tail_; }
  // Slots in flight as last seen (may be stale: the consumer moves on).
  uint64_t in_flight_estimate() const noexcept {
    return tail_ - header_->head.load(std::memory_order_relaxed);  // relaxed: a hint only
  }
  // True when at least one slot is free. Reads the consumer's head (acquire:
  // see stage()) only when the last head read says the ring is full: the
  // consumer stores its head on every pop, so reading it each time costs a
  // cache-line transfer between cores per request (about 35 ns of a 4 KiB
  // push's round trip, by perf). A head that is impossible (more than
  // capacity behind the tail, or ahead of it) counts as no space too:
  // head_impossible() tells them apart.
  bool has_space() noexcept {
    if (tail_ - cached_head_ <= mask_) return true;
    cached_head_ = header_->head.load(std::memory_order_acquire);  // SYNC(slot_released)
    return tail_ - cached_head_ <= mask_;
  }
  // True when at least `n` (<= capacity) slots are free; reads the
  // consumer's head as has_space() does, only when the last head read
  // leaves fewer.
  bool has_space_for(uint64_t n) noexcept {
    if (free_slots() >= n) return true;
    cached_head_ = header_->head.load(std::memory_order_acquire);  // SYNC(slot_released)
    return free_slots() >= n;
  }
  // After has_space() or has_space_for() said no: whether the head it read is one no consumer
  // could have written (so the ring is not full but corrupt).
  bool head_impossible() const noexcept { return tail_ - cached_head_ > mask_ + 1; }
  uint64_t tail() const noexcept { return tail_; }
  LaneHeader* header() const noexcept { return header_; }

 private:
  // Free slots by the last head read; none when that head is impossible
  // (unsigned differences: correct across wrap).
  uint64_t free_slots() const noexcept {
    const uint64_t in_flight = tail_ - cached_head_;
    return in_flight <= mask_ + 1 ? mask_ + 1 - in_flight : 0;
  }

  LaneHeader* header_ = nullptr;
  Slot* slots_ = nullptr;
  uint64_t mask_ = 0;
  uint64_t tail_ = 0;
  uint64_t cached_head_ = 0;
  uint64_t staged_seq_ = 0;  // the staged slot's first 8 bytes, for publish()
};

template <typename Slot>
class SpscConsumer {
 public:
  SpscConsumer() = default;
  SpscConsumer(LaneHeader* header, Slot* slots, uint32_t capacity, uint64_t start = 0)
      : header_(header), slots_(slots), mask_(capacity - 1), head_(start), cached_tail_(start) {}

  // As try_pop(out, expected_seq), and calls before_release(index) with
  // the slot's free-running index once the slot is copied out and before
  // it is released: for what the producer writes beside the slot (a
  // lane's publish stamps, Segment::lane_stamps()), visible with the slot
  // and free for the producer to write anew once the slot is released
  // (SYNC(slot_released)).
  template <typename BeforeRelease>
  RingResult try_pop(Slot* out, uint64_t expected_seq, BeforeRelease&& before_release) noexcept {
    if (expected_seq == 0 || !seq_published(expected_seq)) {
      if (RingResult r = refresh(); r != RingResult::kOk) return r;
    }
    std::memcpy(out, &slots_[head_ & mask_], sizeof(Slot));
    before_release(head_);
    release();
    return RingResult::kOk;
  }

  // As try_pop(out), but first takes the next slot if its sequence is
  // `expected_seq` (0: unknown; then only the tail counts).
  RingResult try_pop(Slot* out, uint64_t expected_seq) noexcept {
    return try_pop(out, expected_seq, [](uint64_t) {});
  }

  // Copies the oldest slot into *out and releases it. kEmpty when none,
  // kCorrupt when the producer's tail is impossible (nothing is consumed).
  RingResult try_pop(Slot* out) noexcept { return try_pop(out, 0); }

  // The oldest slot, in place, for a consumer that copies out only the
  // bytes it needs: nullptr when refresh() says kEmpty or kCorrupt. The
  // bytes may change under the reader only if the producer is buggy (it
  // does not write a published slot before its release): copy, then
  // validate the copy. release() frees it.
  const Slot* peek() noexcept { return refresh() == RingResult::kOk ? &slots_[head_ & mask_] : nullptr; }
  // The free-running index of the next slot to take (after a pop: one past
  // the slot just taken).
  uint64_t next_index() const noexcept { return head_; }
  void release() noexcept {
    // relaxed: the slot was copied out already; a garbage value only turns
    // seq_published() off for this ring (a buggy producer's own loss).
    const uint64_t seq = std::atomic_ref<uint64_t>(*first_word(head_)).load(std::memory_order_relaxed);
    max_seq_ = std::max(max_seq_, seq);
    ++head_;
    // Taken through seq_published(), the slot may be ahead of the tail we
    // last read; the producer published it, so the tail is at least here.
    if (static_cast<int64_t>(cached_tail_ - head_) < 0) {
      cached_tail_ = head_;
      ahead_of_tail_ = true;
    }
    // SYNC(slot_released): release pairs with the producer's acquire load of
    // head: the slot was copied out before it can be reused.
    header_->head.store(head_, std::memory_order_release);
  }

  // True when the next slot's sequence (its first 8 bytes) is `seq`: the
  // producer published it (SYNC(slot_seq)), whatever the tail says yet; then
  // peek_published() returns it. For a protocol whose sequences rise within
  // a session, with the slots cleared when one starts (the request ids of a
  // worker's lane and completion queue: the server clears both at each
  // attach). Always false for a `seq` at or below the highest sequence this
  // consumer has released: every stale slot holds one of those, so a
  // producer that reused a sequence cannot have the slot behind it, from
  // the last round, taken as the next (fuzz_requests found that replay).
  bool seq_published(uint64_t seq) const noexcept {
    if (seq <= max_seq_) return false;
    // SYNC(slot_seq): acquire pairs with the producer's release in publish().
    return std::atomic_ref<uint64_t>(*first_word(head_)).load(std::memory_order_acquire) == seq;
  }
  const Slot* peek_published() const noexcept { return &slots_[head_ & mask_]; }

  // kOk when a slot is available, kEmpty or kCorrupt otherwise.
  RingResult refresh() noexcept {
    if (head_ != cached_tail_) return RingResult::kOk;
    // SYNC(slot_published): acquire pairs with the producer's release store.
    const uint64_t tail = header_->tail.load(std::memory_order_acquire);
    const uint64_t available = tail - head_;  // unsigned: correct across wrap
    if (available > mask_ + 1) {
      // Slots taken through seq_published() may be ahead of the tail's
      // store, which is still on its way: up to a ring's worth, that is lag.
      if (ahead_of_tail_ && lags(tail)) return RingResult::kEmpty;
      return RingResult::kCorrupt;
    }
    ahead_of_tail_ = false;
    cached_tail_ = tail;
    return available == 0 ? RingResult::kEmpty : RingResult::kOk;
  }

  // A racy hint for a polling consumer: true when the producer's tail (read
  // relaxed, no ordering) differs from our head. Consume with try_pop(),
  // whose refresh() re-reads the tail with acquire and validates it.
  // A tail that lags slots taken through seq_published() (by up to a
  // ring) has not moved; a garbage one has (refresh() then says kCorrupt).
  bool tail_moved_hint() const noexcept {
    const uint64_t tail = header_->tail.load(std::memory_order_relaxed);  // relaxed: a hint only
    const uint64_t d = tail - head_;
    return d != 0 && (d <= mask_ + 1 || !lags(tail));
  }
  // Asks the CPU to fetch the next slot's cache lines, so that a poller
  // waiting for that slot has its bytes on the way by the time the tail
  // says it is published (the two lines then cross between cores at once,
  // not one after the other). A hint only: no access, no effect on memory.
  void prefetch_next() const noexcept {
    const auto* bytes = reinterpret_cast<const char*>(&slots_[head_ & mask_]);
    for (size_t offset = 0; offset < sizeof(Slot); offset += kCacheLine) __builtin_prefetch(bytes + offset);
  }

  // Slots waiting as last seen; 0 for a tail that lags slots taken through
  // seq_published(), capacity for garbage.
  uint64_t depth_estimate() const noexcept {
    const uint64_t tail = header_->tail.load(std::memory_order_relaxed);  // relaxed: a hint only
    const uint64_t d = tail - head_;
    if (d <= mask_ + 1) return d;
    return lags(tail) ? 0 : mask_ + 1;
  }
  uint64_t head() const noexcept { return head_; }
  LaneHeader* header() const noexcept { return header_; }

 private:
  LaneHeader* header_ = nullptr;
  Slot* slots_ = nullptr;
  uint64_t mask_ = 0;
  uint64_t head_ = 0;
  uint64_t cached_tail_ = 0;
  bool ahead_of_tail_ = false;  // release() went past the last tail we read
  uint64_t max_seq_ = 0;        // the highest sequence released (see seq_published())

  uint64_t* first_word(uint64_t index) const noexcept {
    return const_cast<uint64_t*>(reinterpret_cast<const uint64_t*>(&slots_[index & mask_]));
  }

  // A tail behind our head by at most a ring: the producer's tail store
  // lagging slots taken through seq_published(), not garbage.
  bool lags(uint64_t tail) const noexcept { return head_ - tail <= mask_ + 1; }
};

}  // namespace shmps::shm
