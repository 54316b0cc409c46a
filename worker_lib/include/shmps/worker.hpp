// shmps::Worker: a training process's connection to one shmps-server.
// A Worker attaches to the server's control segment, registers buffers
// (POSIX shm objects it creates and the server maps once), pushes gradients
// from them and pulls weights into them, by descriptor through its own
// request lane: no gradient byte goes through the ring or a socket.
//
// Testing aid: with SHMPS_FAULT=<point>[:<n>] in the environment, the
// process SIGKILLs itself the n-th time (default 1st) it reaches <point>
// (with :stop appended, SHMPS_FAULT=<point>:<n>:stop, it SIGSTOPs itself
// instead): after_claim, after_buffer_create, after_register,
// before_publish, after_publish, after_doorbell, after_completion,
// after_cancel (tests/integration/test_faults.cpp, docs/reliability.md).
// Unset, it costs a predictable branch per point.
//
// Device buffers (register_device_buffer): CUDA memory stays where it is;
// the server maps its allocation once by CUDA IPC handle. The server's
// reads and writes come after the caller's work on its stream: a blocking
// call waits for that stream before it sends, an asynchronous one records
// an interprocess event on it that the server's stream waits for. No CUDA
// types appear here: streams are void*.
//
// Thread safety: one Worker is used by one thread at a time (it owns one
// single-producer lane). Separate Worker objects, in one process or many,
// are independent. Buffer memory may be written by any thread, but not while
// a push that reads it, or a pull that writes it, is in flight, nor during
// a detach (detach(), the destructor), which may copy it (detach_timeout).
// Processes: a Worker belongs to the process that connected it. In a
// fork()ed child, every call of an inherited Worker fails with
// kInvalidArgument ("connect its own": sharing the parent's lane would
// corrupt it), and its destructor only unmaps, leaving the parent's session
// and buffers alone; the child connects a Worker of its own. The child's
// writes into the memory of the parent's host buffers stay its own: an
// atfork child handler maps every host buffer of the process again
// MAP_PRIVATE at the same address, so they go to copy-on-write pages, as
// with any other memory of a forked child, never to the parent or the
// server. Pages the child has not written read the buffer object, so they
// show what the parent's pulls write later (not a snapshot of the fork's
// moment). A mapping whose object is no longer at its name (unregistered
// before the fork, or unlinked by the server) stays shared. A child made
// without the atfork handlers (_Fork(), a raw clone()) is told apart by
// detach() and the destructor (its pid) but not by the other calls: it
// must not use the parent's Worker, and its buffers stay shared. After an exec() without detach(), the
// process keeps its entry and buffer objects (the same pid and start time)
// until it exits.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <sys/types.h>

#include "shmps/server_stats.hpp"
#include "shmps/status.hpp"

namespace shmps {

// Element types of tensors and gradients. Values match the shm layout.
enum class Dtype : uint32_t { kF32 = 1, kF16 = 2, kBF16 = 3 };
size_t dtype_size(Dtype dtype) noexcept;  // 4, 2, 2; 0 outside the enum

// Names "all tensors as one flat fp32 range" in push/pull.
inline constexpr uint32_t kAllTensors = 0xFFFFFFFFu;

struct TensorInfo {
  uint32_t id = 0;
  std::string name;             // e.g. "fc1.weight"
  Dtype dtype = Dtype::kF32;    // of the weights; always kF32 today
  std::vector<uint64_t> shape;  // e.g. {256, 784}
  uint64_t element_offset = 0;  // in the flat parameter vector, elements
  uint64_t element_count = 0;
};

// A racy snapshot of the server's counters (each field is read atomically,
// the set is not): one uint64_t per counter of shmps/server_stats.hpp,
// where each is described, and the mean staleness as a double.
struct ServerStats {
#define SHMPS_STATS_FIELD(name, source, from) uint64_t name = 0;
  SHMPS_SERVER_STATS(SHMPS_STATS_FIELD)
#undef SHMPS_STATS_FIELD
  double avg_staleness = 0.0;  // avg_staleness_micro / 1e6: the mean of the last 128 applied pushes
};

// The longest wait a WorkerOptions timeout asks for: 100 years, far past
// any job, and short enough that the steady clock plus it, in nanoseconds,
// cannot overflow.
inline constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365 * 100);

struct WorkerOptions {
  std::string name;  // server --name
  // Per synchronous call, all its waits together: a re-attach (reconnect)
  // and its registrations, a device buffer's stream, a full lane, the
  // answer; longer than kMaxTimeout is taken as kMaxTimeout (as is
  // wait_for_server), in effect without end.
  std::chrono::milliseconds timeout{10000};
  // When the server dies or is restarted: the calls in flight fail with
  // kServerRestarted (not acknowledged: maybe applied, at most once), and
  // the next call waits (up to its timeout) for a server of a new
  // generation under the same name, attaches to it, registers every buffer
  // again under its old id, then proceeds (a buffer the new server refuses,
  // its object shrunk or gone, is let go and leaves the others registered:
  // that call returns the refusal, naming the buffer, calls on its id get
  // kUnknownBuffer, and the id serves the next registration; a
  // registration that times out, is interrupted or meets a server that is
  // stopping fails that call so, and the buffers not registered yet are
  // registered by the next call, before its own request; a server that
  // dies under a re-attach's registrations is waited past as the one
  // before was, while one that is stopping, or that dies under the
  // registrations of a call in a session that held, fails that call; the
  // buffers stay pending either way, and are registered with the next
  // server). A call that gives up waiting for a
  // server says what it last found at the name (no segment, one not
  // published yet, of another layout...). A push fails with
  // kServerRestarted, nothing sent, while the worker's weights are of
  // another generation than the server's: from a re-attach, whichever
  // call made it, until a pull or an init is answered (its gradient was
  // computed against the old server's weights: pull again). Without it such calls return
  // kServerNotRunning and the Worker stays unusable: every later call, and
  // every wait for a request in flight, fails at once the same way. Either
  // way, answers the server posted before it died are still returned by
  // wait().
  // The same holds when the server evicts this worker (its process was
  // stopped longer than the server's --stopped-worker-timeout-ms, or its
  // lane looked corrupt): with reconnect, calls in flight fail with
  // kServerRestarted (those dropped by the eviction were never applied)
  // and the next call attaches again to the same server; without it,
  // every call returns kUnknownWorker ("the server evicted worker N").
  bool reconnect = false;
  // How long connect() waits for its server: for the segment to appear at
  // the name and a live server to own it (a worker started before its
  // server, or while systemd restarts it), polling every 10 ms. 0 (the
  // default): connect() answers kServerNotRunning at once, so a mistyped
  // name or a server that is not coming is reported without delay; set it
  // where workers may start first or ride out a restart (a unit restarts
  // 2 s after a crash, then restores its checkpoint: 30 s is ample).
  std::chrono::milliseconds wait_for_server{0};
  // The user the server runs as, when it is neither this process's user
  // nor root: a login name or a numeric uid. A worker attaches only to a
  // segment owned by this process's user, root, or that user (empty, the
  // default: the packaged unit's user "shmps" where it exists), that is not
  // world-writable and that gives its group access only if the server was
  // started with --group-access; connect() refuses anything else with
  // kPermission, naming the object's owner, mode and the fix. A name that
  // no user has is kInvalidArgument.
  std::string server_user;
  // Asked while a call waits: for an answer once the wait sleeps (about
  // every 20 ms; not during its first spin, up to 20,000 polls), for the
  // server to accept an attach, to come back (reconnect) or to appear
  // (wait_for_server); not during a detach, nor while connect()
  // waits up to 2 s for a starting server to publish its segment. True
  // ends the wait: the call fails with kInterrupted. A request already
  // sent stays in flight, as after kTimeout: the server may still serve
  // it (a push may still be applied), and wait() still collects a ticket
  // (an answer that came meanwhile is kept for it; a synchronous call's
  // answer, which nothing can collect, is let go). The pulls sent so far
  // that the server holds back (--staleness-policy wait) are withdrawn (as
  // a detach withdraws them): the server answers them kInterrupted at
  // once, so the requests behind them go on. Not asked while a buffer is
  // registered or unregistered. Runs on the calling thread; must not
  // throw, nor call this Worker (such a call fails with
  // kInvalidArgument). For a caller that must stay responsive to its
  // user: the Python binding runs the interpreter's signal handlers here
  // (Ctrl-C), a C++ job may read its stop flag. Empty (the default): waits
  // end only by their answer, their timeout or the session's end.
  std::function<bool()> interrupted;
  // The longest a detach (detach(), the destructor) waits for the server's
  // answer, whatever `timeout` says (the shorter of the two applies; more
  // than kMaxTimeout is taken as kMaxTimeout): a program that ends, or
  // drops its Worker, while its server is stopped or wedged is held this
  // long at most, also with a timeout in effect without end. A detach not
  // answered in time (kTimeout) or interrupted (below) ends on this side
  // all the same: the Worker is detached and its buffer objects unlinked;
  // the request stays in the lane, the server serves it when it runs
  // again, and the entry is free for another worker once this process is
  // gone (the server reaps it, as a dead worker's). The requests sent
  // before it are served then too (a pull_async writes its buffer): a
  // host buffer the caller still maps (Buffer::mapping) is given a private
  // copy of its bytes at the detach, which the server never writes; a
  // device buffer's memory must stay allocated until the process ends.
  std::chrono::milliseconds detach_timeout{5000};
  // Asked while a detach waits, as `interrupted` is while the other calls
  // wait (`interrupted` is not asked then: a stop flag that ended a job's
  // calls must not cut its detach short). True ends the wait with
  // kInterrupted, as a detach that timed out. Runs on the detaching
  // thread; must not throw, nor call this Worker. The Python binding runs
  // the interpreter's signal handlers here during close() and detach(), so
  // Ctrl-C ends them. Empty (the default): the detach waits for its answer
  // or detach_timeout.
  std::function<bool()> detach_interrupted;
};

// A buffer registered with the server. `data` stays mapped while the Worker
// has it registered, or while any copy of `mapping` lives (a binding's view
// of the memory can outlive the registration: after unregister_buffer() or
// the Worker's end it is private memory the server no longer reads).
struct Buffer {
  uint32_t id = 0;
  void* data = nullptr;
  size_t size = 0;                // bytes
  std::shared_ptr<void> mapping;  // owns the mapping of `data`
};

// Device memory that legacy CUDA IPC can export (cuMemAlloc in the device's
// primary context, the one the CUDA runtime uses), for gradient and weight
// buffers where the framework's own memory cannot be exported (PyTorch
// with expandable segments). Register it with register_device_buffer();
// it must outlive that registration. Freed by the destructor.
class DeviceMemory {
 public:
  // `bytes` > 0 on device ordinal `device` (as this process numbers its
  // devices). Errors: kInvalidArgument, kCuda (no driver or device, out of
  // memory, "built without CUDA": the CUDA error is named).
  static Result<std::unique_ptr<DeviceMemory>> allocate(size_t bytes, int device);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  int device() const noexcept { return device_; }

 private:
  DeviceMemory(void* data, size_t size, int device) : data_(data), size_(size), device_(device) {}
  void* data_;
  size_t size_;
  int device_;
};

// How many fork()s made this process from the one it started as (bumped in
// each child by pthread_atfork). A Worker connected under another value is
// its parent's: its calls are refused ("a fork()ed child must connect its
// own"); a wrapper with state of its own (a lock a parent's thread may have
// held) compares the value it saw at connect() to tell the same.
uint64_t fork_generation();

class Worker {
 public:
  using Ticket = uint64_t;  // an asynchronous request's id

  // Opens the control segment "shmps.<name>", validates it and attaches,
  // waiting up to options.wait_for_server for a server to be there.
  // Errors: kServerNotRunning (no segment, or its server is dead or
  // stopping, for the whole wait: the message names the segment),
  // kLayoutMismatch (foreign file or other layout version: both versions
  // in the message), kPermission, kNoCapacity (max workers reached; while
  // an entry's process is gone, which the server frees within its
  // housekeeping period, the attach waits for it, within the timeout),
  // kTimeout, kInvalidArgument (timeout <= 0, wait_for_server < 0),
  // kInterrupted (options.interrupted).
  static Result<std::unique_ptr<Worker>> connect(const WorkerOptions& options);

  ~Worker();  // detaches (best effort, as detach()) and unmaps/unlinks its buffers
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  uint32_t worker_id() const noexcept;
  uint64_t generation() const noexcept;  // the server instance last attached to
  pid_t server_pid() const noexcept;     // that instance's process
  // One table for the Worker's life: a re-attach (reconnect) refuses a
  // server whose table differs, so references into it and find_tensor()'s
  // pointers stay valid as long as the Worker.
  const std::vector<TensorInfo>& tensors() const noexcept;
  uint64_t total_elements() const noexcept;  // all tensors, elements
  // The tensor of that name, or nullptr.
  const TensorInfo* find_tensor(const std::string& name) const noexcept;

  // Creates a POSIX shm object of `bytes` (> 0), mode 0600 (0660 with the
  // segment's group when the server shares its segment with a group, so a
  // server running as another user can map it), maps it and
  // registers it with the server, which maps it once. Its name is
  // "shmps.<server name>.p<pid>.<n>"; a name already taken (by this pid's
  // image before an exec(), or another copy of this library in the
  // process) is passed over for the next n.
  // The process's file size limit (RLIMIT_FSIZE, ulimit -f) counts
  // /dev/shm: past it the kernel sends SIGXFSZ, which ends a process that
  // does not ignore it (Python ignores it); one that does gets kIo naming
  // the limit.
  // Errors: kInvalidArgument, kNoCapacity (too many buffers, /dev/shm too
  // small, the worker's buffers past the server's
  // --max-worker-buffer-bytes), kIo, plus any error of a request
  // (kTimeout, kServerRestarted...).
  Result<Buffer> register_buffer(size_t bytes);
  // Registers [device_ptr, device_ptr + bytes) (bytes > 0): CUDA device
  // memory the caller allocated with cudaMalloc, or a piece of such an
  // allocation (a caching allocator's block), on a device the server can
  // reach. Nothing is copied: the server opens the allocation's IPC handle
  // once (a Worker in the server's own process passes the pointer
  // instead) and its kernels read gradients from, and pulls write weights
  // into, this memory in place. Returns the buffer id, from the same ids
  // as register_buffer(); unregister_buffer() releases it. The Worker does
  // not own the memory: it must stay allocated until unregister_buffer(),
  // detach() or the Worker's destruction (a detach the server did not
  // answer, kTimeout or kInterrupted: until the process ends, as
  // WorkerOptions::detach_timeout says). With reconnect it is registered
  // again after a server restart or an eviction, under the same id.
  // Errors: kInvalidArgument (null or 0 bytes; host or managed memory: use
  // register_buffer(); the range runs past its allocation), kCuda (no CUDA
  // device in this process; memory legacy CUDA IPC cannot export:
  // cudaMallocAsync pools, cuMemCreate/VMM, PyTorch's expandable segments;
  // "built without CUDA" from a library built with SHMPS_CUDA off; the
  // server could not open the handle or reach the device: the CUDA error is
  // named), kNoCapacity (all buffer ids in use; the worker's buffers past
  // the server's --max-worker-buffer-bytes), request errors.
  Result<uint32_t> register_device_buffer(const void* device_ptr, size_t bytes);
  // Errors: kUnknownBuffer and request errors.
  Status unregister_buffer(uint32_t buffer_id);

  // Pushes the gradient stored at [byte_offset, byte_offset + bytes) of
  // buffer `buffer_id` for tensor `tensor_id` (or kAllTensors: every tensor
  // in table order as one flat range), computed against `worker_version`.
  // bytes must equal element_count * dtype_size(dtype). Returns the
  // version after the update.
  // `stream` (a cudaStream_t; nullptr: the legacy default stream) matters
  // only for a device buffer: the gradient is the one written by the work
  // enqueued on `stream` before this call. push() waits (within its
  // timeout, interruptible) until that work has run, then sends: it
  // returns only after the server's apply anyway, and this spares the
  // server's next device work the delay an interprocess event record
  // costs (docs/cuda.md, "Ordering across processes"). push_async()
  // records an event on `stream` instead, and the server's kernel waits
  // for it on the device (no host synchronisation). When the push completes
  // (here, or in wait() for push_async) the server has finished reading the
  // buffer; the caller may overwrite it. Ignored for host buffers.
  // Errors: kStale (message has both versions), kBadRequest
  // (worker_version ahead of the server's: not a version it served),
  // kBadLength, kBadDtype,
  // kNonFinite, kUnknownBuffer, kUnknownTensor, kBadRange, kBusy (lane full
  // for the whole timeout), kTimeout, kServerNotRunning, kServerRestarted,
  // kShuttingDown, kCuda (a device buffer's stream or event failed; the
  // server's device failed), kInterrupted (WorkerOptions::interrupted).
  // On any error nothing was applied (a kCuda from the server's device: its
  // weights may be half-written, and the server stops; a kBadRange for a
  // buffer whose object shrank under the server as it applied the push,
  // which its NaN/Inf check catches before unless --allow-nonfinite: applied
  // with zeros for the lost pages, the buffer dropped), but for kTimeout
  // and kInterrupted, after which the push is still in flight and may be,
  // unless the message says nothing was sent (push() waiting for a device
  // buffer's stream, before it sends); and for kServerNotRunning,
  // kServerRestarted and kInternal once the push was sent: its server may
  // have applied it (and checkpointed that) before it died or before the
  // answer was lost (maybe applied, at most once), as `reconnect` says.
  Result<uint64_t> push(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, uint64_t bytes, Dtype dtype,
                        uint64_t worker_version, void* stream = nullptr);

  // As push(), but returns once the request is in the lane; wait() returns
  // its result. Up to `lane_capacity` requests may be in flight.
  // A training step's push and its next pull belong together this way:
  // push_async, then pull (served after the push, so it sees the update;
  // its timeout covers the push's service too), then wait for the push,
  // whatever the pull returned. The server serves both without a gap, and
  // the worker is woken once per step instead of twice: the pull does not
  // wait for the worker to be scheduled after the push's answer
  // (docs/benchmarks.md, "shmps-train with 2 workers").
  Result<Ticket> push_async(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, uint64_t bytes, Dtype dtype,
                            uint64_t worker_version, void* stream = nullptr);
  // Waits for `ticket`'s completion (all earlier ones complete first):
  // a push_async's or a pull_async's result. Wait for every ticket: the
  // answer of one never waited for stays held by the Worker.
  // Errors: those of push() or pull(); kInvalidArgument for a ticket never
  // issued or already waited for, but for one lost with its session (a
  // server gone, an eviction): that answers its loss (kServerRestarted or
  // kServerNotRunning) every time it is asked.
  Result<uint64_t> wait(Ticket ticket);
  // True when wait(ticket) returns at once: its answer came (and is kept
  // for wait, or was taken), or it was lost with its session. An answer
  // comes in request order, so a later request's answer means this one's
  // came too.
  bool answered(Ticket ticket) const noexcept;

  // Copies a consistent snapshot of tensor `tensor_id` (or kAllTensors)
  // as fp32 into buffer `buffer_id` at `byte_offset`; returns its version.
  // For a device buffer, `stream` (as in push) is where the caller's last
  // use of the buffer was enqueued (e.g. reads of the previous weights):
  // the server's copy comes after it (pull waits for the stream before it
  // sends, pull_async records an event, as push and push_async); when pull
  // returns the weights are in the buffer, and work the caller enqueues
  // afterwards sees them.
  // Under the server's --staleness-policy wait, a pull by a worker more
  // than max_staleness clocks (applied pushes) ahead of the slowest worker
  // is held until the slowest catches up or leaves; after most of the
  // timeout (all but a quarter of it, at least 50 ms or half of it, at
  // most 500 ms) it fails with kTimeout saying whom it waited for.
  // Errors: kUnknownBuffer, kUnknownTensor, kBadRange, kCuda (the stream
  // or the event failed), kTimeout and request errors. A kTimeout or
  // kInterrupted of pull() or init() while waiting for a device buffer's
  // stream (before the request is sent) says nothing was
  // sent.
  Result<uint64_t> pull(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, void* stream = nullptr);
  // As pull(), but returns once the request is in the lane; wait() returns
  // the version pulled, or the error (the server's refusals, such as
  // kUnknownBuffer, come only there), once the weights are in the buffer
  // (its range is written until then): a worker may work on while the
  // weights come, from another buffer or range. The submit and the wait
  // each get the timeout.
  Result<Ticket> pull_async(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, void* stream = nullptr);

  // Sets the server's weights at version 0 from the buffer: every tensor
  // in table order as fp32 at [byte_offset, + total_elements() * 4) (for a
  // device buffer, written by the work enqueued on `stream` before this
  // call), as a framework that initialises its own model needs (ps-lite's
  // init). Accepted once, and only before the server applied any push; of
  // concurrent initialisers the first wins.
  // Errors: kInitRefused (already initialised, by whom, or pushes applied:
  // the message says which), kNonFinite (NaN or Inf, unless the server
  // allows them), kBadLength, kBadRange, kUnknownBuffer, kCuda (a device
  // buffer's stream failed), request errors.
  // Nothing changes on any error.
  Status init(uint32_t buffer_id, uint64_t byte_offset = 0, void* stream = nullptr);

  // The server's version in the last answer this Worker received, a
  // rejection's included: after push() or wait() fails with kStale, the
  // version the push was behind. 0 before the first answer.
  uint64_t last_version() const noexcept;

  Result<ServerStats> stats();
  // An empty request: the ring's round trip. Errors: request errors.
  Status ping();
  // Detaches explicitly (the destructor does it too). Final, with reconnect
  // too, and whatever it returns: further calls fail with kUnknownWorker
  // and nothing attaches again; wait() still returns the answers to
  // requests made before (one the detach left unanswered:
  // kServerRestarted). A session already ended (server gone, eviction)
  // ends here without a request. Waits for the server's answer at most
  // WorkerOptions::detach_timeout (kTimeout after it) and while
  // WorkerOptions::detach_interrupted says no (kInterrupted).
  Status detach();

  class Impl;

 private:
  explicit Worker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shmps
