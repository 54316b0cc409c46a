// The two ends of a single-producer single-consumer ring in shared memory: a
// request lane (worker -> server) or a completion queue (server -> worker).
// Each end keeps its own index locally and never trusts the peer's copy
// blindly: an index from the peer that would put more than `capacity` slots
// in flight is reported as kCorrupt, and a slot is copied out before it is
// released, so a late or buggy peer can never change what was validated.
// One producer object and one consumer object per ring, each used by one
// thread at a time; the two may live in different processes.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "shmps/shm/layout.hpp"

namespace shmps::shm {

enum class RingResult { kOk, kEmpty, kFull, kCorrupt };

template <typename Slot>
class SpscProducer {
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
    std::memcpy(&slots_[tail_ & mask_], &slot, bytes < sizeof(Slot) ? bytes : sizeof(Slot));
    return RingResult::kOk;
  }
  void publish() noexcept {
    ++tail_;
    // SYNC(slot_published): release pairs with the consumer's acquire load
    // of tail; it publishes the slot bytes written by stage().
    header_->tail.store(tail_, std::memory_order_release);
  }

  // Slots in flight as last seen (may be stale: the consumer moves on).
  uint64_t in_flight_estimate() const noexcept {
    return tail_ - header_->head.load(std::memory_order_relaxed);  // relaxed: a hint only
  }
  // True when at least one slot is free. Reads the consumer's head (acquire:
  // see stage()) only when the last head read says the ring is full: the
  // consumer stores its head on every pop, so reading it each time costs a
  // cache-line transfer between cores per request (about 35 ns of a 4 KiB
  // push's round trip, by perf). A head that is impossible counts as space:
  // stage() then reports kCorrupt.
  bool has_space() noexcept {
    if (tail_ - cached_head_ <= mask_) return true;
    cached_head_ = header_->head.load(std::memory_order_acquire);  // SYNC(slot_released)
    return tail_ - cached_head_ <= mask_;
  }
  uint64_t tail() const noexcept { return tail_; }
  LaneHeader* header() const noexcept { return header_; }

 private:
  LaneHeader* header_ = nullptr;
  Slot* slots_ = nullptr;
  uint64_t mask_ = 0;
  uint64_t tail_ = 0;
  uint64_t cached_head_ = 0;
};

template <typename Slot>
class SpscConsumer {
 public:
  SpscConsumer() = default;
  SpscConsumer(LaneHeader* header, Slot* slots, uint32_t capacity, uint64_t start = 0)
      : header_(header), slots_(slots), mask_(capacity - 1), head_(start), cached_tail_(start) {}

  // Copies the oldest slot into *out and releases it. kEmpty when none,
  // kCorrupt when the producer's tail is impossible (nothing is consumed).
  RingResult try_pop(Slot* out) noexcept {
    if (RingResult r = refresh(); r != RingResult::kOk) return r;
    std::memcpy(out, &slots_[head_ & mask_], sizeof(Slot));
    ++head_;
    // SYNC(slot_released): release pairs with the producer's acquire load of
    // head: the copy above is complete before the slot can be reused.
    header_->head.store(head_, std::memory_order_release);
    return RingResult::kOk;
  }

  // The oldest slot, in place, for a consumer that copies out only the
  // bytes it needs: nullptr when refresh() says kEmpty or kCorrupt. The
  // bytes may change under the reader only if the producer is buggy (it
  // does not write a published slot before its release): copy, then
  // validate the copy. release() frees it.
  const Slot* peek() noexcept { return refresh() == RingResult::kOk ? &slots_[head_ & mask_] : nullptr; }
  void release() noexcept {
    ++head_;
    // SYNC(slot_released): as in try_pop().
    header_->head.store(head_, std::memory_order_release);
  }

  // kOk when a slot is available, kEmpty or kCorrupt otherwise.
  RingResult refresh() noexcept {
    if (head_ != cached_tail_) return RingResult::kOk;
    // SYNC(slot_published): acquire pairs with the producer's release store.
    const uint64_t tail = header_->tail.load(std::memory_order_acquire);
    const uint64_t available = tail - head_;  // unsigned: correct across wrap
    if (available > mask_ + 1) return RingResult::kCorrupt;
    cached_tail_ = tail;
    return available == 0 ? RingResult::kEmpty : RingResult::kOk;
  }

  // A racy hint for a polling consumer: true when the producer's tail (read
  // relaxed, no ordering) differs from our head. Consume with try_pop(),
  // whose refresh() re-reads the tail with acquire and validates it.
  bool tail_moved_hint() const noexcept {
    return header_->tail.load(std::memory_order_relaxed) != head_;  // relaxed: a hint only
  }
  // Asks the CPU to fetch the next slot's cache lines, so that a poller
  // waiting for that slot has its bytes on the way by the time the tail
  // says it is published (the two lines then cross between cores at once,
  // not one after the other). A hint only: no access, no effect on memory.
  void prefetch_next() const noexcept {
    const auto* bytes = reinterpret_cast<const char*>(&slots_[head_ & mask_]);
    for (size_t offset = 0; offset < sizeof(Slot); offset += kCacheLine) __builtin_prefetch(bytes + offset);
  }

  // Slots waiting as last seen; clamps garbage to capacity.
  uint64_t depth_estimate() const noexcept {
    const uint64_t d = header_->tail.load(std::memory_order_relaxed) - head_;  // relaxed: a hint only
    return d > mask_ + 1 ? mask_ + 1 : d;
  }
  uint64_t head() const noexcept { return head_; }
  LaneHeader* header() const noexcept { return header_; }

 private:
  LaneHeader* header_ = nullptr;
  Slot* slots_ = nullptr;
  uint64_t mask_ = 0;
  uint64_t head_ = 0;
  uint64_t cached_tail_ = 0;
};

}  // namespace shmps::shm
