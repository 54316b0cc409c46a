// A Worker's session lifecycle as a caller sees it (worker.cpp, State and
// kTransitions): detach() is final in every state, with reconnect too, and
// never attaches again; a session that ends keeps the answers its server
// posted before; without reconnect a dead server fails every later call at
// once, tickets in flight included. (The table itself is checked when
// worker.cpp compiles: its static_asserts.)
#define BOOST_TEST_MODULE test_session
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

const std::vector<std::string> kArgs = {"--tensor", "w:1", "--lr", "1", "--max-staleness", "1000000"};

// The server's live counters, read from its segment (read-only).
uint64_t attached_workers(const std::string& name) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  return (*seg)->stats().workers_attached.load();
}
uint64_t applied(const std::string& name) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  return (*seg)->stats().gradients_applied.load();
}

// Every call that would send a request fails at once with `code`.
void every_request_fails(Worker& w, uint32_t buffer_id, ErrorCode code) {
  const auto t0 = std::chrono::steady_clock::now();
  BOOST_TEST((w.ping().code() == code), w.ping().to_string());
  BOOST_TEST((w.pull(0, buffer_id, 0).status().code() == code));
  BOOST_TEST((w.push(0, buffer_id, 0, 4, Dtype::kF32, 0).status().code() == code));
  BOOST_TEST((w.push_async(0, buffer_id, 0, 4, Dtype::kF32, 0).status().code() == code));
  BOOST_TEST((w.stats().status().code() == code));
  BOOST_TEST((w.init(buffer_id).code() == code));
  BOOST_TEST((w.register_buffer(4).status().code() == code));
  BOOST_TEST((w.unregister_buffer(buffer_id).code() == code));
  // Not one waited for a server (the timeout is 10 s).
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 2s));
}

}  // namespace

BOOST_AUTO_TEST_SUITE(session)

// kAttached -> kDetaching -> kDetached, with reconnect: no call attaches
// again (the server does not look gone: a re-attach would wait out the
// timeout for a new generation, or take an entry). An answer owed from
// before the detach is still collected.
BOOST_AUTO_TEST_CASE(detach_is_final_with_reconnect_too) {
  test::ServerProcess server(test::unique_name("final"), kArgs);
  auto w = test::connect(server.name(), 10s, /*reconnect=*/true);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  *static_cast<float*>(buf->data) = -1.0f;
  auto ticket = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
  BOOST_REQUIRE(ticket.ok());
  BOOST_REQUIRE(w->detach().ok());
  BOOST_TEST(test::eventually([&] { return attached_workers(server.name()) == 0; }, 2s));
  auto v = w->wait(*ticket);
  BOOST_TEST(v.ok(), v.status().to_string());
  if (v.ok()) BOOST_TEST(*v == 1u);
  every_request_fails(*w, buf->id, ErrorCode::kUnknownWorker);
  BOOST_TEST((w->detach().code() == ErrorCode::kUnknownWorker));
  std::this_thread::sleep_for(50ms);
  BOOST_TEST(attached_workers(server.name()) == 0u);
  BOOST_TEST(applied(server.name()) == 1u);
}

// kAttached -> kServerGone (seen by detach()) -> kDetached: nothing is sent
// to the dead server and nothing waits; a new generation under the name is
// not attached to afterwards.
BOOST_AUTO_TEST_CASE(detach_after_the_server_died_is_local_and_final) {
  const std::string name = test::unique_name("gone");
  auto server = std::make_unique<test::ServerProcess>(name, kArgs);
  auto w = test::connect(name, 10s, /*reconnect=*/true);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  server->process().kill_and_reap();
  server.reset();
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = w->detach();
  BOOST_TEST(s.ok(), s.to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 1s));
  test::ServerProcess next(name, kArgs);
  every_request_fails(*w, buf->id, ErrorCode::kUnknownWorker);
  std::this_thread::sleep_for(50ms);
  BOOST_TEST(attached_workers(name) == 0u);
}

// kAttached -> kServerGone (seen by the next call's entry check) ->
// kAttached: a push the dead server answered before it died was applied;
// waiting for it after the re-attach returns its version, not "lost".
BOOST_AUTO_TEST_CASE(an_answer_posted_before_the_server_died_survives_the_reattach) {
  const std::string name = test::unique_name("answered");
  auto server = std::make_unique<test::ServerProcess>(name, kArgs);
  auto w = test::connect(name, 10s, /*reconnect=*/true);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  *static_cast<float*>(buf->data) = -1.0f;
  // The server's completion queue for this worker: killed once the answer
  // is posted (the completion follows the apply).
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  const shm::LaneHeader& answers = (*seg)->completions(w->worker_id());
  const uint64_t posted = answers.tail.load(std::memory_order_acquire);
  auto ticket = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
  BOOST_REQUIRE(ticket.ok());
  BOOST_REQUIRE(test::eventually([&] { return answers.tail.load(std::memory_order_acquire) > posted; }, 5s));
  BOOST_TEST(applied(name) == 1);
  server->process().kill_and_reap();
  server.reset();
  std::this_thread::sleep_for(200ms);  // past the dead server's last heartbeat
  test::ServerProcess next(name, kArgs);
  const Status back = w->ping();
  BOOST_REQUIRE_MESSAGE(back.ok(), back.to_string());
  auto v = w->wait(*ticket);
  BOOST_TEST(v.ok(), v.status().to_string());
  if (v.ok()) BOOST_TEST(*v == 1u);
  BOOST_TEST((w->wait(*ticket).status().code() == ErrorCode::kInvalidArgument));  // waited for already
}

// kAttached -> kServerGone without reconnect: the Worker stays unusable.
// Every later call fails at once with kServerNotRunning (nothing is put in
// the dead server's lane), and so does every wait for a ticket in flight,
// each time; detach() then ends it without a request.
BOOST_AUTO_TEST_CASE(without_reconnect_a_dead_server_fails_every_call_and_ticket) {
  const std::string name = test::unique_name("deadfinal");
  auto server = std::make_unique<test::ServerProcess>(name, kArgs);
  auto w = test::connect(name, 10s, /*reconnect=*/false);
  auto buf = w->register_buffer(4);
  BOOST_REQUIRE(buf.ok());
  server->process().pause();
  auto a = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
  auto b = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
  BOOST_REQUIRE(a.ok() && b.ok());
  server->process().kill_and_reap();
  auto r = w->wait(*a);
  BOOST_TEST((r.status().code() == ErrorCode::kServerNotRunning), r.status().to_string());
  BOOST_TEST(r.status().message().find("died") != std::string::npos, r.status().to_string());
  BOOST_TEST((w->wait(*b).status().code() == ErrorCode::kServerNotRunning));
  BOOST_TEST((w->wait(*a).status().code() == ErrorCode::kServerNotRunning));
  every_request_fails(*w, buf->id, ErrorCode::kServerNotRunning);
  server.reset();
  test::ServerProcess next(name, kArgs);
  BOOST_TEST((w->ping().code() == ErrorCode::kServerNotRunning));  // another generation changes nothing
  BOOST_TEST(w->detach().ok());
  BOOST_TEST((w->ping().code() == ErrorCode::kUnknownWorker));
  BOOST_TEST(attached_workers(name) == 0u);
}

// A detach waits for the server's answer at most
// WorkerOptions::detach_timeout (5 s by default), whatever the call
// timeout: a Worker of kMaxTimeout dropped while its server is stopped
// does not hold its program for good. The request stays in the lane, and
// the server serves it once it runs again.
BOOST_AUTO_TEST_CASE(a_detach_from_a_stopped_server_waits_at_most_the_detach_timeout) {
  test::ServerProcess server(test::unique_name("detachbound"), kArgs);
  auto w = test::connect(server.name(), kMaxTimeout);
  BOOST_REQUIRE(w->register_buffer(4).ok());
  server.process().pause();
  std::promise<std::chrono::steady_clock::duration> took;
  std::future<std::chrono::steady_clock::duration> done = took.get_future();
  std::thread dropper([&] {
    const auto t0 = std::chrono::steady_clock::now();
    w.reset();  // the destructor detaches
    took.set_value(std::chrono::steady_clock::now() - t0);
  });
  const bool returned = done.wait_for(10s) == std::future_status::ready;
  server.process().resume();  // an unbounded detach would never return
  dropper.join();
  BOOST_TEST(returned, "the detach of a Worker of kMaxTimeout did not return within 10 s");
  if (returned) {
    const auto waited = done.get();
    BOOST_TEST((waited >= 4500ms && waited < 8s), std::chrono::duration<double>(waited).count() << " s");
  }
  BOOST_TEST(test::eventually([&] { return attached_workers(server.name()) == 0; }, 5s));
}

// A Worker whose detach waits 300 ms for its answer, and a host buffer of
// the whole model.
std::pair<std::unique_ptr<Worker>, Buffer> worker_with_buffer(const std::string& name) {
  WorkerOptions o = test::worker_options(name, 10s, false);
  o.detach_timeout = 300ms;
  auto w = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  auto b = (*w)->register_buffer((*w)->total_elements() * sizeof(float));
  BOOST_REQUIRE_MESSAGE(b.ok(), b.status().to_string());
  return {std::move(w).value(), *b};
}

// A detach the server did not answer leaves what was sent before it in
// the lane, and the server serves that when it runs again: a pull_async
// writes the buffer's object then, but no longer the memory the caller
// still maps (Buffer::mapping), which is private after the detach.
BOOST_AUTO_TEST_CASE(a_pull_left_to_the_server_by_an_unanswered_detach_never_writes_the_callers_buffer) {
  test::ServerProcess server(test::unique_name("detachpriv"), {"--tensor", "w:1024", "--lr", "1"});
  auto [w, b] = worker_with_buffer(server.name());
  float* data = static_cast<float*>(b.data);
  std::fill(data, data + 1024, 1.0f);
  BOOST_REQUIRE(w->push(kAllTensors, b.id, 0, b.size, Dtype::kF32, 0).ok());  // the weights become -1
  server.process().pause();
  auto ticket = w->pull_async(kAllTensors, b.id, 0);
  BOOST_REQUIRE_MESSAGE(ticket.ok(), ticket.status().to_string());
  const Status detached = w->detach();
  BOOST_TEST((detached.code() == ErrorCode::kTimeout), detached.to_string());
  std::fill(data, data + 1024, 7.0f);  // the caller's memory from now on
  server.process().resume();
  BOOST_TEST(test::eventually([&] { return attached_workers(server.name()) == 0; }, 5s));  // the pull was served
  BOOST_TEST((std::count(data, data + 1024, 7.0f) == 1024), "first float " << data[0]);
}

// The same with the buffer's object shrunk under the caller's mapping (a
// peer truncated it): the private copy is read from the object, short, so
// the mapping stays as it is, and the detach ends with kTimeout, not with
// a SIGBUS from reading the mapping past the object's end.
BOOST_AUTO_TEST_CASE(an_unanswered_detach_of_a_buffer_whose_object_shrank_ends_without_sigbus) {
  test::ServerProcess server(test::unique_name("detachshrunk"), {"--tensor", "w:4096"});
  auto [w, b] = worker_with_buffer(server.name());
  const std::string prefix = shm::buffer_object_prefix(server.name(), ::getpid());
  std::string object;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm"))
    if (entry.path().filename().string().rfind(prefix, 0) == 0) object = entry.path().string();
  BOOST_REQUIRE_MESSAGE(!object.empty(), "no object named " << prefix << "*");
  server.process().pause();
  BOOST_REQUIRE(::truncate(object.c_str(), 0) == 0);
  const Status detached = w->detach();
  BOOST_TEST((detached.code() == ErrorCode::kTimeout), detached.to_string());
  server.process().resume();
}

// WorkerOptions::detach_interrupted, asked while a detach waits (and
// `interrupted` not: a stop flag must not cut a job's detach short), ends
// it with kInterrupted; the Worker is detached all the same.
BOOST_AUTO_TEST_CASE(detach_interrupted_ends_a_detach_and_interrupted_does_not) {
  test::ServerProcess server(test::unique_name("detachint"), kArgs);
  std::atomic<bool> stop{false};
  std::atomic<bool> armed{false};
  std::atomic<int> asked{0};
  WorkerOptions o = test::worker_options(server.name(), kMaxTimeout, false);
  o.detach_timeout = 300ms;
  o.interrupted = [&] { return armed.load(); };  // once armed, would end every other wait at once
  o.detach_interrupted = [&] {
    ++asked;
    return stop.load();
  };
  auto first = Worker::connect(o);
  auto second = Worker::connect(o);
  BOOST_REQUIRE(first.ok() && second.ok());
  armed = true;
  server.process().pause();
  auto t0 = std::chrono::steady_clock::now();
  const Status timed_out = (*first)->detach();  // not interrupted: waits its detach_timeout
  const auto waited = std::chrono::steady_clock::now() - t0;
  BOOST_TEST((timed_out.code() == ErrorCode::kTimeout), timed_out.to_string());
  BOOST_TEST(timed_out.message().find("detach_timeout") != std::string::npos, timed_out.to_string());
  BOOST_TEST((waited >= 250ms && waited < 3s));
  BOOST_TEST(asked.load() > 0);
  stop = true;
  t0 = std::chrono::steady_clock::now();
  const Status interrupted = (*second)->detach();
  BOOST_TEST((interrupted.code() == ErrorCode::kInterrupted), interrupted.to_string());
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < 250ms));
  server.process().resume();
  BOOST_TEST(((*first)->ping().code() == ErrorCode::kUnknownWorker));
  BOOST_TEST(((*second)->ping().code() == ErrorCode::kUnknownWorker));
  BOOST_TEST(test::eventually([&] { return attached_workers(server.name()) == 0; }, 5s));
  WorkerOptions bad = o;
  bad.detach_timeout = 0ms;
  BOOST_TEST((Worker::connect(bad).status().code() == ErrorCode::kInvalidArgument));
}

// kAttached -> kEvicted, the entry no longer ours: a peer freed our owner
// word and another process (Q) claimed the entry and wrote its start time,
// and rings only after we noticed. Giving the entry back must leave Q's
// start time alone (the worker clears its own only while its word says
// kReleasing, after a CAS from its own word, which fails here), or the
// server never attaches Q.
BOOST_AUTO_TEST_CASE(giving_back_an_entry_claimed_since_leaves_the_claimers_start_time) {
  test::ServerProcess server(test::unique_name("clobber"), kArgs);
  auto w = test::connect(server.name(), 10s, /*reconnect=*/false);
  const uint32_t id = w->worker_id();
  auto seg = shm::Segment::open(server.name(), /*read_only=*/false);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  shm::WorkerEntry& entry = (*seg)->worker(id);
  struct Steps {
    std::atomic<uint32_t> claimed;  // Q claimed the entry and wrote its start time
    std::atomic<uint32_t> go;       // our call noticed: Q may ring
  };
  auto* steps =
      static_cast<Steps*>(::mmap(nullptr, sizeof(Steps), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  BOOST_REQUIRE(steps != MAP_FAILED);
  entry.owner.store(0);  // a buggy peer frees our word
  auto q = test::Process::fork_fn([&] {
    const auto me = static_cast<uint32_t>(::getpid());
    uint64_t expected = 0;
    if (!entry.owner.compare_exchange_strong(expected, shm::make_owner(me, shm::WorkerState::kClaimed))) return 3;
    entry.pid_start_time = shm::process_start_time(::getpid());
    steps->claimed.store(1);
    if (!test::eventually([&] { return steps->go.load() == 1u; }, 10s)) return 4;
    auto& h = (*seg)->header();
    h.doorbell[id / 64].fetch_or(uint64_t{1} << (id % 64));
    shm::notify(h.server_wake);
    const uint64_t attached = shm::make_owner(me, shm::WorkerState::kAttached);
    return test::eventually([&] { return entry.owner.load() == attached; }, 3s) ? 0 : 1;
  });
  BOOST_REQUIRE(test::eventually([&] { return steps->claimed.load() == 1u; }, 10s));
  const uint64_t q_start = entry.pid_start_time;
  const Status noticed = w->ping();  // the entry is not ours: the session ends, the entry is given back
  BOOST_TEST((noticed.code() == ErrorCode::kUnknownWorker), noticed.to_string());
  BOOST_TEST(entry.pid_start_time == q_start, "the claimer's start time was cleared");
  steps->go.store(1);
  BOOST_TEST(q.wait(10s) == 0, "the claimer was not attached (start time " << entry.pid_start_time << ")");
  ::munmap(steps, sizeof(Steps));
}

BOOST_AUTO_TEST_SUITE_END()
