// Device buffers a worker offers a server that runs in its own process
// (tests, embedding). A process cannot open its own CUDA IPC handles, so
// such a worker hands the server its allocation's base pointer and its
// event. They pass through this process's memory, never the segment: any
// peer that may write the segment could otherwise name a pointer of the
// server's own (its weights, its optimizer state) and have a pull write
// there, or an event the server would wait on. The descriptor carries only
// a token (layout.hpp, kBufferInProcess): random, and taken once, so one
// read from the segment by another process is of no use to it.
#pragma once

#include <cstdint>

#include "shmps/shm/layout.hpp"
#include "shmps/status.hpp"

namespace shmps::shm {

struct InProcessOffer {
  void* base = nullptr;   // the allocation's base pointer
  void* event = nullptr;  // the buffer's cudaEvent_t
};

// Keeps `offer` for this process's server and returns its token (from
// getrandom(2), never 0, not one kept now).
Result<uint64_t> offer_in_process(InProcessOffer offer);

// Forgets the offer of `token` if it is still kept (0: nothing).
void withdraw_in_process(uint64_t token) noexcept;

// The offer a kBufferInProcess descriptor names, taken (kept no more):
// only for a worker whose pid is this process's, and only a token this
// process offered and nobody took. Anything else is kBadRequest, naming
// which.
Result<InProcessOffer> take_in_process(const BufferDesc& desc, uint32_t worker_pid);

}  // namespace shmps::shm
