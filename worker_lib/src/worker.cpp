#include "shmps/worker.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>

#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <mutex>
#include <thread>
#include <tuple>

#include "device_buffer.hpp"
#include "shmps/shm/futex.hpp"
#include "shmps/shm/in_process.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/ring.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps {

using shm::Completion;
using shm::Opcode;
using shm::Request;
using shm::WorkerState;

// The public mirrors of the wire vocabulary (layout.hpp).
static_assert(static_cast<uint32_t>(Dtype::kF32) == static_cast<uint32_t>(shm::Dtype::kF32) &&
              static_cast<uint32_t>(Dtype::kF16) == static_cast<uint32_t>(shm::Dtype::kF16) &&
              static_cast<uint32_t>(Dtype::kBF16) == static_cast<uint32_t>(shm::Dtype::kBF16));
static_assert(kAllTensors == shm::kAllTensors);

size_t dtype_size(Dtype dtype) noexcept { return shm::dtype_size(static_cast<uint32_t>(dtype)); }

namespace {
using Clock = std::chrono::steady_clock;

// Sizing of a wait for a completion (Worker::Impl::wait_for_completion();
// the figures behind them: docs/benchmarks.md, "The worker's wait").
constexpr uint64_t kMinSpinPolls = 2000;     // the shortest spin: longer than a small request's round trip
constexpr uint64_t kMaxSpinPolls = 20000;    // the longest: ten times the shortest
constexpr uint64_t kTimedAfterPolls = 256;   // a wait this long reads the clock (once)
constexpr uint64_t kSleepAboveNs = 250'000;  // longer expected waits sleep at once

// Sizing of a blocking call's wait for the caller's stream
// (Worker::Impl::settle_stream()): a short spin catches a stream that is
// about done; then sleeps growing to kStreamMaxSleep, so a long backward
// pass costs the CPU little and its end is seen within that much; the
// interrupted hook is asked at most every kStreamAskEvery (it may take the
// Python interpreter's lock).
constexpr int kStreamSpinPolls = 256;
constexpr auto kStreamMaxSleep = std::chrono::microseconds(500);
constexpr auto kStreamAskEvery = std::chrono::milliseconds(20);

// How long the server may hold a pull (--staleness-policy wait): the call's
// timeout less a margin for the answer to arrive before the worker's own
// deadline (a quarter of it, at least 50 ms or half the timeout, at most
// 500 ms); saturated for a timeout too long for nanoseconds.
uint64_t pull_wait_ns(std::chrono::milliseconds timeout) {
  using ms = std::chrono::milliseconds;
  const int64_t t = std::max<int64_t>(0, timeout.count());
  const int64_t margin = std::min<int64_t>(500, std::max<int64_t>(t / 4, std::min<int64_t>(50, t / 2)));
  const int64_t wait = t - margin;
  constexpr int64_t kMaxMs = std::numeric_limits<int64_t>::max() / 1'000'000;
  return wait >= kMaxMs ? std::numeric_limits<uint64_t>::max()
                        : static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(ms(wait)).count());
}

// Fault injection for the reliability tests: with SHMPS_FAULT=<point> in
// the environment when a Worker connects, the process SIGKILLs itself when
// that Worker reaches <point> (SHMPS_FAULT=<point>:<n>: the n-th time;
// SHMPS_FAULT=<point>:<n>:stop: SIGSTOPs itself instead, to be resumed by
// SIGCONT). A disabled point costs one predictable branch.
struct FaultPoint {
  std::string name;
  long remaining = 0;  // 0: disabled
  int signo = SIGKILL;

  static FaultPoint from_environment() {
    FaultPoint p;
    const char* env = std::getenv("SHMPS_FAULT");
    if (env == nullptr || *env == '\0') return p;
    std::string text(env);
    if (text.size() > 5 && text.compare(text.size() - 5, 5, ":stop") == 0) {
      p.signo = SIGSTOP;
      text.resize(text.size() - 5);
    }
    p.remaining = 1;
    if (const size_t colon = text.find(':'); colon != std::string::npos) {
      p.remaining = std::max(1L, std::atol(text.c_str() + colon + 1));
      text.resize(colon);
    }
    p.name = text;
    return p;
  }
  void hit(const char* point) {
    if (remaining == 0 || name != point) return;
    if (--remaining == 0) ::raise(signo);
  }
};
}  // namespace

// fork_generation()'s count. A Worker remembers the value it was connected
// under: one inherited across fork() refuses every call, which would share
// the parent's single-producer lane, and its destructor leaves the
// parent's session and buffers alone.
std::atomic<uint64_t> g_fork_generation{0};

uint64_t fork_generation() {
  static const int registered = ::pthread_atfork(nullptr, nullptr, [] {
    g_fork_generation.fetch_add(1, std::memory_order_relaxed);  // relaxed: the child is single-threaded here
  });
  (void)registered;
  return g_fork_generation.load(std::memory_order_relaxed);  // relaxed: only this process's own forks change it
}

namespace {

// A read-only descriptor of the shm object at `name` when it is still the
// one mapped (a regular file of inode `inode`, at least `length` bytes),
// else -1: a name unlinked, or taken by another object since. System calls
// only (the atfork child handler calls it).
int open_same_object(const char* name, uint64_t inode, uint64_t length) {
  const int fd = ::shm_open(name, O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_ino) == inode &&
      static_cast<uint64_t>(st.st_size) >= length)
    return fd;
  ::close(fd);
  return -1;
}

// The host buffer mappings of this process: every buffer object a Worker
// created, from its mapping to its unmapping (the last copy of its
// Buffer::mapping). A fork()ed child inherits them MAP_SHARED: its writes
// (a backward() into a gradient buffer) would land in the parent's
// buffer, which the parent's next push sends. The atfork child handler
// maps each again MAP_PRIVATE from its object, at the same address, so the
// child's writes go to copy-on-write pages of its own, as any other memory
// of a forked child. Pages it has not written still read the object, so
// they show what the parent's pulls write later (Linux's MAP_PRIVATE of a
// shared object): not a snapshot. An object no longer at its name (its
// buffer unregistered, or the server unlinked it) or another object there
// now (its inode) leaves the mapping shared, as does a remap the kernel
// refuses.
//
// The mutex is held across fork() (prepare locks it, parent and child
// unlock it), so the child reads a whole list; the child handler only
// makes system calls: no allocation, no lock.
class HostMappings {
 public:
  // The process's list, made (with its atfork handlers) by the first
  // buffer; never destroyed, so a mapping dropped during static
  // destruction still finds it.
  static HostMappings& get() {
    static HostMappings* const mappings = [] {
      auto* m = new HostMappings();
      (void)::pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); }, [] { get().remap_in_child(); });
      return m;
    }();
    return *mappings;
  }

  void add(const shm::ShmObject& object) {
    Mapping m{object.data(), object.size(), object.inode(), {}};
    std::memcpy(m.name, object.name().c_str(), std::min(object.name().size() + 1, sizeof m.name));
    m.name[sizeof m.name - 1] = '\0';
    std::lock_guard<std::mutex> lock(mu_);
    mappings_.push_back(m);
  }

  // Before the mapping at `address` goes: a child forked after it must not
  // map anything there.
  void remove(const void* address) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it =
        std::find_if(mappings_.begin(), mappings_.end(), [&](const Mapping& m) { return m.address == address; });
    if (it == mappings_.end()) return;
    *it = mappings_.back();
    mappings_.pop_back();
  }

 private:
  struct Mapping {
    void* address;
    size_t length;
    uint64_t inode;
    char name[shm::kNameBytes];
  };

  // The child handler (single-threaded, mu_ held since prepare). A fresh
  // private mapping is made first, then moved over the shared one
  // (mremap): a MAP_FIXED mmap that failed (no memory to charge for the
  // private copy) could have unmapped the old pages first, leaving a hole
  // where the caller's tensors are; mremap checks its limits before.
  void remap_in_child() {
    for (const Mapping& m : mappings_) {
      const int fd = open_same_object(m.name, m.inode, m.length);
      if (fd < 0) continue;
      void* fresh = ::mmap(nullptr, m.length, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
      ::close(fd);
      if (fresh == MAP_FAILED) continue;
      if (::mremap(fresh, m.length, m.length, MREMAP_MAYMOVE | MREMAP_FIXED, m.address) == MAP_FAILED)
        ::munmap(fresh, m.length);
    }
    mu_.unlock();
  }

  HostMappings() = default;
  std::mutex mu_;
  std::vector<Mapping> mappings_;  // under mu_
};

// Puts a private copy of the object's bytes, as they are now, in place of
// its shared mapping, at the same address: after a detach the server did
// not answer, it may still serve requests sent before (a pull_async)
// when it runs again, and those write the object, never again the
// caller's memory. The copy is read from the object (pread: an object
// shrunk under the mapping reads short, where reading the mapping would
// raise SIGBUS); where that falls short, or the kernel refuses (no memory
// for the copy), the mapping stays shared. A whole object's mapping only
// (a Worker's buffers are).
void privatize(const shm::ShmObject& object) {
  const size_t bytes = object.mapping_size();
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t length = (bytes + page - 1) / page * page;
  const int fd = open_same_object(object.name().c_str(), object.inode(), bytes);
  if (fd < 0) return;
  void* copy = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  size_t got = 0;
  while (copy != MAP_FAILED && got < bytes) {
    const ssize_t n = ::pread(fd, static_cast<char*>(copy) + got, bytes - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (copy == MAP_FAILED) return;
  if (got < bytes || ::mremap(copy, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, object.mapping()) == MAP_FAILED) {
    ::munmap(copy, length);
    return;
  }
  HostMappings::get().remove(object.data());  // a forked child keeps this copy-on-write copy
}

// A buffer object's mapping, shared by Buffer::mapping and the Worker's
// table, listed in HostMappings while it lives.
std::shared_ptr<shm::ShmObject> listed_mapping(std::unique_ptr<shm::ShmObject> object) {
  HostMappings::get().add(*object);
  return std::shared_ptr<shm::ShmObject>(object.release(), [](shm::ShmObject* o) {
    HostMappings::get().remove(o->data());
    delete o;
  });
}

using shm::trusted_owners;

// The lifecycle of a Worker's session. A session is one attach to one
// server generation: from kAttached until it ends, the entry, the lane and
// the completion queue are this Worker's; outside a session they are never
// read or written (after an eviction the entry may serve another worker
// already; after a server's death the segment is a dead one).
enum class State : uint8_t {
  kConnecting,  // connect() has not attached yet
  kAttached,    // in a session
  kDetaching,   // in a session, detach()'s request in flight: the server marking the entry kDetached is its answer
  kServerGone,  // the session ended: its server died or stopped; with reconnect the next call waits for a new
                // generation
  kEvicted,   // the session ended: the server evicted this worker; with reconnect the next call attaches again, to any
              // generation
  kDetached,  // detach() ended the Worker's use (final)
};

const char* state_name(State s) {
  switch (s) {
    case State::kConnecting:
      return "connecting";
    case State::kAttached:
      return "attached";
    case State::kDetaching:
      return "detaching";
    case State::kServerGone:
      return "server gone";
    case State::kEvicted:
      return "evicted";
    case State::kDetached:
      return "detached";
  }
  return "?";
}

// Every transition of State, and the event that makes it. Worker::Impl::
// transition() refuses any other; nothing else changes the state.
struct Transition {
  State from;
  State to;
  const char* event;
};
constexpr Transition kTransitions[] = {
    {State::kConnecting, State::kAttached, "connect(): the attach handshake completed"},
    {State::kAttached, State::kServerGone,
     "a wait saw the server dead or stopped; or, with reconnect, a call's entry check did"},
    {State::kAttached, State::kEvicted,
     "the entry no longer reads kAttached: seen by a wait, a submit or (reconnect) a call's entry check"},
    {State::kAttached, State::kDetaching, "detach() sends its request to a live server"},
    {State::kDetaching, State::kDetached, "the detach request was answered, or failed with the server alive"},
    {State::kDetaching, State::kServerGone, "the server died or stopped under the detach request"},
    {State::kDetaching, State::kEvicted, "evicted with the detach request still in the lane (never served)"},
    {State::kServerGone, State::kAttached, "reconnect: attached to a server of a new generation under the same name"},
    {State::kEvicted, State::kAttached, "reconnect: attached again, to the same server or a new generation"},
    {State::kServerGone, State::kDetached, "detach(): no request, there is no server to send it to"},
    {State::kEvicted, State::kDetached, "detach(): no request, the server let go of the entry already"},
};

constexpr bool allowed(State from, State to) {
  for (const Transition& t : kTransitions)
    if (t.from == from && t.to == to) return true;
  return false;
}

// The table's own test: what the lifecycle promises, checked when this file
// compiles.
constexpr bool any_transition(bool (*pred)(const Transition&)) {
  for (const Transition& t : kTransitions)
    if (pred(t)) return true;
  return false;
}
constexpr bool reaches(State from, State to) {
  bool seen[6] = {};
  seen[static_cast<int>(from)] = true;
  for (size_t round = 0; round < std::size(kTransitions); ++round)
    for (const Transition& t : kTransitions)
      if (seen[static_cast<int>(t.from)]) seen[static_cast<int>(t.to)] = true;
  return seen[static_cast<int>(to)];
}
static_assert(!any_transition([](const Transition& t) { return t.from == t.to; }), "a transition changes the state");
static_assert(!any_transition([](const Transition& t) { return t.from == State::kDetached; }), "detach() is final");
static_assert(!any_transition([](const Transition& t) {
  return t.to == State::kAttached && t.from != State::kConnecting && t.from != State::kServerGone &&
         t.from != State::kEvicted;
}),
              "a session begins only with an attach, never inside another session");
static_assert(!any_transition([](const Transition& t) {
  return t.to == State::kDetaching && t.from != State::kAttached;
}),
              "a detach request is sent only in a session");
static_assert(!any_transition([](const Transition& t) {
  return (t.to == State::kServerGone || t.to == State::kEvicted) && t.from != State::kAttached &&
         t.from != State::kDetaching;
}),
              "only a session can end");
static_assert(!any_transition([](const Transition& t) { return t.to == State::kConnecting; }),
              "connect() happens once");
static_assert(reaches(State::kConnecting, State::kDetached) && reaches(State::kAttached, State::kDetached) &&
                  reaches(State::kDetaching, State::kDetached) && reaches(State::kServerGone, State::kDetached) &&
                  reaches(State::kEvicted, State::kDetached),
              "every Worker can be detached");

}  // namespace

class Worker::Impl {
 public:
  WorkerOptions options;
  // "5000 ms", for the messages of a timeout.
  std::string timeout_text() const { return std::to_string(options.timeout.count()) + " ms"; }
  std::vector<uid_t> trusted;                 // who may own the segment: trusted_owners(options.server_user)
  uint64_t forked_under = fork_generation();  // g_fork_generation at connect()
  pid_t owner_pid = ::getpid();
  FaultPoint fault_point = FaultPoint::from_environment();
  std::unique_ptr<shm::Segment> segment;
  uint32_t id = 0;
  uint64_t lease = 0;
  uint64_t generation = 0;
  // The generation the worker's weights came from: the first attach's,
  // then that of each pull or init answered. A push needs the server's.
  uint64_t weights_generation = 0;
  pid_t server_pid = 0;
  uint64_t server_start = 0;
  shm::SpscProducer<Request> lane;
  uint64_t* stamps = nullptr;  // the lane's publish_ns[] (segment.hpp, lane_stamps())
  shm::SpscConsumer<Completion> completions;
  uint64_t next_request_id = 1;
  uint64_t last_completed_id = 0;  // completions arrive in request order
  // The wait for a completion is sized from what the same kind of request
  // (a push or a pull of the same tensor, anything else) took last time:
  // see wait_for_completion().
  std::vector<uint64_t> expected_ns;  // by wait_key(); 0: done within kTimedAfterPolls polls, or not seen yet
  // What the worker remembers of a request in flight, at request_id & (capacity - 1).
  struct InFlight {
    uint32_t wait_key = 0;        // wait_key() of the request
    bool brings_weights = false;  // a pull or an init
  };
  std::vector<InFlight> inflight;
  double ns_per_poll = 25.0;    // one poll + pause; recalibrated by every long spin
  std::deque<Completion> done;  // popped, not yet claimed by wait()
  // Requests of synchronous calls that stopped waiting for their answer,
  // in rising order: their answers are not kept (keep()). Emptied when a
  // session ends.
  std::deque<uint64_t> abandoned;
  std::vector<TensorInfo> tensors;
  uint64_t total_elements = 0;
  uint32_t capacity = 0;
  // The last session that ended (end_session()): how, why, on which
  // generation. A re-attach after kServerGone skips `generation`.
  struct EndedSession {
    State how = State::kConnecting;  // kServerGone, kEvicted or kDetached once one ended
    Status why;
    uint64_t generation = 0;
  };
  EndedSession ended;
  // The requests each ended session left unanswered, ids in
  // (answered_upto, issued_upto], with how it ended: wait() reports them
  // lost (lost_request()), every time it is asked. A ticket may outlive
  // more than one session (push_async, then a pull that re-attaches and
  // sees the next server die too), so every such range is kept: one per
  // session end with requests in flight.
  struct LostRange {
    uint64_t answered_upto = 0;
    uint64_t issued_upto = 0;
    EndedSession session;
    bool holds(uint64_t request_id) const { return request_id > answered_upto && request_id <= issued_upto; }
  };
  std::vector<LostRange> lost;
  uint64_t last_version = 0;  // the server's version in the last answer (last_version())
  struct Registered {
    std::shared_ptr<shm::ShmObject> object;  // a host buffer's (shared with Buffer::mapping); null for a device buffer
    bool in_use = false;
    // A device buffer (register_device_buffer): the caller's memory, its
    // IPC description and event (ours; destroyed when the buffer goes).
    bool device = false;
    const void* device_ptr = nullptr;
    size_t device_bytes = 0;
    bool in_process = false;  // described for a server in our own process
    uint64_t offer = 0;       // in process: the token of its offer (in_process.hpp), until taken or withdrawn
    detail::DeviceBuffer desc;
    // In use here, and not registered with this session's server yet:
    // every buffer in use from an attach until register_pending() has
    // registered it again.
    bool pending = false;
  };
  std::vector<Registered> buffers;
  bool registrations_pending = false;  // some buffer is pending (a fast check for every call)

  shm::WorkerEntry& entry() const { return segment->worker(id); }

  State state() const { return state_; }
  // Whether the entry, lane and completion queue are ours now.
  bool in_session() const { return state_ == State::kAttached || state_ == State::kDetaching; }

  // The one place the state changes: a transition kTransitions does not
  // list is refused (kInternal) and changes nothing.
  [[nodiscard]] Status transition(State to) {
    if (!allowed(state_, to)) [[unlikely]]
      return {ErrorCode::kInternal, std::string("worker state ") + state_name(state_) + " -> " + state_name(to) +
                                        " is not a transition of its lifecycle"};
    state_ = to;
    return Status::Ok();
  }

  // What a public call needs before it runs: enter()'s argument.
  enum class Call : uint8_t {
    kRequest,  // sends a request: needs a session (reconnect: re-attaches first where the last one is over)
    kPush,     // as kRequest; refused while the worker's weights are of another generation than the server's
    kWait,     // collects answers owed already: no session needed, none begun
    kDetach,   // ends the Worker's use: no re-attach
  };

  // The entry check of every public call, in this order:
  //   1. owned(): not a Worker inherited by a fork()ed child (kInvalidArgument);
  //   2. kWait: nothing more (the answers of requests made before a detach()
  //      or a session's end can still be collected);
  //   3. kDetached: kUnknownWorker "detached" (detach() is final);
  //   4. kDetach: nothing more;
  //   5. kRequest, kPush: a session, from ensure_session(), with every
  //      buffer registered with its server;
  //   6. kPush: the worker's weights (weights_generation) of another
  //      generation than the server's fail it with kServerRestarted,
  //      nothing sent, until a pull or an init is answered: whichever call
  //      re-attached.
  // Attached without reconnect, this is a few compares and no clock read
  // (the generation cannot change then). `deadline`: the call's, of which
  // a re-attach and the registrations use their part (kRequest, kPush);
  // nullptr for kWait and kDetach, which stop before step 5.
  Status enter(Call call, shm::Deadline* deadline = nullptr) {
    if (Status s = owned(); !s.ok()) [[unlikely]]
      return s;
    if (call == Call::kWait) return Status::Ok();
    if (state_ == State::kDetached) return {ErrorCode::kUnknownWorker, "detached"};
    if (call == Call::kDetach) return Status::Ok();
    if (state_ == State::kAttached && !options.reconnect) [[likely]]
      return Status::Ok();
    if (Status s = ensure_session(*deadline); !s.ok()) return s;
    // A gradient computed against the weights of another server generation
    // means nothing to this one (its versions count from its own start or
    // checkpoint).
    if (call == Call::kPush && generation != weights_generation)
      return {ErrorCode::kServerRestarted, "the server restarted (generation " + std::to_string(weights_generation) +
                                               ", now " + std::to_string(generation) +
                                               ") since this worker's weights were pulled: pull again and recompute "
                                               "the gradient"};
    return Status::Ok();
  }

  // A session for a request, by state:
  // - kAttached: as it is without reconnect (a submit and a wait notice a
  //   dead server or an eviction themselves); with reconnect, the session
  //   is checked first (eviction; a fresh heartbeat, or the server's
  //   process) and, over, ended and replaced by a re-attach; in a session
  //   that holds, the buffers a re-attach left pending are registered
  //   first (register_pending(): its error is the call's);
  // - kServerGone, kEvicted: with reconnect, a re-attach (reattach());
  //   without, why the session ended (kServerNotRunning, kUnknownWorker),
  //   every time.
  // All within the call's `deadline`: what is left of it is the request's.
  Status ensure_session(shm::Deadline& deadline) {
    switch (state_) {
      case State::kAttached: {
        if (!options.reconnect) return Status::Ok();
        Status why = evicted();
        if (why.ok()) {
          // Fast path without /proc: a running server refreshes its
          // heartbeat every 10 ms, asleep or not.
          const auto& h = segment->header();
          // acquire: SYNC(server_stopped); relaxed heartbeat: a hint only.
          if (h.server_state.load(std::memory_order_acquire) == static_cast<uint32_t>(shm::ServerState::kRunning) &&
              shm::monotonic_ns() - h.heartbeat_ns.load(std::memory_order_relaxed) < 100'000'000)
            return registrations_pending ? register_pending(deadline) : Status::Ok();
          why = server_gone();
          if (why.ok()) return registrations_pending ? register_pending(deadline) : Status::Ok();
        }
        if (Status s = end_session(ended_as(why), why); !s.ok()) return s;
        return reattach(deadline);
      }
      case State::kServerGone:
      case State::kEvicted:
        return options.reconnect ? reattach(deadline) : ended.why;
      case State::kConnecting:
      case State::kDetaching:
      case State::kDetached:
        break;
    }
    return {ErrorCode::kInternal, std::string("a request in worker state ") + state_name(state_)};
  }

  // Whether this process connected the Worker (not a fork()ed child).
  bool inherited() const { return fork_generation() != forked_under; }
  // Step 1 of enter().
  Status owned() const {
    if (!inherited() && !in_hook) [[likely]]
      return Status::Ok();
    if (in_hook)
      return {ErrorCode::kInvalidArgument,
              "a call of this Worker from its own WorkerOptions::interrupted hook, inside the call it may interrupt "
              "(it would take that call's answers): the hook must not call the Worker"};
    return owned_by_another();
  }
  Status owned_by_another() const {
    return {ErrorCode::kInvalidArgument, "this Worker was connected by process " + std::to_string(owner_pid) +
                                             "; a fork()ed child must connect its own (its calls would share the "
                                             "parent's lane)"};
  }

  // Why the server cannot answer, or ok.
  Status server_gone() const {
    const auto& h = segment->header();
    // acquire: SYNC(server_stopped) completions posted before kStopped are visible.
    const auto state = static_cast<shm::ServerState>(h.server_state.load(std::memory_order_acquire));
    if (state == shm::ServerState::kStopped)
      return {ErrorCode::kServerNotRunning, "server '" + options.name + "' has stopped"};
    if (!shm::process_alive(server_pid, server_start))
      return {ErrorCode::kServerNotRunning,
              "server '" + options.name + "' (pid " + std::to_string(server_pid) + ") died"};
    return Status::Ok();
  }

  // Whether the server ended our session (the entry no longer reads
  // (our pid, kAttached)), or ok. Only in a session. A word a peer wrote
  // over ours, even one that reads kAttached, ended it: the server serves
  // an entry only while it holds the word it attached.
  Status evicted() const {
    // acquire: SYNC(worker_detached) pairs with the server's release CAS to
    // kDetached; what it answered before is visible.
    const uint64_t owner = entry().owner.load(std::memory_order_acquire);
    if (owner == shm::make_owner(static_cast<uint32_t>(owner_pid), WorkerState::kAttached)) return Status::Ok();
    // While our own detach is in flight, kDetached is the expected answer
    // once the server took the request (it pops it before marking the
    // entry, so the head is visible here); one still in the lane was
    // dropped by an eviction and will never be answered. SYNC(slot_released):
    // the server's release of the head it consumed.
    if (state_ == State::kDetaching && lane.header()->head.load(std::memory_order_acquire) == lane.tail())
      return Status::Ok();
    return {ErrorCode::kUnknownWorker, "the server evicted worker " + std::to_string(id)};
  }

  // Why a session cannot go on (the server dead or stopped, or it evicted
  // us), or ok. Only in a session.
  Status session_over() const {
    Status why = server_gone();
    return why.ok() ? evicted() : why;
  }
  // The state a session ends in for session_over()'s answer.
  static State ended_as(const Status& why) {
    return why.code() == ErrorCode::kServerNotRunning ? State::kServerGone : State::kEvicted;
  }

  // Ends the session (kAttached or kDetaching) as `to` (kServerGone,
  // kEvicted, kDetached) for `why`: keeps what the server answered for
  // wait() (it was applied; the server posts nothing after marking the
  // entry kDetached, nor after it died), records the rest as lost, and
  // gives the entry back once the server let go of it (dead, or the entry
  // reads kDetached; a detach that failed with the server alive leaves it
  // to the server's reaper). The lane and queue are not touched after.
  [[nodiscard]] Status end_session(State to, Status why) {
    if (Status s = transition(to); !s.ok()) return s;
    Completion c;
    bool got = false;
    while (take_answer(&c, &got).ok() && got) keep(c);
    ended = EndedSession{to, std::move(why), generation};
    if (last_completed_id < next_request_id - 1) lost.push_back({last_completed_id, next_request_id - 1, ended});
    last_completed_id = next_request_id - 1;  // nothing is in flight outside a session
    abandoned.clear();                        // answered, or lost: none of them comes now
    // acquire: SYNC(worker_detached), the server is done with the entry.
    const uint64_t owner = entry().owner.load(std::memory_order_acquire);
    if (to != State::kDetached || shm::owner_state(owner) == static_cast<uint32_t>(WorkerState::kDetached) ||
        !server_gone().ok())
      release_entry();
    return Status::Ok();
  }

  // The answer for a request that the session `s` left unanswered:
  // without reconnect, why it ended (as every call now gets it); else
  // kServerRestarted (not acknowledged: maybe applied, at most once).
  Status lost_request(uint64_t ticket, const EndedSession& s) const {
    if (!options.reconnect && s.how != State::kDetached) return s.why;
    return {ErrorCode::kServerRestarted, "request " + std::to_string(ticket) +
                                             " was not acknowledged before its session ended (" + s.why.message() +
                                             ")"};
  }

  uint64_t in_flight() const { return next_request_id - 1 - last_completed_id; }

  // Puts a request in the lane and rings the doorbell. Waits up to the
  // deadline while `capacity` requests are in flight (kBusy after that).
  // In a session only (enter()); an eviction seen here ends it.
  Result<uint64_t> submit(Request req, shm::Deadline& deadline) {
    // A call whose timeout is spent (by a re-attach, the registrations
    // before this request, the caller's stream) sends nothing more: a
    // request sent now could only time out, and be served after the call
    // returned.
    if (deadline.started() && Clock::now() >= deadline.time())
      return Status{ErrorCode::kTimeout,
                    "the call's timeout (" + timeout_text() +
                        ") was spent before its request could be sent (re-attaching to server '" + options.name +
                        "', registering buffers again, or waiting for the caller's stream); nothing was sent"};
    if (Status why = evicted(); !why.ok()) {
      if (Status s = end_session(State::kEvicted, why); !s.ok()) return s;
      if (!options.reconnect) return why;
      return Status{ErrorCode::kServerRestarted,
                    why.message() + "; the request was not sent; the next call re-attaches"};
    }
    const auto state = static_cast<shm::ServerState>(
        segment->header().server_state.load(std::memory_order_acquire));  // SYNC(server_stopped)
    if (state == shm::ServerState::kStopping) return Status{ErrorCode::kShuttingDown, "server is shutting down"};
    if (state != shm::ServerState::kRunning)
      return server_gone().ok() ? Status{ErrorCode::kServerNotRunning, "server not running"} : server_gone();
    // Bound what is in flight so the completion queue can never overflow:
    // drain finished requests into `done` while the lane is full.
    while (in_flight() >= capacity) {
      Completion c;
      Status s = pop_one(deadline, &c);
      if (s.ok()) keep(c);
      if (s.code() == ErrorCode::kTimeout)
        return Status{ErrorCode::kBusy,
                      "request lane full: " + std::to_string(capacity) + " requests in flight for the whole timeout"};
      if (s.code() == ErrorCode::kInterrupted)
        return Status{s.code(), "interrupted while the request lane was full; the request was not sent"};
      // The session ended under the requests in flight: this one never
      // entered the lane.
      if (!s.ok())
        return Status{s.code(), s.message() +
                                    " (said of the requests in flight; this one was not sent: the lane was "
                                    "full)"};
    }
    req.request_id = next_request_id;
    // The descriptor a registration carries names it (layout.hpp,
    // BufferDesc::request_id); the lane's release below publishes it.
    if (req.opcode == static_cast<uint32_t>(Opcode::kRegisterBuffer) && req.buffer_id < buffers.size())
      segment->buffer(id, req.buffer_id).request_id = req.request_id;
    inflight[req.request_id & (capacity - 1)] = {wait_key(req), req.opcode == static_cast<uint32_t>(Opcode::kPull) ||
                                                                    req.opcode == static_cast<uint32_t>(Opcode::kInit)};
    req.worker_id = id;
    req.lease = lease;
    // relaxed: published with the slot by publish()'s release (queue_ns).
    std::atomic_ref<uint64_t>(stamps[lane.next_index() & (capacity - 1)])
        .store(shm::monotonic_ns(), std::memory_order_relaxed);
    const shm::RingResult r = lane.stage(req);
    if (r != shm::RingResult::kOk)
      return Status{ErrorCode::kInternal, "request lane rejected a push with free capacity (corrupt head index)"};
    fault_point.hit("before_publish");
    lane.publish();
    ++next_request_id;
    fault_point.hit("after_publish");
    ring_doorbell();  // publishes the lane's tail too
    fault_point.hit("after_doorbell");
    return req.request_id;
  }

  // Tells the server our entry has news (a request, an attach, a cancel)
  // and wakes it if it sleeps.
  void ring_doorbell() {
    auto& h = segment->header();
    // seq_cst: the Dekker pattern with the server's sleep (futex.hpp: it
    // announces itself, then reads the doorbells); the release part
    // publishes what we wrote before.
    h.doorbell[id / 64].fetch_or(uint64_t{1} << (id % 64), std::memory_order_seq_cst);  // SYNC(doorbell)
    shm::notify(h.server_wake);
  }

  // Withdraws every pull sent so far that the server holds back
  // (--staleness-policy wait), now or once it reaches it: the server
  // answers it kInterrupted at once, so what we send next is not stuck
  // behind it. Any other request runs its course; answers are kept for
  // wait().
  void cancel_held_pulls() {
    // relaxed: published by the doorbell's fetch_or (SYNC(doorbell)).
    entry().cancel_request.store(next_request_id - 1, std::memory_order_relaxed);
    fault_point.hit("after_cancel");
    ring_doorbell();
  }

  uint32_t wait_key(const Request& req) const {
    const auto t = static_cast<uint32_t>(tensors.size());
    const uint32_t tensor = req.tensor_id < t ? req.tensor_id : t;
    if (req.opcode == static_cast<uint32_t>(Opcode::kPush)) return tensor;
    if (req.opcode == static_cast<uint32_t>(Opcode::kPull)) return t + 1 + tensor;
    return 2 * t + 2;
  }

  // WorkerOptions::interrupted's answer, or while detaching
  // detach_interrupted's: false when there is none, and while a buffer is
  // registered or unregistered (the worker's and the server's tables of
  // buffers must not part: an id the server took while we gave it up would
  // be refused to every later registration). Those answer promptly unless
  // queued behind a held pull.
  bool asked_to_stop() const {
    const std::function<bool()>& hook = state_ == State::kDetaching ? options.detach_interrupted : options.interrupted;
    if (uninterruptible != 0 || !hook) return false;
    // A call of this Worker from inside the hook would take the waiting
    // call's answers (owned() refuses it).
    in_hook = true;
    struct Out {
      bool& flag;
      ~Out() { flag = false; }
    } out{in_hook};
    return hook();
  }
  mutable bool in_hook = false;  // asked_to_stop() is running the interrupted hook
  int uninterruptible = 0;       // NoInterrupt scopes open
  struct NoInterrupt {
    explicit NoInterrupt(Impl& i) : impl(i) { ++impl.uninterruptible; }
    ~NoInterrupt() { --impl.uninterruptible; }
    NoInterrupt(const NoInterrupt&) = delete;
    NoInterrupt& operator=(const NoInterrupt&) = delete;
    Impl& impl;
  };

  // Waits for the next completion. A worker waiting for the server's reply
  // either spins (a round trip costs far less than a futex wake-up) or
  // sleeps (its CPU may be one the server's kernels need: a large apply
  // runs on the server's apply threads). What the previous request of the same
  // kind (wait_key()) took decides:
  // - unknown or short: spin kMinSpinPolls polls, then sleep;
  // - up to kSleepAboveNs: spin twice as long as last time, so a request
  //   that takes a little longer than the shortest spin (a 1 MiB check and
  //   apply) is still caught spinning rather than paying the wake-up;
  // - longer: sleep on the futex at once; the wake-up is a small part of
  //   such a wait, and a spinning worker would slow the apply it waits for.
  // Only waits past kTimedAfterPolls polls read the clock. The spin yields
  // the CPU every 64th poll (shm::wait_until): the time it measures, and so
  // ns_per_poll and the next wait's size, include what other processes ran
  // meanwhile; a busy CPU thus makes the next wait sleep sooner.
  shm::WaitResult wait_for_completion(shm::Deadline& deadline, const std::function<bool()>& abort) {
    const uint32_t key = inflight[(last_completed_id + 1) & (capacity - 1)].wait_key;
    const uint64_t expect = expected_ns[key];
    auto& word = completions.header()->data_ready;
    uint64_t polls = 0;
    uint64_t t0 = 0;  // when the wait passed kTimedAfterPolls polls, or began its sleep
    uint64_t spin = std::clamp<uint64_t>(static_cast<uint64_t>(static_cast<double>(2 * expect) / ns_per_poll),
                                         kMinSpinPolls, kMaxSpinPolls);
    if (expect > kSleepAboveNs) {
      t0 = shm::monotonic_ns();
      polls = kTimedAfterPolls;  // no second clock read
      spin = 0;
    }
    const uint64_t spin_end = polls + spin;
    const auto ready = [&] {
      if (++polls == kTimedAfterPolls && t0 == 0) t0 = shm::monotonic_ns();
      if (completions.seq_published(last_completed_id + 1)) return true;
      // The tail (any other answer: an id we do not expect, a corrupt
      // queue) every 64th poll while spinning, where the worker writes its
      // tail right then; on every check once asleep.
      return ((polls & 63) == 0 || polls > spin_end) && completions.refresh() != shm::RingResult::kEmpty;
    };
    const uint64_t polls_before = polls;
    const shm::WaitResult w = shm::wait_until(word, ready, abort, deadline, static_cast<uint32_t>(spin));
    return finish_wait(w, key, t0, polls - polls_before, spin);
  }

  // Records what the wait took; `polls` of which spun (<= spin: it never slept).
  shm::WaitResult finish_wait(shm::WaitResult w, uint32_t key, uint64_t t0, uint64_t polls, uint64_t spin) {
    if (w != shm::WaitResult::kReady) return w;
    if (t0 == 0) {
      expected_ns[key] = 0;  // answered within kTimedAfterPolls polls
      return w;
    }
    const uint64_t now = shm::monotonic_ns();
    if (spin != 0 && polls > kTimedAfterPolls && polls <= spin)  // spun all along: calibrate
      ns_per_poll = std::max(1.0, 0.75 * ns_per_poll + 0.25 * static_cast<double>(now - t0) /
                                                           static_cast<double>(polls - kTimedAfterPolls));
    expected_ns[key] = now - t0 + static_cast<uint64_t>(kTimedAfterPolls * ns_per_poll);
    return w;
  }

  // True when the next completion is there: its slot already holds the
  // request id we expect next (the server writes it last: ring.hpp,
  // SYNC(slot_seq)), or the tail says so (any other answer: a corrupt
  // queue, or an id we do not expect, which pop_one() reports).
  bool answer_ready() noexcept {
    return completions.seq_published(last_completed_id + 1) || completions.refresh() != shm::RingResult::kEmpty;
  }

  // Pops the next completion into *out, waiting up to the deadline.
  Status pop_one(shm::Deadline& deadline, Completion* out) {
    bool got = false;
    if (Status s = take_answer(out, &got); !s.ok() || got) return s;
    Status why;
    bool interrupted = false;
    const auto w = wait_for_completion(deadline, [&] {
      why = session_over();
      if (!why.ok()) return true;
      interrupted = asked_to_stop();
      return interrupted;
    });
    if (w == shm::WaitResult::kTimeout)
      return {ErrorCode::kTimeout, "server '" + options.name + "' gave no answer within the timeout (" +
                                       timeout_text() + "): stopped, or busy past it"};
    if (w == shm::WaitResult::kAborted && interrupted) {  // an answer that came meanwhile stays for wait()
      cancel_held_pulls();
      return {ErrorCode::kInterrupted, "interrupted while waiting for the server's answer"};
    }
    // Aborted: the server may still have answered before it died or stopped.
    if (w == shm::WaitResult::kAborted && !answer_ready()) {
      const State to = ended_as(why);
      if (Status s = end_session(to, why); !s.ok()) return s;
      if (!options.reconnect) return why;
      if (to == State::kServerGone)
        return {ErrorCode::kServerRestarted,
                why.message() + "; the request was not acknowledged; the next call re-attaches"};
      return {ErrorCode::kServerRestarted, why.message() +
                                               "; the request was not acknowledged (the server drops an "
                                               "evicted worker's queue unapplied); the next call re-attaches"};
    }
    if (Status s = take_answer(out, &got); !s.ok()) return s;
    return got ? Status::Ok() : Status{ErrorCode::kInternal, "completion vanished"};
  }

  // Takes the next completion into *out if there is one (*got): by its id
  // when its slot holds the one we expect, else through the tail. Copies the
  // first line, and the message only with a failure (a success leaves an
  // older message there: layout.hpp, Completion). An answer out of request
  // order, or a corrupt queue, is kInternal. With nothing in flight there
  // is nothing to take (an answer to a request never sent is not one), so
  // no queue, however it is fed, makes a drain of answers run on.
  Status take_answer(Completion* out, bool* got) {
    *got = false;
    if (in_flight() == 0) return Status::Ok();
    const Completion* slot = nullptr;
    if (completions.seq_published(last_completed_id + 1)) {
      slot = completions.peek_published();
    } else {
      if (completions.refresh() == shm::RingResult::kCorrupt)
        return {ErrorCode::kInternal, "completion queue indices are corrupt"};
      slot = completions.peek();
      if (slot == nullptr) return Status::Ok();
    }
    Completion& c = *out;
    std::memcpy(&c, slot, offsetof(Completion, message));
    if (c.code != 0) {
      std::memcpy(c.message, slot->message, sizeof c.message);
      c.message[sizeof c.message - 1] = '\0';
    } else {
      c.message[0] = '\0';
    }
    completions.release();
    if (c.request_id != last_completed_id + 1)
      return {ErrorCode::kInternal, "completion for request " + std::to_string(c.request_id) + ", expected " +
                                        std::to_string(last_completed_id + 1)};
    last_completed_id = c.request_id;
    // A pull's weights, or an init's (the server's weights are then this
    // worker's): of this session's generation, which a push needs.
    if (c.code == 0 && inflight[c.request_id & (capacity - 1)].brings_weights) weights_generation = generation;
    *got = true;
    return Status::Ok();
  }

  // Waits for the completion of request `ticket`.
  Result<Completion> wait(uint64_t ticket, shm::Deadline& deadline) {
    if (ticket == 0 || ticket >= next_request_id)
      return Status{ErrorCode::kInvalidArgument, "ticket " + std::to_string(ticket) + " was never issued"};
    while (true) {
      for (auto it = done.begin(); it != done.end(); ++it) {
        if (it->request_id == ticket) {
          Completion c = *it;
          done.erase(it);
          fault_point.hit("after_completion");
          return c;
        }
      }
      for (const LostRange& r : lost)
        if (r.holds(ticket)) return lost_request(ticket, r.session);
      if (ticket <= last_completed_id)
        return Status{ErrorCode::kInvalidArgument, "ticket " + std::to_string(ticket) + " was already waited for"};
      // In flight, so in a session: end_session() counts everything issued
      // before its end as answered or lost.
      if (!in_session()) [[unlikely]]
        return Status{ErrorCode::kInternal,
                      "ticket " + std::to_string(ticket) + " in flight in worker state " + state_name(state_)};
      // The next completion goes straight back when it is this ticket's
      // (the common case: one request in flight), else waits in `done`.
      Completion c;
      if (Status s = pop_one(deadline, &c); !s.ok()) return s;
      if (c.request_id == ticket) {
        fault_point.hit("after_completion");
        return c;
      }
      keep(c);
    }
  }

  // Keeps an answer for wait(), but for that of a synchronous call that
  // gave up on it (timed out or interrupted): nobody holds its ticket, and
  // it would be kept, and scanned by every wait(), for the Worker's life.
  void keep(const Completion& c) {
    // Ids below it were settled otherwise (a wait() given that id took it).
    while (!abandoned.empty() && abandoned.front() < c.request_id) abandoned.pop_front();
    if (!abandoned.empty() && abandoned.front() == c.request_id) {
      abandoned.pop_front();
      return;
    }
    done.push_back(c);
  }

  // Waits for the answer of a synchronous call's request `ticket`; when the
  // wait ends without it (kTimeout, kInterrupted: still in flight), the
  // answer is let go when it comes (keep()).
  Result<Completion> wait_for_call(uint64_t ticket, shm::Deadline& deadline) {
    auto c = wait(ticket, deadline);
    if (!c.ok() && ticket > last_completed_id) abandoned.push_back(ticket);
    return c;
  }

  // A public pull's entry (enter(), then the stream: settled when
  // `blocking`, else its event recorded), within the call's `deadline`,
  // and its request: tensor `tensor_id` (or kAllTensors) as fp32 into
  // [byte_offset, ...) of buffer `buffer_id`, held at most what the
  // timeout leaves.
  Result<Request> begin_pull(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, void* stream, bool blocking,
                             shm::Deadline& deadline);
  // push_async's and push's body: the stream settled when `blocking`, else
  // its event recorded, then the request submitted, within the call's
  // `deadline`.
  Result<Worker::Ticket> send_push(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, uint64_t bytes,
                                   Dtype dtype, uint64_t worker_version, void* stream, bool blocking,
                                   shm::Deadline& deadline);

  // wait()'s answer as a public wait returns it: the version, or the
  // error (the server's refusal, or why no answer came); the server's
  // version in it is last_version() from now.
  Result<uint64_t> version_of(const Result<Completion>& c) {
    if (!c.ok()) return c.status();
    last_version = c->version;
    if (Status s = to_status(*c); !s.ok()) return s;
    return c->version;
  }

  static Status to_status(const Completion& c) {
    if (c.code == 0) return Status::Ok();
    const auto code =
        c.code <= static_cast<uint32_t>(kLastErrorCode) ? static_cast<ErrorCode>(c.code) : ErrorCode::kInternal;
    if ((c.flags & shm::kCompletionMessageCut) != 0)
      return {code,
              std::string(c.message) +
                  "... (cut at 63 bytes; the server's log has the whole reason, at most one line per cause a second)"};
    return {code, c.message};
  }

  // One request and its answer, within the call's `deadline`. In a session
  // only: a public call has passed enter(); a re-attach registers buffers
  // with it.
  Result<Completion> request(Request req, shm::Deadline& deadline) {
    auto ticket = submit(req, deadline);
    if (!ticket.ok()) return ticket.status();
    auto c = wait_for_call(*ticket, deadline);
    if (!c.ok()) return c.status();
    last_version = c->version;
    if (Status s = to_status(*c); !s.ok()) return s;
    return c;
  }

  // Returns our entry to kFree after the server let go of it (detached,
  // evicted, or never attached): a CAS from our own word to (pid,
  // kReleasing), so an entry the server already reclaimed (and someone else
  // claimed) is left alone; then our start time is cleared, while the word
  // still says the entry is ours (cleared before the CAS, it could be the
  // next claimer's), and a CAS to kFree gives the entry back. Killed in
  // between, the server frees it (the pid is dead). The server resets the
  // indices at the next attach.
  void release_entry() {
    auto& e = entry();
    const auto pid = static_cast<uint32_t>(::getpid());
    for (WorkerState st : {WorkerState::kClaimed, WorkerState::kAttached, WorkerState::kDetached})
      if (shm::release_owner(e, shm::make_owner(pid, st), [&] {
            e.pid_start_time = 0;
            fault_point.hit("in_release");
          }))
        return;
  }

  // Unmaps and unlinks every buffer (device buffers: destroys their event;
  // the memory is the caller's). `served_later`: a server that may still
  // serve this Worker's requests (a detach it did not answer); a host
  // buffer the caller still maps gets a private copy then.
  void drop_buffers(bool served_later = false) {
    for (auto& b : buffers) drop(b, served_later);
  }
  static void drop(Registered& b, bool served_later = false) {
    if (served_later && b.object && b.object.use_count() > 1) privatize(*b.object);
    if (b.in_use && b.object) shm::ShmObject::remove(b.object->name());
    release_device(b);
    b = Registered{};
  }
  // A device buffer's event and offer (the memory is the caller's).
  static void release_device(Registered& b) {
    if (!b.device) return;
    shm::withdraw_in_process(b.offer);
    detail::release_device_buffer(b.desc);
  }

  // Whether the attached server runs in this very process (it then takes
  // device buffers by pointer: a process cannot open its own IPC handles).
  bool server_in_process() const { return server_pid == ::getpid(); }

  // Writes device buffer b's descriptor into our entry and registers it;
  // describes it again first when the server's side changed (a server
  // restarted in or out of this process needs pointers or IPC handles).
  Status send_register_device(uint32_t b, shm::Deadline& deadline) {
    NoInterrupt whole(*this);
    Registered& r = buffers[b];
    if (r.in_process != server_in_process()) {
      auto again = detail::describe_device_buffer(r.device_ptr, r.device_bytes, server_in_process());
      if (!again.ok()) return again.status();
      release_device(r);
      r.offer = 0;
      r.desc = *again;
      r.in_process = server_in_process();
    }
    shm::BufferDesc& desc = segment->buffer(id, b);
    clear_descriptor(desc);
    desc.kind = static_cast<uint32_t>(shm::BufferKind::kCudaIpc);
    desc.length = r.device_bytes;
    desc.offset = r.desc.offset;
    std::memcpy(desc.device_uuid, r.desc.device_uuid, sizeof desc.device_uuid);
    if (r.in_process) {
      // layout.hpp, kBufferInProcess: base pointer and event offered in
      // this process's memory, the segment holds the offer's token.
      shm::withdraw_in_process(r.offer);  // one a timed-out registration left
      r.offer = 0;
      auto offer = shm::offer_in_process({r.desc.base, r.desc.event});
      if (!offer.ok()) return offer.status();
      r.offer = *offer;
      desc.flags = shm::kBufferInProcess;
      std::memcpy(desc.handle, &r.offer, sizeof r.offer);
    } else {
      std::memcpy(desc.handle, r.desc.mem_handle, sizeof desc.handle);
      std::memcpy(desc.event_handle, r.desc.event_handle, sizeof desc.event_handle);
    }
    Request req{};
    req.opcode = static_cast<uint32_t>(Opcode::kRegisterBuffer);
    req.buffer_id = b;
    auto c = request(req, deadline);  // the lane's release store publishes desc
    return c.ok() ? Status::Ok() : c.status();
  }

  // Before a push, pull or init of buffer b: orders the server's work on a
  // device buffer after the caller's on `stream` (unknown ids are left to
  // the server to reject; host buffers need nothing).
  // - An asynchronous call (push_async, pull_async) records the buffer's
  //   interprocess event there, and the server's stream waits for it.
  // - A blocking call (push, pull, init) waits until the stream has run the
  //   work enqueued on it so far (the gradient is written, the previous
  //   weights are read), marked by the buffer's private event: the call
  //   blocks until the server's answer anyway, and an interprocess record
  //   delays the server's next device work (docs/cuda.md, "Ordering across
  //   processes"). The server's wait on the interprocess event's older
  //   record is then met, or orders after more (a push_async's record on
  //   another stream). The call's `deadline` (kTimeout) and the
  //   interrupted hook (kInterrupted) end the wait; nothing has been sent
  //   then.
  Status order_after_stream(uint32_t b, void* stream, bool blocking, shm::Deadline& deadline) {
    if (b >= buffers.size() || !buffers[b].in_use || !buffers[b].device) return Status::Ok();
    if (!blocking) return detail::record_device_event(buffers[b].desc, stream);
    return settle_stream(b, buffers[b].desc, stream, deadline);
  }

  // order_after_stream()'s blocking wait for device buffer b (`desc`).
  Status settle_stream(uint32_t b, const detail::DeviceBuffer& desc, void* stream, shm::Deadline& deadline) {
    if (Status s = detail::mark_device_stream(desc, stream); !s.ok()) return s;
    auto sleep = std::chrono::microseconds(0);
    Clock::time_point asked{};
    for (int polls = 0;; ++polls) {
      Result<bool> reached = detail::device_stream_marked(desc);
      if (!reached.ok() || *reached) return reached.status();
      if (polls < kStreamSpinPolls) {
        shm::cpu_relax();
        continue;
      }
      const auto now = Clock::now();
      if (now >= deadline.time())
        return {ErrorCode::kTimeout, "the caller's stream did not reach this call's mark on buffer " +
                                         std::to_string(b) + " within the timeout; nothing was sent"};
      if (now - asked >= kStreamAskEvery) {
        asked = now;
        if (asked_to_stop())
          return {ErrorCode::kInterrupted, "interrupted while waiting for the caller's stream; nothing was sent"};
      }
      sleep = std::min<std::chrono::microseconds>(kStreamMaxSleep, std::max(2 * sleep, std::chrono::microseconds(10)));
      std::this_thread::sleep_for(sleep);
    }
  }

  // Claims an entry of `seg`, attaches, and (first time) reads the tensor
  // table; on a re-attach the table must be the same, and the caller's
  // references into it stay valid. Counts, ids and the table come from the
  // layout validated at open (a private copy), never from the live header.
  // The claim and the handshake end at `deadline`. An attach that fails
  // leaves the identity of the server last attached (generation(),
  // server_pid()).
  Status attach_to(std::unique_ptr<shm::Segment> seg, shm::Deadline& deadline) {
    const auto before = std::make_tuple(generation, server_pid, server_start, capacity);
    Status s = attach_session(std::move(seg), deadline);
    if (!s.ok()) std::tie(generation, server_pid, server_start, capacity) = before;
    return s;
  }

  Status attach_session(std::unique_ptr<shm::Segment> seg, shm::Deadline& deadline) {
    segment = std::move(seg);
    const shm::SegmentLayout& h = segment->layout();
    generation = h.generation;
    server_pid = static_cast<pid_t>(h.server_pid);
    server_start = h.server_start_time;
    capacity = h.lane_capacity;
    if (Status s = server_gone(); !s.ok())
      return {ErrorCode::kServerNotRunning,
              s.message() + " (stale segment /dev/shm/" + shm::segment_object_name(options.name) + ")"};
    std::vector<TensorInfo> table;
    for (uint32_t t = 0; t < h.tensor_count; ++t) {
      const shm::TensorDesc& d = h.tensors[t];
      TensorInfo info;
      info.id = t;
      info.name = d.name;
      info.dtype = Dtype::kF32;
      info.shape.assign(d.shape, d.shape + d.ndim);
      info.element_offset = d.element_offset;
      info.element_count = d.element_count;
      table.push_back(std::move(info));
    }
    if (!tensors.empty()) {
      const auto same = [](const TensorInfo& a, const TensorInfo& b) {
        return a.name == b.name && a.shape == b.shape && a.element_offset == b.element_offset &&
               a.element_count == b.element_count;
      };
      if (!std::equal(tensors.begin(), tensors.end(), table.begin(), table.end(), same))
        return {ErrorCode::kLayoutMismatch, "the restarted server '" + options.name + "' serves other tensors"};
    }

    // Claim a free entry, then the attach handshake. A claim freed under
    // us before the server attached it (the server found no start time of
    // ours there, or a peer wrote the word) is made again.
    const auto pid = static_cast<uint32_t>(::getpid());
    const auto give_up = deadline.time();
    const uint64_t claim = shm::make_owner(pid, WorkerState::kClaimed);
    const uint64_t want = shm::make_owner(pid, WorkerState::kAttached);
    const uint64_t evicted_word = shm::make_owner(pid, WorkerState::kDetached);
    while (true) {
      if (Status s = claim_entry(claim, give_up); !s.ok()) return s;
      fault_point.hit("after_claim");
      shm::WorkerEntry& e = segment->worker(id);
      e.pid_start_time = shm::process_start_time(::getpid());
      // relaxed: published with pid_start_time by the doorbell below; a
      // previous owner's word must not name one of our request ids.
      e.cancel_request.store(0, std::memory_order_relaxed);
      // The attach handshake (sessions.cpp, attach()): ring, then wait for
      // the server to move our claim to (pid, kAttached), which it does
      // after resetting our lane and queue and issuing a lease.
      ring_doorbell();  // publishes pid_start_time
      Status why;
      bool claim_lost = false;
      const auto w = shm::wait_until(
          segment->completions(id).data_ready,
          // acquire: SYNC(worker_attached) pairs with the server's CAS: the
          // reset indices and the lease are visible once we see kAttached.
          [&] { return e.owner.load(std::memory_order_acquire) == want; },
          [&] {
            const uint64_t owner = e.owner.load(std::memory_order_acquire);  // SYNC(worker_detached)
            // Attached and evicted while we were stopped (the server saw a
            // living process): the attach is over; try again.
            if (owner == evicted_word) {
              why = {ErrorCode::kUnknownWorker, "the server evicted worker " + std::to_string(id) +
                                                    " while it attached (its process was stopped)"};
              return true;
            }
            // Neither our claim nor attached: the entry is not ours any
            // more (and not to be given back); claim one again.
            if (owner != claim && owner != want) {
              claim_lost = true;
              return true;
            }
            why = server_gone();
            if (why.ok() && asked_to_stop())
              why = {ErrorCode::kInterrupted, "interrupted while waiting for the server to accept the attach"};
            return !why.ok();
          },
          give_up);
      if (w == shm::WaitResult::kReady) break;
      if (claim_lost) {
        if (Clock::now() < give_up) continue;
        return {ErrorCode::kTimeout, "server '" + options.name + "' did not accept the attach within the timeout (" +
                                         timeout_text() + "): the claim of worker entry " + std::to_string(id) +
                                         " was freed before the server attached it"};
      }
      if (w == shm::WaitResult::kTimeout)
        why = {ErrorCode::kTimeout,
               "server '" + options.name + "' did not accept the attach within the timeout (" + timeout_text() + ")"};
      release_entry();
      return why;
    }
    shm::WorkerEntry& e = segment->worker(id);
    if (Status s = transition(State::kAttached); !s.ok()) {
      release_entry();
      return s;
    }
    lease = e.lease;
    // Request ids keep counting across sessions, and the new lane starts
    // empty: every id issued before was settled when the last session
    // ended (answered, in `done`, or lost: end_session()).
    lane = shm::SpscProducer<Request>(&segment->lane(id), segment->lane_slots(id), capacity);
    stamps = segment->lane_stamps(id);
    completions = shm::SpscConsumer<Completion>(&segment->completions(id), segment->completion_slots(id), capacity);
    // A server restarted with a smaller --max-buffers: buffers at ids it
    // no longer has are let go (objects unlinked, device events released),
    // and those ids are refused from now on.
    for (size_t b = h.max_buffers; b < buffers.size(); ++b) drop(buffers[b]);
    buffers.resize(h.max_buffers);
    // The new session's server has none of them yet.
    registrations_pending = false;
    for (Registered& b : buffers) {
      b.pending = b.in_use;
      registrations_pending = registrations_pending || b.pending;
    }
    if (tensors.empty()) tensors = std::move(table);  // a re-attach's is the same: the caller's pointers stay valid
    expected_ns.assign(2 * tensors.size() + 3, 0);
    inflight.assign(capacity, InFlight{});
    total_elements = h.total_elements;
    return Status::Ok();
  }

  // From kServerGone or kEvicted (reconnect): waits until the call's
  // `deadline` for a server under the same name (kServerGone: of another
  // generation than the one that ended, or the same one running and
  // alive, as after a state word forged kStopped that the server has
  // written back; kEvicted: any), attaches to it and registers every
  // buffer again under its old id, all within that deadline. The segment
  // is looked at every 10 ms, once each time (a segment a server has not
  // published yet is looked at again here, so the deadline and the
  // interrupted hook hold while it starts). A session that ends during the
  // registrations (the server died, or stopped under them) is waited past
  // in the same way; one that holds while the server refuses a
  // registration (or does not answer) returns that error, attached: a new
  // attach would leave its entry taken, and the buffers not registered yet
  // stay pending for the next call. Given up at the deadline, the error
  // names what the last look found (no segment, one not published, of
  // another layout, a refused attach...).
  Status reattach(shm::Deadline& deadline) {
    const auto give_up = deadline.time();
    const std::string path = "/dev/shm/" + shm::segment_object_name(options.name);
    Status last;  // why the last look attached to no server
    while (true) {
      auto seg = shm::Segment::open(options.name, /*read_only=*/false, &trusted, std::chrono::milliseconds(0));
      if (!seg.ok()) {
        if (seg.status().code() == ErrorCode::kPermission) return seg.status();
        last = seg.status();
      } else if (state_ == State::kEvicted || (*seg)->layout().generation != ended.generation ||
                 running_and_alive(**seg)) {
        Status s = attach_to(std::move(seg).value(), deadline);
        if (s.code() == ErrorCode::kInterrupted) return s;
        if (s.ok()) s = register_pending(deadline);
        if (s.ok()) return s;
        if (in_session()) {
          // A server that stopped or died under the registrations: its
          // session is over, and the buffers wait for the next.
          Status why = session_over();
          if (why.ok()) return s;
          if (Status e = end_session(ended_as(why), why); !e.ok()) return e;
        }
        if (s.code() == ErrorCode::kLayoutMismatch || s.code() == ErrorCode::kNoCapacity) return s;
        last = s;
      } else {
        last = {ErrorCode::kServerNotRunning,
                path + " is still the segment of the server whose session ended (" + ended.why.message() + ")"};
      }
      const auto now = Clock::now();
      if (now >= give_up)
        return {ErrorCode::kServerNotRunning, "server '" + options.name + "' did not come back within the timeout (" +
                                                  timeout_text() + "): " + last.message()};
      if (asked_to_stop())
        return {ErrorCode::kInterrupted,
                "interrupted while waiting for server '" + options.name + "' to come back (" + last.message() + ")"};
      std::this_thread::sleep_for(std::min<Clock::duration>(give_up - now, std::chrono::milliseconds(10)));
    }
  }

  // Claims a free entry of the segment (CAS kFree -> `claim`) into `id`.
  // While an entry is held by a process that is gone, or by a word the
  // server frees after a while (no start time to judge it by), waits for
  // the server to free it, until `give_up`.
  Status claim_entry(uint64_t claim, Clock::time_point give_up) {
    const uint32_t count = segment->layout().max_workers;
    while (true) {
      for (uint32_t i = 0; i < count; ++i) {
        uint64_t expected = 0;
        // acq_rel: SYNC(worker_claim) acquire pairs with the release that
        // freed the entry (indices reset); release publishes our pid to
        // the server.
        if (segment->worker(i).owner.compare_exchange_strong(expected, claim, std::memory_order_acq_rel,
                                                             std::memory_order_relaxed)) {
          id = i;
          return Status::Ok();
        }
      }
      if (Clock::now() >= give_up || !an_entry_freed_soon(count))
        return {ErrorCode::kNoCapacity,
                "all " + std::to_string(count) + " worker slots of '" + options.name + "' are taken"};
      if (Status gone = server_gone(); !gone.ok()) return gone;  // nobody frees the entry then
      if (asked_to_stop())
        return {ErrorCode::kInterrupted, "interrupted while waiting for a worker slot of '" + options.name + "'"};
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // Whether one of the first `count` entries is one the server frees soon:
  // held by a process that is gone (within its housekeeping period), or by
  // a running one named without a start time (a claim before its start
  // time, a word in kReleasing, a forged word), which it frees after
  // kUnidentifiedOwnerNs (server/src/sessions.hpp) unless the claim is
  // attached first.
  bool an_entry_freed_soon(uint32_t count) const {
    for (uint32_t i = 0; i < count; ++i) {
      // relaxed: a hint only; the claim's CAS decides.
      const shm::WorkerEntry& e = segment->worker(i);
      const uint64_t owner = e.owner.load(std::memory_order_relaxed);
      if (owner == 0) continue;
      // As the server's reap judges it.
      const bool releasing = shm::owner_state(owner) == static_cast<uint32_t>(WorkerState::kReleasing);
      const uint64_t start = releasing ? 0 : e.pid_start_time;
      const shm::ProcessState state = shm::entry_owner_state(static_cast<pid_t>(shm::owner_pid(owner)), start);
      if (state == shm::ProcessState::kGone || (start == 0 && state == shm::ProcessState::kRunning)) return true;
    }
    return false;
  }

  // Whether a registration's failure is the server's refusal of that
  // buffer (its object shrunk, gone or not this worker's, a device it
  // cannot reach...), as opposed to a failure of the request itself (no
  // answer in time, interrupted, a server stopping, stopped or gone, the
  // session ended, a full lane), which says nothing of the buffer.
  static bool refuses_the_buffer(ErrorCode code) {
    switch (code) {
      case ErrorCode::kUnknownBuffer:
      case ErrorCode::kBadRange:
      case ErrorCode::kBadRequest:
      case ErrorCode::kPermission:
      case ErrorCode::kNoCapacity:
      case ErrorCode::kInvalidArgument:
      case ErrorCode::kIo:
      case ErrorCode::kCuda:
        return true;
      default:
        return false;
    }
  }

  // Every pending buffer (after an attach: every one in use) registered
  // again under its id, within the call's `deadline`. One the new server
  // refuses (refuses_the_buffer(): its object shrank or went) is let go
  // (its id free for a new registration; the caller's mapping stays
  // valid), and does not keep the others from it: the first refusal is
  // returned, naming its buffer. Any other failure (a timeout, an
  // interrupt, a server stopping or gone) stops the round and is
  // returned: that buffer (the server may still serve its registration;
  // the next one replaces it) and those after it stay pending, and the
  // next call registers them before its own request (ensure_session()),
  // with this server or the next. A session that ends stops it too: the
  // next attach makes every buffer pending again.
  Status register_pending(shm::Deadline& deadline) {
    Status first;
    for (uint32_t b = 0; b < buffers.size(); ++b) {
      if (!buffers[b].pending) continue;
      const Status s = buffers[b].device
                           ? send_register_device(b, deadline)
                           : send_register(b, buffers[b].object->name(), buffers[b].object->size(), deadline);
      if (s.ok()) {
        buffers[b].pending = false;
        continue;
      }
      if (!in_session()) return s;
      if (!refuses_the_buffer(s.code()))
        return {s.code(), "buffer " + std::to_string(b) + " registered again with the restarted server: " +
                              s.message() + " (the next call registers it, and those not yet registered again)"};
      drop(buffers[b]);
      if (first.ok())
        first = {s.code(),
                 "buffer " + std::to_string(b) + " registered again with the restarted server: " + s.message()};
    }
    registrations_pending = false;
    return first;
  }

  static bool running_and_alive(const shm::Segment& seg) {
    // acquire: SYNC(server_stopped), as server_gone()'s.
    return seg.header().server_state.load(std::memory_order_acquire) ==
               static_cast<uint32_t>(shm::ServerState::kRunning) &&
           shm::process_alive(static_cast<pid_t>(seg.layout().server_pid), seg.layout().server_start_time);
  }

  // Zeroes a descriptor about to be written, but for its request id,
  // which names no request until submit() stamps it: a registration of
  // this id that timed out and is served meanwhile registers nothing.
  static void clear_descriptor(shm::BufferDesc& desc) {
    desc.request_id = ~uint64_t{0};
    std::memset(&desc, 0, offsetof(shm::BufferDesc, request_id));
    std::memset(desc.reserved, 0, sizeof desc.reserved);
  }

  // Writes buffer b's descriptor into our entry and registers it.
  Status send_register(uint32_t b, const std::string& object_name, size_t bytes, shm::Deadline& deadline) {
    NoInterrupt whole(*this);
    shm::BufferDesc& desc = segment->buffer(id, b);
    clear_descriptor(desc);
    desc.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
    desc.length = bytes;
    desc.offset = 0;
    std::memcpy(desc.handle, object_name.c_str(), object_name.size() + 1);
    Request req{};
    req.opcode = static_cast<uint32_t>(Opcode::kRegisterBuffer);
    req.buffer_id = b;
    auto c = request(req, deadline);  // the lane's release store publishes desc
    return c.ok() ? Status::Ok() : c.status();
  }

  // Ends the Worker's use (to kDetached, from any state but kDetached):
  // a session whose server is alive and has not evicted us sends a detach
  // request (its error, if any, is the result), waiting for its answer at
  // most detach_timeout; one that is over ends without; then every buffer
  // goes. No re-attach.
  Status detach() {
    Status result;
    bool served_later = false;
    if (state_ == State::kAttached) {
      if (Status why = session_over(); !why.ok()) {
        result = end_session(ended_as(why), why);
      } else if (result = transition(State::kDetaching); result.ok()) {
        // A pull the server holds for us would hold the detach behind it.
        if (in_flight() > 0) cancel_held_pulls();
        Request req{};
        req.opcode = static_cast<uint32_t>(Opcode::kDetach);
        const auto bound = std::min(options.timeout, options.detach_timeout);
        shm::Deadline deadline(bound);
        auto c = request(req, deadline);  // may end the session: kServerGone, kEvicted
        result = c.ok() ? Status::Ok() : c.status();
        if (result.code() == ErrorCode::kTimeout)
          result = {ErrorCode::kTimeout, "server '" + options.name + "' did not answer the detach within " +
                                             std::to_string(bound.count()) +
                                             " ms (WorkerOptions::detach_timeout, or the call timeout if shorter): "
                                             "detached on this side; the server serves it when it runs again"};
        // Unanswered, the server alive and the lane ours (no eviction):
        // what was sent before the detach is still the server's to serve.
        served_later = !c.ok() && state_ == State::kDetaching;
        if (state_ == State::kDetaching) {
          if (Status s = end_session(State::kDetached, Status{ErrorCode::kUnknownWorker, "detached"}); !s.ok())
            result = s;
        }
      }
    }
    if (state_ != State::kDetached) {
      if (Status s = transition(State::kDetached); !s.ok()) result = s;
    }
    drop_buffers(served_later);
    return result;
  }

 private:
  State state_ = State::kConnecting;  // changed by transition() alone
};

Worker::Worker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Worker::~Worker() {
  if (!impl_) return;
  // An inherited Worker only unmaps: the session and buffer names are the parent's.
  // The pid too, for a child made without the atfork handlers (_Fork(),
  // clone()): its calls are not refused (the check would cost a system
  // call each), but its destructor must not end the parent's session.
  if (impl_->inherited() || ::getpid() != impl_->owner_pid) return;
  if (impl_->state() != State::kDetached) (void)impl_->detach();
}

Result<std::unique_ptr<Worker>> Worker::connect(const WorkerOptions& asked) {
  if (asked.timeout.count() <= 0) return Status{ErrorCode::kInvalidArgument, "timeout must be > 0"};
  if (asked.wait_for_server.count() < 0) return Status{ErrorCode::kInvalidArgument, "wait_for_server must be >= 0"};
  if (asked.detach_timeout.count() <= 0) return Status{ErrorCode::kInvalidArgument, "detach_timeout must be > 0"};
  WorkerOptions options = asked;
  options.timeout = std::min(options.timeout, kMaxTimeout);
  options.wait_for_server = std::min(options.wait_for_server, kMaxTimeout);
  options.detach_timeout = std::min(options.detach_timeout, kMaxTimeout);
  auto trusted = trusted_owners(options.server_user);
  if (!trusted.ok()) return trusted.status();
  const auto give_up = std::chrono::steady_clock::now() + options.wait_for_server;
  while (true) {
    Status s;
    if (auto segment = shm::Segment::open(options.name, /*read_only=*/false, &*trusted); !segment.ok()) {
      s = segment.status();
    } else {
      auto impl = std::make_unique<Impl>();
      impl->options = options;
      impl->trusted = *trusted;
      shm::Deadline deadline(options.timeout);
      s = impl->attach_to(std::move(segment).value(), deadline);
      if (s.ok()) {
        impl->weights_generation = impl->generation;  // the caller's weights: this server takes pushes of them
        // This user's buffer objects that dead workers of this server left:
        // a server running as another user may not remove them (/dev/shm
        // is sticky), so each worker that attaches does.
        for (const shm::OrphanBuffer& o : shm::orphan_buffers(options.name))
          if (o.owner == ::geteuid()) shm::ShmObject::remove(o.object_name);
        return std::unique_ptr<Worker>(new Worker(std::move(impl)));
      }
    }
    // Only "no server yet" is worth waiting for: a segment of another
    // layout, a permission or a full table stays what it is.
    const auto now = std::chrono::steady_clock::now();
    if (s.code() != ErrorCode::kServerNotRunning || now >= give_up) {
      if (s.code() == ErrorCode::kServerNotRunning && options.wait_for_server.count() > 0)
        return Status{s.code(), s.message() + " (after waiting " + std::to_string(options.wait_for_server.count()) +
                                    " ms for it: WorkerOptions::wait_for_server)"};
      return s;
    }
    if (asked.interrupted && asked.interrupted())
      return Status{ErrorCode::kInterrupted,
                    "interrupted while waiting for server '" + options.name + "' (" + s.message() + ")"};
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(give_up - now, std::chrono::milliseconds(10)));
  }
}

uint32_t Worker::worker_id() const noexcept { return impl_->id; }
uint64_t Worker::generation() const noexcept { return impl_->generation; }
pid_t Worker::server_pid() const noexcept { return impl_->server_pid; }
const std::vector<TensorInfo>& Worker::tensors() const noexcept { return impl_->tensors; }
uint64_t Worker::total_elements() const noexcept { return impl_->total_elements; }

const TensorInfo* Worker::find_tensor(const std::string& name) const noexcept {
  for (const TensorInfo& t : impl_->tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Result<Buffer> Worker::register_buffer(size_t bytes) {
  Impl& w = *impl_;
  shm::Deadline deadline(w.options.timeout);
  if (Status s = w.enter(Impl::Call::kRequest, &deadline); !s.ok()) return s;
  if (bytes == 0) return Status{ErrorCode::kInvalidArgument, "buffer of 0 bytes"};
  uint32_t id = 0;
  while (id < w.buffers.size() && w.buffers[id].in_use) ++id;
  if (id == w.buffers.size())
    return Status{ErrorCode::kNoCapacity, "all " + std::to_string(w.buffers.size()) + " buffer slots are in use"};
  // Only a server started with --group-access (it may run as another user
  // of the segment's group) gets group-shared buffers; otherwise nobody but
  // this user may open them.
  const shm::ShmObject& control = w.segment->object();
  const bool group_shared = (w.segment->layout().config_flags & shm::kConfigGroupAccess) != 0;
  // Named so the server accepts it: "shmps.<name>.p<pid>.<n>". The counter
  // is process-wide: several Workers of one process share the pid. A name
  // may still be taken, by this pid's image before an exec() (its Worker
  // keeps its objects) or by another copy of this library in the process
  // (linked statically into two extensions): the next number is tried.
  static std::atomic<uint64_t> buffer_counter{0};
  constexpr int kNameTries = 1024;
  std::string object_name;
  Result<std::unique_ptr<shm::ShmObject>> object = Status{ErrorCode::kInternal, "not created"};
  for (int tries = 1;; ++tries) {
    object_name = shm::buffer_object_name(
        w.options.name, ::getpid(),
        buffer_counter.fetch_add(1, std::memory_order_relaxed));  // relaxed: a unique number only
    bool taken = false;
    object = shm::ShmObject::create(object_name, bytes, group_shared ? 0660 : 0600,
                                    group_shared ? control.owner_gid() : static_cast<gid_t>(-1),
                                    /*keep_descriptor=*/false, &taken);
    if (object.ok() || !taken || tries == kNameTries) break;
  }
  if (!object.ok()) return object.status();
  // Listed from here: a child forked from now on maps it copy-on-write.
  std::shared_ptr<shm::ShmObject> mapping = listed_mapping(std::move(object).value());
  w.fault_point.hit("after_buffer_create");
  if (Status st = w.send_register(id, object_name, bytes, deadline); !st.ok()) {
    shm::ShmObject::remove(object_name);
    return st;
  }
  w.fault_point.hit("after_register");
  // The name stays until unregister/detach, so a restarted server can map
  // the buffer again (reconnect); the server unlinks the names of a worker
  // that dies.
  Buffer b;
  b.id = id;
  b.data = mapping->data();
  b.size = bytes;
  b.mapping = mapping;
  w.buffers[id].object = std::move(mapping);
  w.buffers[id].in_use = true;
  return b;
}

Result<uint32_t> Worker::register_device_buffer(const void* device_ptr, size_t bytes) {
  Impl& w = *impl_;
  shm::Deadline deadline(w.options.timeout);
  if (Status s = w.enter(Impl::Call::kRequest, &deadline); !s.ok()) return s;
  if (device_ptr == nullptr || bytes == 0)
    return Status{ErrorCode::kInvalidArgument, "device buffer: null pointer or 0 bytes"};
  uint32_t id = 0;
  while (id < w.buffers.size() && w.buffers[id].in_use) ++id;
  if (id == w.buffers.size())
    return Status{ErrorCode::kNoCapacity, "all " + std::to_string(w.buffers.size()) + " buffer slots are in use"};
  const bool in_process = w.server_in_process();
  auto desc = detail::describe_device_buffer(device_ptr, bytes, in_process);
  if (!desc.ok()) return desc.status();
  Impl::Registered& r = w.buffers[id];
  r.device = true;
  r.device_ptr = device_ptr;
  r.device_bytes = bytes;
  r.in_process = in_process;
  r.desc = *desc;
  if (Status st = w.send_register_device(id, deadline); !st.ok()) {
    // Sent and unanswered (kTimeout, kInterrupted): the server may serve the
    // registration later, when it runs again, and would open this event
    // after its destruction below. The descriptor stamped for no request
    // makes it refuse that registration (layout.hpp, BufferDesc::request_id),
    // unless it read the descriptor already (a server stopped in the
    // middle of serving it).
    if (w.in_session()) w.segment->buffer(w.id, id).request_id = ~uint64_t{0};
    Impl::release_device(r);
    r = Impl::Registered{};
    return st;
  }
  r.in_use = true;
  return id;
}

Status Worker::unregister_buffer(uint32_t buffer_id) {
  Impl& w = *impl_;
  shm::Deadline deadline(w.options.timeout);
  if (Status s = w.enter(Impl::Call::kRequest, &deadline); !s.ok()) return s;
  if (buffer_id >= w.buffers.size() || !w.buffers[buffer_id].in_use)
    return {ErrorCode::kUnknownBuffer, "buffer " + std::to_string(buffer_id) + " is not registered"};
  Request req{};
  req.opcode = static_cast<uint32_t>(Opcode::kUnregisterBuffer);
  req.buffer_id = buffer_id;
  Impl::NoInterrupt whole(w);
  auto c = w.request(req, deadline);
  // kUnknownBuffer: the server no longer has it (an earlier unregister
  // that timed out was served after all): let it go here too.
  if (!c.ok() && c.status().code() != ErrorCode::kUnknownBuffer) return c.status();
  Impl::Registered& r = w.buffers[buffer_id];
  // The server answered after its last use of the buffer (its completions
  // wait for the device work reading or writing it).
  if (r.object) shm::ShmObject::remove(r.object->name());
  Impl::release_device(r);
  r = Impl::Registered{};
  return Status::Ok();
}

Result<Worker::Ticket> Worker::push_async(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, uint64_t bytes,
                                          Dtype dtype, uint64_t worker_version, void* stream) {
  shm::Deadline deadline(impl_->options.timeout);
  return impl_->send_push(tensor_id, buffer_id, byte_offset, bytes, dtype, worker_version, stream, false, deadline);
}

Result<Worker::Ticket> Worker::Impl::send_push(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset,
                                               uint64_t bytes, Dtype dtype, uint64_t worker_version, void* stream,
                                               bool blocking, shm::Deadline& deadline) {
  if (Status s = enter(Call::kPush, &deadline); !s.ok()) return s;
  if (Status s = order_after_stream(buffer_id, stream, blocking, deadline); !s.ok()) return s;
  Request req{};
  req.opcode = static_cast<uint32_t>(Opcode::kPush);
  req.tensor_id = tensor_id;
  req.buffer_id = buffer_id;
  req.byte_offset = byte_offset;
  req.byte_length = bytes;
  req.dtype = static_cast<uint32_t>(dtype);
  req.worker_version = worker_version;
  return submit(req, deadline);
}

Result<uint64_t> Worker::wait(Ticket ticket) {
  shm::Deadline deadline(impl_->options.timeout);
  if (Status s = impl_->enter(Impl::Call::kWait); !s.ok()) return s;
  return impl_->version_of(impl_->wait(ticket, deadline));
}

bool Worker::answered(Ticket ticket) const noexcept {
  const Impl& w = *impl_;
  if (ticket == 0 || ticket >= w.next_request_id) return false;
  for (const Impl::LostRange& r : w.lost)
    if (r.holds(ticket)) return true;
  if (ticket <= w.last_completed_id) return true;  // taken from the queue (kept for wait, or waited for)
  // Still in the queue: answers come in request order, so the ticket's is
  // there once the queue holds as many as lead up to it. The tail, read
  // relaxed, may lag what wait() then reads, never run ahead of it (a
  // corrupt one reads full: wait() fails at once, kInternal); the next
  // answer's slot may be published before the tail says so.
  if (!w.in_session()) return false;
  const uint64_t needed = ticket - w.last_completed_id;
  return w.completions.depth_estimate() >= needed ||
         (needed == 1 && w.completions.seq_published(w.last_completed_id + 1));
}

uint64_t Worker::last_version() const noexcept { return impl_->last_version; }

Result<uint64_t> Worker::push(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, uint64_t bytes, Dtype dtype,
                              uint64_t worker_version, void* stream) {
  // One deadline for the whole call: a re-attach, the stream, the submit
  // and the answer.
  shm::Deadline deadline(impl_->options.timeout);
  auto ticket =
      impl_->send_push(tensor_id, buffer_id, byte_offset, bytes, dtype, worker_version, stream, true, deadline);
  if (!ticket.ok()) return ticket.status();
  return impl_->version_of(impl_->wait_for_call(*ticket, deadline));
}

Result<Request> Worker::Impl::begin_pull(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, void* stream,
                                         bool blocking, shm::Deadline& deadline) {
  if (Status s = enter(Call::kRequest, &deadline); !s.ok()) return s;
  if (Status s = order_after_stream(buffer_id, stream, blocking, deadline); !s.ok()) return s;
  const uint64_t elements = tensor_id == kAllTensors     ? total_elements
                            : tensor_id < tensors.size() ? tensors[tensor_id].element_count
                                                         : 0;  // the server answers kUnknownTensor
  Request req{};
  req.opcode = static_cast<uint32_t>(Opcode::kPull);
  req.tensor_id = tensor_id;
  req.buffer_id = buffer_id;
  req.byte_offset = byte_offset;
  req.byte_length = elements * sizeof(float);
  // The server holds the pull at most what its wait will have of the
  // timeout: a blocking pull's is what the call has left (all of it,
  // unless a re-attach or the stream used some: the deadline has begun),
  // pull_async's wait() gets a whole one.
  auto left = options.timeout;
  if (blocking && deadline.started())
    left = std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline.time() - Clock::now()));
  req.wait_ns = pull_wait_ns(left);
  return req;
}

Result<Worker::Ticket> Worker::pull_async(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, void* stream) {
  shm::Deadline deadline(impl_->options.timeout);
  Result<Request> req = impl_->begin_pull(tensor_id, buffer_id, byte_offset, stream, false, deadline);
  if (!req.ok()) return req.status();
  return impl_->submit(*req, deadline);
}

Result<uint64_t> Worker::pull(uint32_t tensor_id, uint32_t buffer_id, uint64_t byte_offset, void* stream) {
  shm::Deadline deadline(impl_->options.timeout);
  Result<Request> req = impl_->begin_pull(tensor_id, buffer_id, byte_offset, stream, true, deadline);
  if (!req.ok()) return req.status();
  auto c = impl_->request(*req, deadline);
  if (!c.ok()) return c.status();
  return c->version;
}

Status Worker::init(uint32_t buffer_id, uint64_t byte_offset, void* stream) {
  shm::Deadline deadline(impl_->options.timeout);
  if (Status s = impl_->enter(Impl::Call::kRequest, &deadline); !s.ok()) return s;
  if (Status s = impl_->order_after_stream(buffer_id, stream, /*blocking=*/true, deadline); !s.ok()) return s;
  Request req{};
  req.opcode = static_cast<uint32_t>(Opcode::kInit);
  req.tensor_id = kAllTensors;
  req.buffer_id = buffer_id;
  req.byte_offset = byte_offset;
  req.byte_length = impl_->total_elements * sizeof(float);
  req.dtype = static_cast<uint32_t>(Dtype::kF32);
  auto c = impl_->request(req, deadline);
  return c.ok() ? Status::Ok() : c.status();
}

Result<ServerStats> Worker::stats() {
  shm::Deadline deadline(impl_->options.timeout);
  if (Status s = impl_->enter(Impl::Call::kRequest, &deadline); !s.ok()) return s;
  Request req{};
  req.opcode = static_cast<uint32_t>(Opcode::kStats);
  auto c = impl_->request(req, deadline);
  if (!c.ok()) return c.status();
  // The completion's acquire (try_pop) ordered the server's writes of r.
  const shm::StatsReply r = impl_->entry().stats_reply;
  ServerStats s;
#define SHMPS_STATS_COPY(name, source, from) s.name = r.name;
  SHMPS_SERVER_STATS(SHMPS_STATS_COPY)
#undef SHMPS_STATS_COPY
  s.avg_staleness = static_cast<double>(r.avg_staleness_micro) / 1e6;
  return s;
}

Status Worker::ping() {
  shm::Deadline deadline(impl_->options.timeout);
  if (Status s = impl_->enter(Impl::Call::kRequest, &deadline); !s.ok()) return s;
  Request req{};
  req.opcode = static_cast<uint32_t>(Opcode::kPing);
  auto c = impl_->request(req, deadline);
  return c.ok() ? Status::Ok() : c.status();
}

Result<std::unique_ptr<DeviceMemory>> DeviceMemory::allocate(size_t bytes, int device) {
  if (bytes == 0 || device < 0)
    return Status{ErrorCode::kInvalidArgument, "device memory: 0 bytes or a negative device"};
  auto p = detail::allocate_device_memory(bytes, device);
  if (!p.ok()) return p.status();
  return std::unique_ptr<DeviceMemory>(new DeviceMemory(*p, bytes, device));
}

DeviceMemory::~DeviceMemory() { detail::free_device_memory(data_, device_); }

Status Worker::detach() {
  if (Status s = impl_->enter(Impl::Call::kDetach); !s.ok()) return s;
  if (::getpid() != impl_->owner_pid) return impl_->owned_by_another();
  return impl_->detach();
}

}  // namespace shmps
