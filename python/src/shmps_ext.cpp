// shmps._shmps: the compiled half of the Python package, a thin nanobind
// binding of shmps::Worker (worker_lib). shmps/__init__.py builds the
// Pythonic API on it: keyword arguments, dataclasses, exception classes,
// torch streams. Every call that waits for the server releases the GIL.
// Thread safety: a Worker's calls from several threads run one at a time
// (shmps::Worker serves one thread at a time); interrupt() and close() from
// another thread end the call that waits.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shmps/worker.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A non-ok Status on its way to Python; the translator below turns it into
// the exception class shmps._errors.make_error() picks for its code.
struct StatusError {
  shmps::Status status;
  uint64_t worker_version = 0;  // kStale: the version the push was computed against
  uint64_t server_version = 0;  // kStale: the server's version it was behind
};

void check(shmps::Status s) {
  if (!s.ok()) throw StatusError{std::move(s)};
}

template <typename T>
T take(shmps::Result<T>&& r) {
  if (!r.ok()) throw StatusError{r.status()};
  return std::move(r).value();
}

// The thread Python runs signal handlers on (threading.main_thread(),
// set by the package at import and in a fork()ed child).
std::atomic<unsigned long> main_thread{0};

// WorkerOptions::interrupted: while a call on the main thread waits with
// the GIL released, runs the interpreter's signal handlers. A handler that
// raised (Ctrl-C: KeyboardInterrupt) ends the wait and leaves its
// exception set, for raised_during() to raise once the call returns; the
// C++ call then fails with kInterrupted (an answer that came meanwhile is
// kept for wait()). A wait with the GIL held is left alone: nothing there
// would raise what a handler set. Also WorkerOptions::detach_interrupted's
// answer during close() and detach() (Stops::detach_asks), never for a
// Worker freed without close(): a deallocation has nowhere to raise to.
bool signal_handler_raised() {
  if (PyThread_get_thread_ident() != main_thread.load(std::memory_order_relaxed)) return false;  // relaxed: one word
  if (PyGILState_Check()) return false;
  nb::gil_scoped_acquire gil;
  return PyErr_Occurred() != nullptr || PyErr_CheckSignals() != 0;  // once raised, it stays the answer
}

// A Worker's life in the binding: open; closing (close() began, and every
// call waiting or begun meanwhile ends, until close() has the Worker);
// closed (the C++ Worker is gone).
enum class Life : uint8_t { kOpen, kClosing, kClosed };

// What other threads ask of a Worker's calls: interrupt() (ends the call
// waiting then) and close(). Shared by the PyWorker and its
// WorkerOptions::interrupted hook, which the Worker asks on the thread of
// its call.
struct Stops {
  std::atomic<uint64_t> interrupts{0};  // interrupt()s so far
  std::atomic<Life> life{Life::kOpen};
  uint64_t seen = 0;  // `interrupts` when the call in flight began: written and read by its thread under mu_
  // Whether a detach runs the signal handlers (close() and detach() set
  // it around theirs; the destructor's does not): written and read by the
  // thread holding mu_.
  bool detach_asks = false;

  // relaxed (here and at every access of these two): requests to stop
  // waiting that publish no data; a call that misses one sees it at its
  // next ask, 20 ms later.
  Life now() const { return life.load(std::memory_order_relaxed); }
  bool asked() const { return now() != Life::kOpen || interrupts.load(std::memory_order_relaxed) != seen; }
};

// The interpreter's exit, for GilReleased: set by an atexit hook (which
// runs with the GIL, before finalization begins); `reacquiring` counts the
// threads between their look at `exiting` and their return from
// PyEval_RestoreThread, which the hook waits out with the GIL released.
std::atomic<bool> exiting{false};
std::atomic<int> reacquiring{0};

// The GIL released for a scope (nb::gil_scoped_release, but for the
// interpreter's exit). A daemon thread that takes the GIL back once the
// interpreter finalizes is ended inside PyEval_RestoreThread (pthread_exit,
// whose unwinding through this noexcept destructor is std::terminate: an
// abort at exit). A thread other than the main one whose call returns
// after the atexit hook ran waits for the process's end instead, as Python
// 3.14 makes such threads do; the main thread (finalization runs on it)
// always takes the GIL back.
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    const bool main = PyThread_get_thread_ident() == main_thread.load(std::memory_order_relaxed);  // relaxed: one word
    // seq_cst, with the hook's: a thread that counts itself after the hook
    // looked sees `exiting`; one counted before is waited for.
    reacquiring.fetch_add(1, std::memory_order_seq_cst);
    if (!main && exiting.load(std::memory_order_seq_cst)) {
      reacquiring.fetch_sub(1, std::memory_order_seq_cst);
      for (;;) ::pause();
    }
    PyEval_RestoreThread(state_);
    reacquiring.fetch_sub(1, std::memory_order_seq_cst);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

// The atexit hook (main thread, GIL held): from here no other thread takes
// the GIL back through GilReleased; those already on their way get it now.
void at_exit() {
  exiting.store(true, std::memory_order_seq_cst);
  PyThreadState* state = PyEval_SaveThread();
  while (reacquiring.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  PyEval_RestoreThread(state);
}

// With the GIL: the exception a signal's handler raised while the call
// returning `result` waited, if any, instead of its result.
template <typename T>
T raised_during(T&& result) {
  if (PyErr_Occurred()) throw nb::python_error();
  return std::forward<T>(result);
}

// f() with the GIL released: every call that waits for the server.
template <typename F>
auto unlocked(F&& f) {
  auto result = [&] {
    GilReleased released;
    return f();
  }();
  return raised_during(std::move(result));
}

// Seconds as milliseconds, rounded up so that a positive wait never
// becomes 0; beyond what milliseconds hold (infinity too) saturated, which
// the worker library takes as shmps::kMaxTimeout. NaN is refused.
std::chrono::milliseconds to_ms(double seconds, const char* what) {
  if (std::isnan(seconds))
    throw StatusError{
        {shmps::ErrorCode::kInvalidArgument, std::string(what) + " must be a number of seconds, not NaN"}};
  const double ms = std::ceil(seconds * 1000.0);
  constexpr double kLimit = 9.0e18;  // below INT64_MAX, exactly representable
  if (ms >= kLimit) return std::chrono::milliseconds::max();
  if (ms <= -kLimit) return std::chrono::milliseconds::min();
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

// DLPack device types (dlpack.h): what __dlpack_device__ answers.
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;

// Memory a worker registered, seen from Python: the buffer protocol (host
// memory only) and DLPack (host and device). `keep` owns the memory (the
// shm mapping, or a DeviceMemory), so views stay valid after the buffer is
// unregistered; `owner` keeps a framework's tensor alive for
// register_device_buffer(tensor). `worker` and `registration` name the
// Worker and the registration it came from, so that a Buffer of another
// Worker (shmps/__init__.py), or one unregistered whose id now names
// another buffer (PyWorker::check_buffer()), is refused rather than sent
// as a bare id.
struct Buffer {
  uint32_t id = 0;
  uint64_t worker = 0;
  uint64_t registration = 0;
  void* data = nullptr;
  size_t nbytes = 0;
  int device_type = kDLCPU;
  int device_id = 0;
  std::shared_ptr<void> keep;
  nb::object owner;

  // A DLPack capsule of the bytes (uint8, 1-D), holding this Buffer alive.
  nb::object dlpack(nb::handle self) const {
    const size_t shape[1] = {nbytes};
    nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> array(data, 1, shape, self, nullptr, nb::dtype<uint8_t>(),
                                                          device_type, device_id);
    // nanobind casts an ndarray without a framework to a DLPack capsule
    // (some releases to an object whose __dlpack__ makes one).
    nb::object out = nb::cast(array, nb::rv_policy::reference);
    return nb::hasattr(out, "__dlpack__") ? out.attr("__dlpack__")() : out;
  }
};

int buffer_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  Buffer* b = nb::inst_ptr<Buffer>(nb::handle(self));
  if (b->device_type != kDLCPU) {
    PyErr_SetString(PyExc_BufferError,
                    "a device buffer has no buffer protocol: use torch.from_dlpack(buffer) for a view of it");
    return -1;
  }
  return PyBuffer_FillInfo(view, self, b->data, static_cast<Py_ssize_t>(b->nbytes), /*readonly=*/0, flags);
}

PyType_Slot buffer_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(buffer_getbuffer)}, {0, nullptr}};

// Per buffer registration, the push_async() answers that wait() took.
struct PushOutcomes {
  uint64_t applied = 0;
  uint64_t stale = 0;        // refused as too stale (kStale)
  uint64_t last_ticket = 0;  // the last answer taken (0: none)
  bool last_applied = false;
};

// shmps::Worker for Python; closed (null) after close().
class PyWorker {
 public:
  PyWorker(std::unique_ptr<shmps::Worker> w, std::shared_ptr<Stops> stops)
      : stops_(std::move(stops)), w_(std::move(w)) {
    note_identity();
  }
  // A Worker dropped without close() detaches here, as close() would, with
  // the GIL released: the detach waits for the server's answer (at most
  // WorkerOptions::detach_timeout, 5 s, or the Worker's timeout if shorter,
  // when the server is stopped or busy; no signal handler runs), and every
  // other thread runs meanwhile. No call is in flight: each holds a
  // reference. What the server may still write into outlives the Worker
  // when the detach was not answered (hold_past_close()).
  ~PyWorker() {
    if (forked()) {
      (void)w_.release();  // the parent's: its state may be mid-call in another parent thread
      abandon_books();
    } else if (w_ && PyGILState_Check()) {
      {
        GilReleased released;
        detach_and_free();
      }
      // A deallocation has nowhere to raise to: a warning turned error is
      // reported as unraisable.
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);
      if (!hold_past_close()) PyErr_WriteUnraisable(nullptr);
      PyErr_Restore(type, value, trace);
    }
  }

  uint64_t serial() const { return serial_; }

  // f(worker) with the GIL released, one call at a time: shmps::Worker
  // serves one thread at a time, and close() must not free it under a call
  // in flight on another thread. The GIL is released before the lock is
  // taken, so no thread waits for the lock holding the GIL; the holder
  // takes the GIL only to run signal handlers (signal_handler_raised()),
  // and a handler that calls this Worker again on that thread is refused
  // instead of waiting for the lock it holds.
  template <typename F>
  auto call(F&& f) {
    refuse_forked();
    refuse_reentry("a call");
    auto result = [&] {
      GilReleased released;
      Locked locked(*this);
      if (!w_ || stops_->now() != Life::kOpen)
        throw StatusError{{shmps::ErrorCode::kUnknownWorker, "this Worker is closed"}};
      stops_->seen = stops_->interrupts.load(std::memory_order_relaxed);  // relaxed: see Stops::asked()
      struct Noted {  // a re-attach inside f changed them, even where f throws
        PyWorker& w;
        ~Noted() { w.note_identity(); }
      } noted{*this};
      return f(*w_);
    }();
    return raised_during(std::move(result));
  }

  // The identity values as of the end of the last call (a re-attach inside
  // a call changes them), without the call lock: they answer while another
  // thread's call waits, and from a signal handler while this thread's
  // does (a repr() there).
  struct Identity {
    uint32_t worker_id = 0;
    uint64_t generation = 0;
    int64_t server_pid = 0;
    uint64_t total_elements = 0;
  };
  Identity identity() const {
    refuse_forked();
    if (closed()) throw StatusError{{shmps::ErrorCode::kUnknownWorker, "this Worker is closed"}};
    std::lock_guard<std::mutex> lock(identity_mu_);
    return identity_;
  }

  // Without the lock, so that it answers while another thread's call
  // waits: true from the moment close() begins.
  bool closed() const { return stops_->now() != Life::kOpen; }

  Buffer register_buffer(size_t nbytes) {
    uint64_t registration = 0;
    shmps::Buffer b = take(call([&](shmps::Worker& w) {
      shmps::Result<shmps::Buffer> r = w.register_buffer(nbytes);
      if (r.ok()) registration = record(r->id);
      return r;
    }));
    Buffer out = made(b.id, registration);
    out.data = b.data;
    out.nbytes = b.size;
    out.keep = b.mapping;
    return out;
  }

  Buffer alloc_device_buffer(size_t nbytes, int device) {
    // Without the GIL: a process's first CUDA call makes its context, which
    // takes up to seconds that the interpreter's other threads keep running.
    shmps::Result<std::unique_ptr<shmps::DeviceMemory>> allocated = [&] {
      const GilReleased released;
      return shmps::DeviceMemory::allocate(nbytes, device);
    }();
    std::shared_ptr<shmps::DeviceMemory> memory = take(std::move(allocated));
    uint64_t registration = 0;
    const uint32_t id = take(call([&](shmps::Worker& w) {
      shmps::Result<uint32_t> r = w.register_device_buffer(memory->data(), nbytes);
      if (r.ok()) registration = record(*r);
      return r;
    }));
    Buffer out = made(id, registration);
    out.data = memory->data();
    out.nbytes = nbytes;
    out.device_type = kDLCUDA;
    out.device_id = device;
    out.keep = memory;
    kept_[out.id] = {memory, nb::object(), registration};  // the memory outlives its registration
    return out;
  }

  Buffer register_device_buffer(uintptr_t ptr, size_t nbytes, int device, nb::object owner) {
    uint64_t registration = 0;
    const uint32_t id = take(call([&](shmps::Worker& w) {
      shmps::Result<uint32_t> r = w.register_device_buffer(reinterpret_cast<const void*>(ptr), nbytes);
      if (r.ok()) registration = record(*r);
      return r;
    }));
    Buffer out = made(id, registration);
    out.data = reinterpret_cast<void*>(ptr);
    out.nbytes = nbytes;
    out.device_type = kDLCUDA;
    out.device_id = device;
    out.owner = owner;
    kept_[out.id] = {nullptr, owner, registration};  // the tensor outlives its registration
    return out;
  }

  // `registration`: the Buffer's (0: a bare id, unchecked).
  // Returns the registration it ended (0: none recorded).
  uint64_t unregister_buffer(uint32_t id, uint64_t registration) {
    uint64_t removed = 0;
    check(call([&](shmps::Worker& w) {
      if (shmps::Status s = check_buffer(id, registration); !s.ok()) return s;
      shmps::Status s = w.unregister_buffer(id);
      if (s.ok()) {
        auto it = registrations_.find(id);
        if (it != registrations_.end()) {
          removed = it->second;
          registrations_.erase(it);
          std::lock_guard<std::mutex> lock(outcomes_mu_);
          outcomes_.erase(removed);
        }
      }
      return s;
    }));
    // Only what that registration kept: another thread may have registered
    // a new buffer under the id since.
    if (auto it = kept_.find(id); it != kept_.end() && it->second.registration == removed) kept_.erase(it);
    return removed;
  }

  // The requests naming a buffer take its id and `registration` (the
  // Buffer's; 0 for a bare id), checked under the lock with the request.
  uint64_t push(uint32_t tensor, uint32_t buffer, uint64_t registration, uint64_t offset, uint64_t nbytes,
                uint32_t dtype, uint64_t version, uintptr_t stream) {
    return versioned(call([&](shmps::Worker& w) {
                       if (shmps::Status s = check_buffer(buffer, registration); !s.ok())
                         return Answer{s, w.last_version()};
                       return Answer{w.push(tensor, buffer, offset, nbytes, static_cast<shmps::Dtype>(dtype), version,
                                            reinterpret_cast<void*>(stream)),
                                     w.last_version()};
                     }),
                     version);
  }

  uint64_t push_async(uint32_t tensor, uint32_t buffer, uint64_t registration, uint64_t offset, uint64_t nbytes,
                      uint32_t dtype, uint64_t version, uintptr_t stream) {
    // Noted inside the call: a signal's handler that raises as it returns
    // loses the ticket to its caller, not to pushes_in_flight().
    return take(call([&](shmps::Worker& w) -> shmps::Result<uint64_t> {
      if (shmps::Status s = check_buffer(buffer, registration); !s.ok()) return s;
      shmps::Result<uint64_t> ticket = w.push_async(tensor, buffer, offset, nbytes, static_cast<shmps::Dtype>(dtype),
                                                    version, reinterpret_cast<void*>(stream));
      // By the live registration, whether the caller named the buffer by
      // its Buffer or by a bare id (registration 0).
      if (ticket.ok()) pushes_[*ticket] = {version, buffer, live_registration(buffer)};
      return ticket;
    }));
  }

  uint64_t wait(uint64_t ticket) {
    uint64_t version = 0;
    Answer a = call([&](shmps::Worker& w) {
      Answer answer{w.wait(ticket), w.last_version()};
      if (auto it = pushes_.find(ticket); it != pushes_.end()) {
        version = it->second.version;
        // A wait that timed out or was interrupted may be waited for again.
        const shmps::ErrorCode code = answer.result.ok() ? shmps::ErrorCode::kOk : answer.result.status().code();
        if (code != shmps::ErrorCode::kTimeout && code != shmps::ErrorCode::kInterrupted) {
          count_outcome(it->second.registration, ticket, code);
          pushes_.erase(it);
        }
      }
      return answer;
    });
    return versioned(std::move(a), version);
  }

  // What wait() took of the push_async()s from buffer `buffer` (of
  // `registration`; 0: its live one), counted inside the call, so that a
  // signal's handler raising as wait() returns does not lose the count.
  // Named by its Buffer, without the call lock, as identity(): it answers
  // while another thread's call waits, and after close(). A bare id is
  // looked up as a call.
  PushOutcomes push_outcomes(uint32_t buffer, uint64_t registration) {
    refuse_forked();
    if (registration == 0) registration = call([&](shmps::Worker&) { return live_registration(buffer); });
    std::lock_guard<std::mutex> lock(outcomes_mu_);
    auto it = outcomes_.find(registration);
    return it != outcomes_.end() ? it->second : PushOutcomes{};
  }

  bool answered(uint64_t ticket) {
    return call([&](shmps::Worker& w) { return w.answered(ticket); });
  }

  // The push_async tickets from buffer `buffer` (of `registration`) not
  // yet waited for, oldest first: what must be waited for before the
  // buffer is written again (shmps.torch.RemoteOptimizer's gradients).
  nb::list pushes_in_flight(uint32_t buffer, uint64_t registration) {
    std::vector<uint64_t> tickets;
    call([&](shmps::Worker&) {
      const uint64_t wanted = registration != 0 ? registration : live_registration(buffer);
      for (const auto& [ticket, push] : pushes_)
        if (push.buffer == buffer && push.registration == wanted) tickets.push_back(ticket);
      return 0;
    });
    nb::list out;
    for (uint64_t t : tickets) out.append(t);
    return out;
  }

  uint64_t pull(uint32_t tensor, uint32_t buffer, uint64_t registration, uint64_t offset, uintptr_t stream) {
    return take(call([&](shmps::Worker& w) -> shmps::Result<uint64_t> {
      if (shmps::Status s = check_buffer(buffer, registration); !s.ok()) return s;
      return w.pull(tensor, buffer, offset, reinterpret_cast<void*>(stream));
    }));
  }

  uint64_t pull_async(uint32_t tensor, uint32_t buffer, uint64_t registration, uint64_t offset, uintptr_t stream) {
    return take(call([&](shmps::Worker& w) -> shmps::Result<shmps::Worker::Ticket> {
      if (shmps::Status s = check_buffer(buffer, registration); !s.ok()) return s;
      return w.pull_async(tensor, buffer, offset, reinterpret_cast<void*>(stream));
    }));
  }

  void init(uint32_t buffer, uint64_t registration, uint64_t offset, uintptr_t stream) {
    check(call([&](shmps::Worker& w) {
      if (shmps::Status s = check_buffer(buffer, registration); !s.ok()) return s;
      return w.init(buffer, offset, reinterpret_cast<void*>(stream));
    }));
  }

  nb::dict stats() {
    const shmps::ServerStats s = take(call([](shmps::Worker& w) { return w.stats(); }));
    nb::dict d;
#define SHMPS_STATS_ITEM(name, source, from) d[#name] = s.name;
    SHMPS_SERVER_STATS(SHMPS_STATS_ITEM)
#undef SHMPS_STATS_ITEM
    d["avg_staleness"] = s.avg_staleness;
    return d;
  }

  void ping() {
    check(call([](shmps::Worker& w) { return w.ping(); }));
  }

  // A signal's handler that raises (Ctrl-C) ends the detach's wait; the
  // Worker is detached all the same, and the handler's exception raised.
  void detach() {
    check(call([this](shmps::Worker& w) {
      stops_->detach_asks = true;
      shmps::Status s = w.detach();
      stops_->detach_asks = false;
      // Final whatever it returned, but for a refusal (kInvalidArgument:
      // not this process's Worker).
      if (s.code() != shmps::ErrorCode::kInvalidArgument) {
        detached_.store(true, std::memory_order_relaxed);  // relaxed: one flag, read by repr()
        note_detach(s);
      }
      return s;
    }));
  }

  // Without the lock, as closed(): whether detach() ended the session.
  bool detached() const { return detached_.load(std::memory_order_relaxed); }

  // Ends the call in flight, on whichever thread, where it waits: it fails
  // with kInterrupted at its next ask (a held pull withdrawn, as for
  // Ctrl-C). Calls begun later are not affected, nor what the C++ Worker
  // does not interrupt (registering and unregistering buffers, a detach).
  // Takes no lock: it must not wait for the call it ends.
  void interrupt() { stops_->interrupts.fetch_add(1, std::memory_order_relaxed); }  // relaxed: see Stops

  // Detaches (best effort, as the C++ destructor does) once no call is in
  // flight, and frees what this Worker kept alive (but for a detach not
  // answered: hold_past_close()); further calls raise "closed". A call
  // waiting on another thread is interrupted rather than waited for, and
  // so is any call begun meanwhile. A second close() returns once the
  // first has detached. The detach waits for the server at most
  // WorkerOptions::detach_timeout (5 s), and a signal's handler that
  // raises (Ctrl-C, on the main thread) ends it at once: the Worker is
  // closed all the same, and the handler's exception raised after.
  void close() {
    if (forked()) {
      (void)w_.release();  // the parent's (see ~PyWorker)
      abandon_books();
      stops_->life.store(Life::kClosed, std::memory_order_relaxed);  // relaxed: see Stops
    } else {
      refuse_reentry("close()");
      Life open = Life::kOpen;
      stops_->life.compare_exchange_strong(open, Life::kClosing, std::memory_order_relaxed);  // relaxed: see Stops
      GilReleased released;
      // Locked: a signal's handler that calls this Worker during the
      // detach is refused (refuse_reentry()), not left waiting for mu_.
      Locked locked(*this);
      stops_->detach_asks = true;
      detach_and_free();  // it cancels a held pull first
      stops_->detach_asks = false;
      pushes_.clear();  // registrations_ stay: a Buffer passed after close() gets "closed"
      stops_->life.store(Life::kClosed, std::memory_order_relaxed);  // relaxed: see Stops
    }
    // The exception a signal's handler raised during the detach, taken out
    // of the way while kept_ lets go of its tensors; it is the one raised
    // (before a warning turned error).
    std::optional<nb::python_error> raised;
    if (PyErr_Occurred()) raised.emplace();
    const bool warned = hold_past_close();
    if (raised) {
      if (!warned) PyErr_Clear();
      throw std::move(*raised);
    }
    if (!warned) throw nb::python_error();
  }

  // Under mu_ (or in the destructor: no call in flight), with the GIL
  // released: detaches and frees the C++ Worker, noting whether the server
  // answered the detach.
  void detach_and_free() {
    if (!w_) return;
    // After detach(), whose outcome is noted, a second detach is only
    // refused as "detached".
    if (!detached()) note_detach(w_->detach());
    w_.reset();
  }

  // Under mu_: a detach that ended without the server letting go of this
  // worker (timed out, interrupted, the lane full, a stopping server): it
  // may still serve the requests sent before, a pull into a device buffer
  // included. An eviction (kUnknownWorker) counts as one too: the server
  // drops the evicted worker's queued requests, but device work already
  // enqueued for them runs on (up to a minute on a stuck stream). A detach
  // answered, or ended by the server's death (kServerRestarted,
  // kServerNotRunning), leaves nothing in flight.
  void note_detach(const shmps::Status& s) {
    using shmps::ErrorCode;
    const ErrorCode c = s.code();
    if (c != ErrorCode::kOk && c != ErrorCode::kServerRestarted && c != ErrorCode::kServerNotRunning)
      detach_unanswered_ = true;
  }

  // With the GIL, once the Worker is closed: lets go of what kept_ holds
  // (DeviceMemory, registered tensors), but where a detach was not
  // answered, whose server may still write a pull into that memory: it is
  // held until the process ends (a freed block would go back to its
  // allocator, torch's caching allocator would hand it to another tensor,
  // and a late pull would write weights there), with a RuntimeWarning.
  // False: the warning raised (a filter made it an error; it is set).
  bool hold_past_close() {
    if (!detach_unanswered_ || kept_.empty()) {
      kept_.clear();
      return true;
    }
    const size_t n = kept_.size();
    std::vector<Kept>& held = held_for_the_process();
    for (auto& [id, k] : kept_) held.push_back(std::move(k));
    kept_.clear();
    const std::string message =
        "shmps: the server has not answered this Worker's detach (it timed out, was interrupted or failed) and may "
        "still write a pull sent before it into its device buffers: the memory of " +
        std::to_string(n) +
        " device buffer(s) (alloc_device_buffer, and the tensors given to register_device_buffer) stays allocated "
        "until this process ends";
    return PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) == 0;
  }

  // In a fork()ed child: the maps kept under mu_ change with the GIL
  // released, so fork() may have copied one mid-change in another thread
  // of the parent; they are let go unread (a move takes only the root),
  // never walked or freed.
  void abandon_books() {
    (void)new std::map<uint32_t, uint64_t>(std::move(registrations_));
    (void)new std::map<uint64_t, PushInFlight>(std::move(pushes_));
    (void)new std::map<uint64_t, PushOutcomes>(std::move(outcomes_));
  }

  nb::list tensors() {
    const std::vector<shmps::TensorInfo> table = call([](shmps::Worker& w) { return w.tensors(); });
    nb::list out;
    for (const shmps::TensorInfo& t : table) {
      nb::list shape;
      for (uint64_t d : t.shape) shape.append(d);
      out.append(nb::make_tuple(t.id, t.name, nb::tuple(shape), t.element_offset, t.element_count));
    }
    return out;
  }

 private:
  // A push's or a wait's result, with the server's version as the worker
  // last saw it (a stale rejection names it).
  struct Answer {
    shmps::Result<uint64_t> result;
    uint64_t server_version;
  };

  uint64_t versioned(Answer&& a, uint64_t worker_version) {
    if (a.result.ok()) return *a.result;
    StatusError e{a.result.status()};
    if (e.status.code() == shmps::ErrorCode::kStale) {
      e.worker_version = worker_version;
      e.server_version = a.server_version;
    }
    throw e;
  }

  // A Worker made before a fork() is the parent's, and its lock may have
  // been held by a parent's thread that the child does not have.
  bool forked() const { return shmps::fork_generation() != forks_; }
  void refuse_forked() const {
    if (forked())
      throw StatusError{{shmps::ErrorCode::kInvalidArgument,
                         "this Worker was connected before a fork(): a fork()ed child must connect its own"}};
  }

  // Under mu_ (or before any call): identity_ from w_.
  void note_identity() {
    if (!w_) return;
    std::lock_guard<std::mutex> lock(identity_mu_);
    identity_ = {w_->worker_id(), w_->generation(), int64_t{w_->server_pid()}, w_->total_elements()};
  }

  // mu_ held by call(), with the holding thread noted for holds_lock().
  struct Locked {
    explicit Locked(PyWorker& pw) : w(pw), lock(pw.mu_) {
      w.holder_.store(PyThread_get_thread_ident(), std::memory_order_relaxed);  // relaxed: see holds_lock()
    }
    ~Locked() { w.holder_.store(0, std::memory_order_relaxed); }
    PyWorker& w;
    std::lock_guard<std::mutex> lock;
  };
  // This thread holds mu_: a signal's handler runs on it while its call
  // waits. (Only the holder stores its own id, so a thread reads its own id
  // here only when it holds the lock; relaxed suffices.)
  bool holds_lock() const { return holder_.load(std::memory_order_relaxed) == PyThread_get_thread_ident(); }
  void refuse_reentry(const char* what) const {
    if (holds_lock())
      throw StatusError{{shmps::ErrorCode::kInvalidArgument,
                         std::string(what) +
                             " from a signal handler while a call of this Worker waits on the same thread: raise "
                             "from the handler instead (the call then ends), and use the Worker after"}};
  }

  // Under mu_: records buffer `id` as registered now; its registration.
  uint64_t record(uint32_t id) {
    registrations_[id] = ++last_registration_;
    return last_registration_;
  }

  // Under mu_: buffer `id`'s registration (0: not registered).
  uint64_t live_registration(uint32_t id) const {
    const auto it = registrations_.find(id);
    return it == registrations_.end() ? 0 : it->second;
  }

  // Under mu_: refused when `registration` (not 0) is not the live one of
  // buffer `id`: the Buffer was unregistered, and the id may name another.
  shmps::Status check_buffer(uint32_t id, uint64_t registration) const {
    if (registration == 0) return shmps::Status::Ok();
    auto it = registrations_.find(id);
    if (it != registrations_.end() && it->second == registration) return shmps::Status::Ok();
    return {shmps::ErrorCode::kUnknownBuffer,
            "buffer " + std::to_string(id) + " was unregistered" +
                (it == registrations_.end() ? std::string() : " (its id now names another buffer)")};
  }

  Buffer made(uint32_t id, uint64_t registration) const {
    Buffer out;
    out.id = id;
    out.worker = serial_;
    out.registration = registration;
    return out;
  }

  struct Kept {
    std::shared_ptr<shmps::DeviceMemory> memory;
    nb::object owner;
    uint64_t registration = 0;
  };
  // What hold_past_close() keeps, of every Worker of the process. Under the
  // GIL; never destroyed (nor its objects released at the interpreter's end).
  static std::vector<Kept>& held_for_the_process() {
    static auto* held = new std::vector<Kept>();
    return *held;
  }
  inline static std::atomic<uint64_t> next_serial_{1};
  const uint64_t serial_ = next_serial_.fetch_add(1, std::memory_order_relaxed);  // relaxed: a unique number
  const uint64_t forks_ = shmps::fork_generation();
  // Under the GIL. Declared before w_ so that they outlive it: the Worker
  // detaches (and its requests in flight end) before the memory they read
  // is freed.
  std::map<uint32_t, Kept> kept_;       // by buffer id, while registered
  std::mutex mu_;                       // held for each call of w_, and by close()
  const std::shared_ptr<Stops> stops_;  // also the hook's, in w_'s options
  mutable std::mutex identity_mu_;      // held only to copy identity_, never while a call waits
  Identity identity_;
  std::atomic<unsigned long> holder_{0};  // the thread in call() holding mu_ (0: none)
  std::atomic<bool> detached_{false};     // detach() ran (detached())
  // Under mu_:
  std::unique_ptr<shmps::Worker> w_;
  bool detach_unanswered_ = false;  // a detach that ended with requests maybe in flight (note_detach())
  uint64_t last_registration_ = 0;
  std::map<uint32_t, uint64_t> registrations_;  // live buffer id -> its registration
  struct PushInFlight {
    uint64_t version;  // its worker_version, for a StaleError's
    uint32_t buffer;
    uint64_t registration;
  };
  std::map<uint64_t, PushInFlight> pushes_;  // push_async tickets not waited for (or whose wait timed out)
  // Under outcomes_mu_ (taken under mu_, or alone, held only to copy or
  // count): by registration, the push_async answers wait() took.
  mutable std::mutex outcomes_mu_;
  std::map<uint64_t, PushOutcomes> outcomes_;

  void count_outcome(uint64_t registration, uint64_t ticket, shmps::ErrorCode code) {
    std::lock_guard<std::mutex> lock(outcomes_mu_);
    PushOutcomes& o = outcomes_[registration];
    o.applied += code == shmps::ErrorCode::kOk;
    o.stale += code == shmps::ErrorCode::kStale;
    o.last_ticket = ticket;
    o.last_applied = code == shmps::ErrorCode::kOk;
  }
};

std::unique_ptr<PyWorker> connect(const std::string& name, double timeout, bool reconnect, double wait_for_server,
                                  const std::string& server_user) {
  shmps::WorkerOptions o;
  o.name = name;
  o.timeout = to_ms(timeout, "timeout");
  o.reconnect = reconnect;
  o.wait_for_server = to_ms(wait_for_server, "wait_for_server");
  o.server_user = server_user;
  auto stops = std::make_shared<Stops>();
  o.interrupted = [stops] { return stops->asked() || signal_handler_raised(); };
  o.detach_interrupted = [stops] { return stops->detach_asks && signal_handler_raised(); };
  return std::make_unique<PyWorker>(take(unlocked([&] { return shmps::Worker::connect(o); })), std::move(stops));
}

}  // namespace

NB_MODULE(_shmps, m) {
  m.doc() = "shmps worker library binding (use the shmps package)";
  // A Worker or Buffer still referenced when the interpreter ends (a global
  // while a daemon thread lives) is no leak of this binding's: no warning.
  nb::set_leak_warnings(false);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      // Making the exception runs Python code, where a pending signal's
      // handler raises (Ctrl-C during the call: KeyboardInterrupt); that
      // error is the one raised then.
      try {
        nb::object make = nb::module_::import_("shmps._errors").attr("make_error");
        nb::object exc =
            make(static_cast<uint32_t>(e.status.code()), e.status.message(), e.worker_version, e.server_version);
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      } catch (nb::python_error& raised) {
        raised.restore();
      }
    }
  });

  m.def("_set_main_thread", [](unsigned long ident) { main_thread.store(ident, std::memory_order_relaxed); });
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(at_exit));
  m.attr("ALL_TENSORS") = shmps::kAllTensors;
  nb::dict codes;
  for (uint32_t c = 0; c <= static_cast<uint32_t>(shmps::kLastErrorCode); ++c)
    codes[nb::int_(c)] = std::string(shmps::error_code_name(static_cast<shmps::ErrorCode>(c)));
  m.attr("ERROR_CODES") = codes;
  nb::list stats_fields;
#define SHMPS_STATS_NAME(name, source, from) stats_fields.append(#name);
  SHMPS_SERVER_STATS(SHMPS_STATS_NAME)
#undef SHMPS_STATS_NAME
  m.attr("STATS_FIELDS") = stats_fields;

  nb::class_<Buffer>(m, "Buffer", nb::type_slots(buffer_slots),
                     "Memory registered with the server: the buffer protocol (host memory) and DLPack. The bytes "
                     "must not be written while a push reading them, or read while a pull writing them, is in flight.")
      .def_ro("id", &Buffer::id)
      .def_ro("worker", &Buffer::worker)
      .def_ro("registration", &Buffer::registration)
      .def_ro("nbytes", &Buffer::nbytes)
      .def_prop_ro("ptr", [](const Buffer& b) { return reinterpret_cast<uintptr_t>(b.data); })
      .def_prop_ro("is_cuda", [](const Buffer& b) { return b.device_type == kDLCUDA; })
      .def_ro("device_index", &Buffer::device_id)
      .def("__dlpack__", [](nb::handle self, nb::kwargs) { return nb::inst_ptr<Buffer>(self)->dlpack(self); })
      .def("__dlpack_device__", [](const Buffer& b) { return nb::make_tuple(b.device_type, b.device_id); })
      .def("__len__", [](const Buffer& b) { return b.nbytes; })
      .def("__repr__", [](const Buffer& b) {
        return "shmps.Buffer(id=" + std::to_string(b.id) + ", nbytes=" + std::to_string(b.nbytes) +
               (b.device_type == kDLCUDA ? ", device=cuda:" + std::to_string(b.device_id)
                                         : std::string(", device=cpu")) +
               ")";
      });

  nb::class_<PyWorker>(m, "Worker")
      .def_prop_ro("worker_id", [](const PyWorker& w) { return w.identity().worker_id; })
      .def_prop_ro("generation", [](const PyWorker& w) { return w.identity().generation; })
      .def_prop_ro("server_pid", [](const PyWorker& w) { return w.identity().server_pid; })
      .def_prop_ro("total_elements", [](const PyWorker& w) { return w.identity().total_elements; })
      .def_prop_ro("last_version",
                   [](PyWorker& w) { return w.call([](shmps::Worker& x) { return x.last_version(); }); })
      .def_prop_ro("closed", &PyWorker::closed)
      .def_prop_ro("detached", &PyWorker::detached)
      .def("tensors", &PyWorker::tensors)
      .def_prop_ro("serial", &PyWorker::serial)
      .def("register_buffer", &PyWorker::register_buffer, "nbytes"_a)
      .def("alloc_device_buffer", &PyWorker::alloc_device_buffer, "nbytes"_a, "device"_a)
      .def("register_device_buffer", &PyWorker::register_device_buffer, "ptr"_a, "nbytes"_a, "device"_a, "owner"_a)
      .def("unregister_buffer", &PyWorker::unregister_buffer, "buffer_id"_a, "registration"_a)
      .def("push", &PyWorker::push, "tensor"_a, "buffer"_a, "registration"_a, "offset"_a, "nbytes"_a, "dtype"_a,
           "version"_a, "stream"_a)
      .def("push_async", &PyWorker::push_async, "tensor"_a, "buffer"_a, "registration"_a, "offset"_a, "nbytes"_a,
           "dtype"_a, "version"_a, "stream"_a)
      .def("wait", &PyWorker::wait, "ticket"_a)
      .def("pushes_in_flight", &PyWorker::pushes_in_flight, "buffer"_a, "registration"_a)
      .def("answered", &PyWorker::answered, "ticket"_a)
      .def(
          "push_outcomes",
          [](PyWorker& w, uint32_t buffer, uint64_t registration) {
            const PushOutcomes o = w.push_outcomes(buffer, registration);
            return nb::make_tuple(o.applied, o.stale, o.last_ticket, o.last_applied);
          },
          "buffer"_a, "registration"_a)
      .def("pull", &PyWorker::pull, "tensor"_a, "buffer"_a, "registration"_a, "offset"_a, "stream"_a)
      .def("pull_async", &PyWorker::pull_async, "tensor"_a, "buffer"_a, "registration"_a, "offset"_a, "stream"_a)
      .def("init", &PyWorker::init, "buffer"_a, "registration"_a, "offset"_a, "stream"_a)
      .def("stats", &PyWorker::stats)
      .def("ping", &PyWorker::ping)
      .def("detach", &PyWorker::detach)
      .def("interrupt", &PyWorker::interrupt)
      .def("close", &PyWorker::close);

  m.def("connect", &connect, "name"_a, "timeout"_a, "reconnect"_a, "wait_for_server"_a, "server_user"_a);
}
