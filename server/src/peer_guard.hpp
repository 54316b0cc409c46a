// Survives a process that shrinks (ftruncate) an object the server has
// mapped: touching a page past the object's new end raises SIGBUS.
// - A worker's buffer: when the faulting address lies in a registered peer
//   range, the handler maps a private zero page over it (reads see zeros,
//   writes go nowhere), marks the range poisoned and returns; the server
//   then rejects the request and drops the buffer.
// - The server's own control segment, which every worker may write and so
//   shrink: the handler grows the object back to its size through the
//   creator's descriptor (ftruncate is async-signal-safe), so the access
//   retries on the lost pages, now zeros and shared again, and counts it;
//   the server then rewrites what it published there (Server, "repair").
// Faults anywhere else, or in the segment while it is not short, keep
// their default action (a real crash). Registration is lock-free and
// async-signal-safe to read; register and release from the consumer thread
// only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shmps/shm/layout.hpp"

namespace shmps::server {

// Installs the SIGBUS handler once per process (idempotent, thread-safe).
void install_peer_guard();

// Ranges guarded at once in a process: every buffer one server can hold
// (workers x buffers, at the limits).
inline constexpr uint32_t kGuardedRanges = shm::kMaxWorkersLimit * shm::kMaxBuffersLimit;

// A registered range; 0 when all kGuardedRanges are in use: the caller
// then refuses the buffer (unguarded, its truncation would kill the
// server).
using GuardId = uint32_t;
GuardId guard_range(const void* begin, size_t bytes);
void release_range(GuardId id);
// True once a fault hit the range (and stays true).
bool range_poisoned(GuardId id);

// The control segment: [begin, begin + bytes) mapped from `fd`, which
// stays open while guarded. One at a time (a later call replaces it);
// unguard_segment(begin) ends it before the mapping goes, if it is still
// the one guarded.
void guard_segment(const void* begin, size_t bytes, int fd);
void unguard_segment(const void* begin);
// How many times the handler grew the segment back; only grows.
uint64_t segment_regrowths();

}  // namespace shmps::server
