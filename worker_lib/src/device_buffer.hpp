// worker_lib's CUDA half (private): describing a device buffer for the
// server (IPC handle of its allocation, offset, device UUID, interprocess
// event) and recording that event before an asynchronous push, or waiting
// for the caller's stream before a blocking one. Built from
// device_buffer_cuda.cpp with CUDA, from device_buffer_stub.cpp without
// (every call then fails with kCuda "built without CUDA"). No CUDA types
// here. Thread-safe as the CUDA driver is; one buffer's event must not be
// recorded from two threads at once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shmps/status.hpp"

namespace shmps::detail {

struct DeviceBuffer {
  void* base = nullptr;  // the allocation's base (cuMemGetAddressRange)
  uint64_t offset = 0;   // of the buffer inside it, bytes
  uint64_t allocation_bytes = 0;
  uint8_t mem_handle[64] = {};  // cudaIpcMemHandle_t of the allocation
  uint8_t event_handle[64] = {};
  uint8_t device_uuid[16] = {};
  void* event = nullptr;        // CUevent (a cudaEvent_t), interprocess, no timing
  void* stream_mark = nullptr;  // CUevent, this process only, no timing: a blocking call's wait
  void* context = nullptr;      // CUcontext: the device's primary context, retained while the buffer lives
  int device = 0;               // ordinal in this process
};

// Describes [ptr, ptr + bytes): device memory of one cudaMalloc
// allocation. `in_process`: the server runs in this process; no IPC
// handles are made (the server uses base and event directly). Errors:
// kInvalidArgument (not device memory, managed memory, beyond its
// allocation), kCuda (memory legacy CUDA IPC cannot export: cudaMallocAsync
// pools, VMM/cuMemCreate, expandable segments; or any failed call, named),
// kCuda "built without CUDA", or no NVIDIA driver (libcuda.so.1) in this
// process.
Result<DeviceBuffer> describe_device_buffer(const void* ptr, size_t bytes, bool in_process);
// Records the buffer's event on `stream` (a cudaStream_t; nullptr: the
// legacy default stream), after the work that wrote the buffer.
Status record_device_event(const DeviceBuffer& buffer, void* stream);
// Records the buffer's private (not interprocess) event on `stream`, as
// above: a blocking call then waits for it (device_stream_marked) instead
// of sending the interprocess event to the server. Same ordering as the
// interprocess record, the legacy default stream's implicit
// synchronisation included.
Status mark_device_stream(const DeviceBuffer& buffer, void* stream);
// Whether the last mark_device_stream() has been reached (cuEventQuery):
// true, false while the stream's work before it runs, or kCuda naming the
// failure (an error of that work too).
Result<bool> device_stream_marked(const DeviceBuffer& buffer);
// Destroys the event and releases the context (after the server closed its
// side: unregister done).
void release_device_buffer(DeviceBuffer& buffer);
// cuMemAlloc of `bytes` in device `device`'s primary context (DeviceMemory).
// Errors: kCuda, named.
Result<void*> allocate_device_memory(size_t bytes, int device);
void free_device_memory(void* ptr, int device);

}  // namespace shmps::detail
