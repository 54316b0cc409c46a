// The seam between the protocol and the memory that holds the weights: the
// host backend (host memory, POSIX shm peer buffers) and the CUDA backend
// (device memory, CUDA IPC peer buffers) implement it. Used only by the
// server's consumer thread.
//
// Completion: apply() and copy_out() may only ENQUEUE their work (the CUDA
// backend does: one stream, in request order). After a request the server
// takes fence(); while fence_done() says false it keeps the request's
// completion (and every later one of that worker) back and serves other
// lanes. A synchronous backend (host) keeps the defaults: fence() is 0,
// "nothing outstanding", and the completion is posted at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/server/config.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

// A worker's registered buffer, mapped by the server once.
// Shared, not unique: a request whose device work is still running keeps
// its buffer alive, so closing a mapping (unregister, detach, death) is
// deferred until that work is done. The destructor closes the mapping.
class PeerBuffer {
 public:
  virtual ~PeerBuffer() = default;
  virtual uint64_t length() const noexcept = 0;  // bytes requests may use
  // The POSIX shm object mapped (a kHostShm buffer), or null (device memory).
  virtual const shm::ShmObject* host_object() const noexcept { return nullptr; }
};

// Which POSIX shm object a worker may register as a kHostShm buffer: one
// named `prefix` and a number ("shmps.<name>.p<pid>.<n>", the worker's
// pid), with that one name (a second is a hard link, which any process
// that may write an object can make under any name: to the control
// segment, to another worker's buffer), and none that `taken_as` names.
struct PeerObjectRule {
  std::string prefix;
  // What the object of this identity is when it is not the worker's to
  // register (the control segment, a buffer another worker registered),
  // for the refusal; empty: it may be. Unset: none is taken.
  std::function<std::string(const shm::ShmObject::Identity&)> taken_as;
};

struct TensorExtent {
  uint64_t element_offset;
  uint64_t element_count;
};

// What a worker needs to map the weights itself (CUDA backend): the IPC
// handle of the weights' allocation, its size and the device's UUID.
struct WeightsExport {
  bool present = false;
  uint8_t ipc_handle[64] = {};
  uint64_t allocation_bytes = 0;
  uint8_t device_uuid[16] = {};
};

// Identifies the device work enqueued up to some point; 0: none. Fences
// of one backend increase; fence_done(f) implies fence_done(g) for g < f.
using Fence = uint64_t;

// Device work this late is stuck (a stream waiting on a dead worker's
// event that is never recorded, say): a held completion's, an orphaned
// one's or a synchronize()'s wait ends with an error then.
inline constexpr uint64_t kDeviceStallNs = 60'000'000'000;
class Backend {
 public:
  virtual ~Backend() = default;
  virtual shm::Backend kind() const noexcept = 0;
  const char* name() const noexcept { return shm::backend_name(static_cast<uint32_t>(kind())); }

  // True when apply() and copy_out() may return before their work is done
  // (fence() then tracks it, and the server keeps the peer buffer mapped
  // until its fence is done); false when every call finishes its work
  // before returning (the host backend), so nothing needs holding.
  virtual bool asynchronous() const noexcept { return false; }
  // A fence covering everything enqueued so far; 0 when nothing is
  // outstanding (synchronous backends, always).
  virtual Fence fence() { return 0; }
  // True once all work up to `fence` has finished (its reads of peer
  // buffers included). Never blocks. An error means the work failed: the
  // message names the CUDA error; then healthy() says whether the backend
  // can go on.
  virtual Result<bool> fence_done(Fence fence) {
    (void)fence;
    return true;
  }
  // Ok while the backend can serve; an error once its device context is
  // lost (a sticky CUDA error): the server must stop, failing what is in
  // flight, and say that the weights may be half-written.
  virtual Status healthy() { return Status::Ok(); }
  // Waits for all enqueued work (shutdown, checkpoints, tests), at most
  // kDeviceStallNs: work not done by then is stuck (a kCuda error).
  virtual Status synchronize() { return Status::Ok(); }
  // The weights' export, published in the segment; absent for host memory.
  virtual WeightsExport weights_export() const { return {}; }
  // The segment's statistics, for the counters a backend keeps itself (the
  // CUDA backend's IPC handle opens and closes). Set once, after the
  // segment is made and before the first open_peer(); the block outlives
  // every PeerBuffer (the server destroys its sessions before its segment).
  virtual void set_stats(shm::StatsBlock* stats) { (void)stats; }

  // Allocates the weights (`total` fp32, the sum of the extents) and
  // `state_arrays` optimizer state arrays of the same length, all zeroed
  // and touched, so memory the host or device lacks fails the start (with
  // the bytes asked for in the message), not a later update.
  virtual Status allocate(const std::vector<TensorExtent>& tensors, size_t state_arrays, uint64_t total) = 0;
  // Writes weights [first, first + values.size()) (the initial values,
  // after allocate(); within the allocation).
  virtual Status write_weights(uint64_t first, std::span<const float> values) = 0;

  // Opens the buffer a worker described (a private copy of its desc; the
  // backend validates kind and handle). `rule`: which shm object a host
  // buffer of this worker may be (open_worker_object()). Errors:
  // kUnknownBuffer (cannot open), kBadRange (offset + length beyond the
  // object), kPermission, kBadRequest (a kind this backend does not take,
  // an object the rule refuses), kCuda.
  virtual Result<std::unique_ptr<PeerBuffer>> open_peer(const shm::BufferDesc& desc, const PeerObjectRule& rule) = 0;
  // As open_peer, knowing the worker's pid (the server's own pid: an
  // embedded worker, whose CUDA buffer is used by pointer, never through
  // IPC). The server calls this one.
  virtual Result<std::unique_ptr<PeerBuffer>> open_peer_of(const shm::BufferDesc& desc, const PeerObjectRule& rule,
                                                           uint32_t worker_pid) {
    (void)worker_pid;
    return open_peer(desc, rule);
  }

  // After an access: kBadRange when the peer's memory vanished under it (a
  // worker truncated its object); the buffer must then be dropped.
  virtual Status peer_intact(const PeerBuffer& peer) = 0;

  // Whether the n gradient elements of `dtype` at byte_offset in `grad` are
  // all finite. Range checks were done by the caller: [byte_offset,
  // +n*size) lies inside `grad`. Errors: the backend's own (kCuda: the check
  // could not run; see healthy() for whether the device is lost).
  virtual Result<bool> all_finite(const PeerBuffer& grad, uint64_t byte_offset, uint64_t n,
                                  kernels::GradDtype dtype) = 0;
  // The most CPU threads the next all_finite() and apply() of a large
  // tensor (kernels::kCpuSplitMinElements) may split over; returns how
  // many they will use (0: no CPU threads, the work is the device's). Only
  // the host backend computes on CPUs.
  virtual uint32_t set_apply_threads(uint32_t threads) noexcept {
    (void)threads;
    return 0;
  }
  // One optimizer step of tensor `tensor` (index into the extents).
  virtual Status apply(const kernels::OptimizerConfig& config, uint32_t tensor, uint64_t step, const PeerBuffer& grad,
                       uint64_t byte_offset, kernels::GradDtype dtype) = 0;
  // Copies weights [element_offset, +n) as fp32 into `dst` at byte_offset.
  virtual Status copy_out(uint64_t element_offset, uint64_t n, PeerBuffer& dst, uint64_t byte_offset) = 0;
  // The reverse (a worker's init): weights [element_offset, +n) from the
  // fp32 values in `src` at byte_offset. Range checks were done by the caller.
  virtual Status copy_in(uint64_t element_offset, uint64_t n, const PeerBuffer& src, uint64_t byte_offset) = 0;
  // Federation (federation_link.hpp), between two requests: all weights,
  // flat, into `dst` (exactly the allocation's length), and W += `delta`
  // (the same length), each finished on return. Errors: kInternal (a
  // length that differs), the device's.
  virtual Status snapshot_weights(std::span<float> dst) = 0;
  virtual Status add_to_weights(std::span<const float> delta) = 0;
  // All weights, flat, to host memory (tests, checkpoints), once the work
  // enqueued before is done. Errors: the device's (a failed read returns
  // no values: a checkpoint must never store what it did not read).
  virtual Result<std::vector<float>> read_weights() = 0;
  // All optimizer state arrays, one after another (state_arrays x total),
  // as read_weights().
  virtual Result<std::vector<float>> read_state() = 0;
  // Replaces weights and state (a checkpoint's; sizes as allocated).
  virtual Status load(std::span<const float> weights, std::span<const float> state) = 0;
};

std::unique_ptr<Backend> make_host_backend();

// Opens the POSIX shm object a worker's kHostShm descriptor names, for any
// backend that maps host buffers: the name must be NUL-terminated within
// `handle` and be `rule.prefix` and a number ("shmps.<name>.p<pid>.<n>"),
// the object must have that one name and be none that `rule.taken_as`
// names (checked on the opened descriptor, before anything is mapped:
// never the control segment or another worker's buffer, whatever name a
// hard link gives them), and [offset, offset + length) (bytes) must lie
// inside it. Maps that window alone (ShmObject::open_window(): data() is
// byte `offset`), so a descriptor of a few bytes of a sparse object of
// terabytes costs the server a page of address space. Errors: kBadRequest
// (the name, a second name, an object taken), kPermission, kUnknownBuffer
// (cannot open), kBadRange. Thread-safe when `rule.taken_as` is.
Result<std::unique_ptr<shm::ShmObject>> open_worker_object(const shm::BufferDesc& desc, const PeerObjectRule& rule);

// The CUDA backend on the device `device` names (a UUID "GPU-xxxxxxxx-...",
// a PCI bus id "0000:3b:00.0", or "" for the first visible device), after
// its start-up probes. Errors: kCuda with the fix in the message (also in
// a build without CUDA).
Result<std::unique_ptr<Backend>> make_cuda_backend(const std::string& device);
// Whether make_cuda_backend("") could find a device (for --backend auto);
// `reason` receives why not.
bool cuda_backend_available(std::string* reason);

// The backend for --backend `kind` on --device `device` (see
// cuda_backend_select.cpp; auto falls back to host with a log line).
Result<std::unique_ptr<Backend>> select_backend(BackendKind kind, const std::string& device);

}  // namespace shmps::server
