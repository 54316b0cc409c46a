// Survives a worker that shrinks (ftruncate) a buffer the server has mapped:
// touching a page past the object's new end raises SIGBUS. The guard's
// handler, when the faulting address lies in a registered peer range, maps
// a private zero page over it (reads see zeros, writes go nowhere), marks
// the range poisoned and returns; the server then rejects the request and
// drops the buffer. Faults anywhere else keep their default action (a real
// crash). Registration is lock-free and async-signal-safe to read; register
// and release from the consumer thread only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmps::server {

// Installs the SIGBUS handler once per process (idempotent, thread-safe).
void install_peer_guard();

// A registered range; 0 when the table (4096 ranges) is full, then the
// range is unguarded and a truncation would crash the server as before.
using GuardId = uint32_t;
GuardId guard_range(const void* begin, size_t bytes);
void release_range(GuardId id);
// True once a fault hit the range (and stays true).
bool range_poisoned(GuardId id);

}  // namespace shmps::server
