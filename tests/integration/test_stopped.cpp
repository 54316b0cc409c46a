// Stopped workers (SIGSTOP, Ctrl-Z, a debugger): the server evicts one that
// stays stopped past --stopped-worker-timeout-ms, counts it and shows it in
// shmps-inspect with its owner; the others never stall; the evicted
// producer, resumed in the middle of a request, writes only its own
// abandoned lane (its entry is not reused while it lives), fails that
// request harmlessly and, with reconnect, re-attaches. Also: the server's
// lifecycle log lines are rate-limited and the suppressed ones counted.
#define BOOST_TEST_MODULE test_stopped
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

struct Shared {
  test::BystanderCounters bystander;
  std::atomic<uint64_t> victim_acked;
  std::atomic<uint64_t> victim_restarted;  // kServerRestarted seen (eviction, reconnect)
  std::atomic<uint64_t> victim_other_errors;
  std::atomic<uint32_t> victim_last_code;
  std::atomic<uint64_t> stop;
};

// The server's counters, read from its segment (read-only).
uint64_t read_stat(const std::string& name, std::atomic<uint64_t> shm::StatsBlock::*field) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  return ((*seg)->stats().*field).load();
}

// The owner word of the entry whose pid is `pid`, or 0.
uint64_t owner_of(const std::string& name, pid_t pid) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  for (uint32_t i = 0; i < (*seg)->layout().max_workers; ++i) {
    const uint64_t owner = (*seg)->worker(i).owner.load();
    if (shm::owner_pid(owner) == static_cast<uint32_t>(pid)) return owner;
  }
  return 0;
}

bool is_stopped(pid_t pid) { return shm::pid_state(pid) == shm::ProcessState::kStopped; }

}  // namespace

BOOST_AUTO_TEST_SUITE(stopped)

// The victim stops itself between writing a push into its lane and
// publishing it (the worst place: a claimed but unpublished slot).
BOOST_AUTO_TEST_CASE(stopped_mid_request_is_evicted_and_reattaches) {
  test::ServerProcess server(test::unique_name("stop"),
                             {"--tensor", "w:1", "--lr", "1", "--max-staleness", "1000000000", "--max-workers", "2",
                              "--stopped-worker-timeout-ms", "300"});
  Shared* shared = test::map_shared<Shared>();
  auto bystander = test::start_bystander(server.name(), &shared->bystander);
  BOOST_REQUIRE(test::eventually([&] { return shared->bystander.acked.load() > 50; }));

  auto victim = test::Process::fork_fn([&] {
    ::setenv("SHMPS_FAULT", "before_publish:4:stop", 1);
    auto w = test::try_connect(server.name(), 5s, /*reconnect=*/true);
    if (!w) return 2;
    auto buf = w->register_buffer(4);
    if (!buf.ok()) return 3;
    *static_cast<float*>(buf->data) = -1.0f;
    for (int attempts = 0; shared->victim_acked.load() < 10 && attempts < 100; ++attempts) {
      auto v = w->push(0, buf->id, 0, 4, Dtype::kF32, 0);
      if (v.ok()) {
        shared->victim_acked.fetch_add(1);
      } else if (v.status().code() == ErrorCode::kServerRestarted) {
        shared->victim_restarted.fetch_add(1);
      } else {
        shared->victim_other_errors.fetch_add(1);
        shared->victim_last_code.store(static_cast<uint32_t>(v.status().code()));
      }
    }
    return shared->victim_acked.load() == 10 ? 0 : 4;
  });
  BOOST_REQUIRE(test::eventually([&] { return is_stopped(victim.pid()); }, 10s));
  const uint64_t acked_before = shared->victim_acked.load();
  // Hits of before_publish: the registration, then pushes 1, 2 and 3.
  BOOST_TEST(acked_before == 2u);  // stopped on the 3rd push, before publishing it

  // Evicted after the timeout (checked every 50 ms), counted, and shown by
  // shmps-inspect with its owner.
  BOOST_REQUIRE(test::eventually([&] { return read_stat(server.name(), &shm::StatsBlock::workers_evicted) == 1; }, 5s));
  BOOST_TEST(shm::owner_state(owner_of(server.name(), victim.pid())) ==
             static_cast<uint32_t>(shm::WorkerState::kDetached));
  const test::Captured shown = test::run_captured({test::program_path("shmps-inspect"), server.name()});
  BOOST_TEST(shown.exit_code == 0);
  const std::string line = "detached, pid " + std::to_string(victim.pid()) + " (stopped)";
  BOOST_TEST(shown.output.find(line) != std::string::npos, "no '" << line << "' in:\n" << shown.output);
  BOOST_TEST(shown.output.find("1 evicted") != std::string::npos, shown.output);

  // Its entry stays out of use while its process lives: with the bystander
  // and the quarantined entry, the table (2) is full.
  {
    WorkerOptions o;
    o.name = server.name();
    o.timeout = 1s;
    auto third = Worker::connect(o);
    BOOST_TEST(!third.ok());
    if (!third.ok()) BOOST_TEST(third.status().code() == ErrorCode::kNoCapacity);
  }

  // The others never stalled: the bystander kept pushing through it all.
  const uint64_t bystander_mid = shared->bystander.acked.load();
  BOOST_TEST(test::eventually([&] { return shared->bystander.acked.load() > bystander_mid; }));

  // Resumed: it publishes the stale request into its abandoned lane (never
  // applied), learns it was evicted, frees its entry and re-attaches.
  victim.resume();
  BOOST_TEST(victim.wait(20s) == 0);
  BOOST_TEST(shared->victim_acked.load() == 10u);
  BOOST_TEST(shared->victim_restarted.load() == 1u);
  BOOST_TEST(shared->victim_other_errors.load() == 0u, "last error code " << shared->victim_last_code.load());

  shared->bystander.stop.store(1);
  BOOST_TEST(bystander.wait(10s) == 0);
  BOOST_TEST(shared->bystander.errors.load() == 0u);
  BOOST_TEST(shared->bystander.max_latency_ns.load() < 1'000'000'000u,
             "slowest bystander push " << shared->bystander.max_latency_ns.load() / 1000 << " us");
  // Exactly once: every acknowledged push applied, the abandoned one not.
  const uint64_t applied = read_stat(server.name(), &shm::StatsBlock::gradients_applied);
  BOOST_TEST(applied == shared->bystander.acked.load() + shared->victim_acked.load());
  BOOST_TEST(server.stop() == 0);
}

// Without reconnect, the evicted worker gets a clear error and gives its
// entry back when it is destroyed; a timeout of 0 never evicts.
BOOST_AUTO_TEST_CASE(without_reconnect_the_error_names_the_eviction) {
  test::ServerProcess server(test::unique_name("stop"),
                             {"--tensor", "w:1", "--max-workers", "1", "--stopped-worker-timeout-ms", "200"});
  Shared* shared = test::map_shared<Shared>();
  int pipe_fds[2];
  BOOST_REQUIRE(::pipe(pipe_fds) == 0);
  auto victim = test::Process::fork_fn([&] {
    ::close(pipe_fds[1]);
    {
      auto w = test::try_connect(server.name(), 5s);
      if (!w) return 2;
      if (!w->ping().ok()) return 3;
      shared->victim_acked.store(1);
      char go;
      if (::read(pipe_fds[0], &go, 1) != 1) return 4;  // stopped meanwhile
      Status s = w->ping();
      shared->victim_last_code.store(static_cast<uint32_t>(s.code()));
      if (s.ok() || s.message().find("evicted") == std::string::npos) return 5;
    }
    // The destroyed Worker freed its entry: the only one of the table.
    return test::try_connect(server.name(), 5s) ? 0 : 6;
  });
  ::close(pipe_fds[0]);
  BOOST_REQUIRE(test::eventually([&] { return shared->victim_acked.load() == 1; }));
  victim.pause();
  BOOST_REQUIRE(test::eventually([&] { return read_stat(server.name(), &shm::StatsBlock::workers_evicted) == 1; }, 5s));
  victim.resume();
  BOOST_REQUIRE(::write(pipe_fds[1], "g", 1) == 1);
  BOOST_TEST(victim.wait(10s) == 0, "last error code " << shared->victim_last_code.load());
  ::close(pipe_fds[1]);
  BOOST_TEST(static_cast<ErrorCode>(shared->victim_last_code.load()) == ErrorCode::kUnknownWorker);
}

BOOST_AUTO_TEST_CASE(timeout_zero_never_evicts) {
  test::ServerProcess server(test::unique_name("stop"), {"--tensor", "w:1", "--stopped-worker-timeout-ms", "0"});
  Shared* shared = test::map_shared<Shared>();
  auto victim = test::Process::fork_fn([&] {
    auto w = test::try_connect(server.name(), 5s);
    if (!w || !w->ping().ok()) return 2;
    shared->victim_acked.store(1);
    while (shared->stop.load() == 0) std::this_thread::sleep_for(1ms);
    return w->ping().ok() ? 0 : 3;
  });
  BOOST_REQUIRE(test::eventually([&] { return shared->victim_acked.load() == 1; }));
  victim.pause();
  std::this_thread::sleep_for(600ms);
  victim.resume();
  shared->stop.store(1);
  BOOST_TEST(victim.wait(10s) == 0);
  BOOST_TEST(read_stat(server.name(), &shm::StatsBlock::workers_evicted) == 0u);
}

// Tickets issued before the eviction and waited for after the re-attach:
// a push acknowledged before the process stopped (its completion popped
// into the library's queue of finished requests, or still unread in the
// completion queue) was applied, so waiting for it must return its
// version, not "already waited for" or "not acknowledged".
BOOST_AUTO_TEST_CASE(acknowledged_tickets_survive_an_eviction_reattach) {
  test::ServerProcess server(test::unique_name("stop"), {"--tensor", "w:1", "--lr", "1", "--max-staleness",
                                                         "1000000000", "--stopped-worker-timeout-ms", "200"});
  Shared* shared = test::map_shared<Shared>();
  auto victim = test::Process::fork_fn([&] {
    auto w = test::try_connect(server.name(), 5s, /*reconnect=*/true);
    if (!w) return 2;
    auto buf = w->register_buffer(4);
    if (!buf.ok()) return 3;
    *static_cast<float*>(buf->data) = -1.0f;
    auto a = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
    auto b = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
    if (!a.ok() || !b.ok() || !w->wait(*b).ok()) return 4;  // a's completion is popped on the way
    auto c = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);
    if (!c.ok()) return 5;
    std::this_thread::sleep_for(100ms);                        // the server answers c
    ::raise(SIGSTOP);                                          // stopped (Ctrl-Z) before waiting; evicted meanwhile
    auto d = w->push_async(0, buf->id, 0, 4, Dtype::kF32, 0);  // notices the eviction, re-attaches
    if (!d.ok()) return 6;
    uint32_t failed = 0;
    for (auto ticket : {*a, *c, *d}) {
      auto v = w->wait(ticket);
      if (v.ok()) {
        shared->victim_acked.fetch_add(1);
      } else {
        std::fprintf(stderr, "victim: ticket %llu: %s\n", static_cast<unsigned long long>(ticket),
                     v.status().to_string().c_str());
        shared->victim_last_code.store(static_cast<uint32_t>(v.status().code()));
        ++failed;
      }
    }
    shared->victim_acked.fetch_add(1);  // b
    return failed == 0 ? 0 : 10 + static_cast<int>(failed);
  });
  BOOST_REQUIRE(test::eventually([&] { return is_stopped(victim.pid()); }, 10s));
  BOOST_REQUIRE(test::eventually([&] { return read_stat(server.name(), &shm::StatsBlock::workers_evicted) == 1; }, 5s));
  victim.resume();
  BOOST_TEST(victim.wait(20s) == 0, "last error code " << shared->victim_last_code.load());
  BOOST_TEST(shared->victim_acked.load() == 4u);
  BOOST_TEST(read_stat(server.name(), &shm::StatsBlock::gradients_applied) == shared->victim_acked.load());
  BOOST_TEST(server.stop() == 0);
}

// Stopped between writing its detach request and publishing it, and
// evicted: the server never takes that request. Resumed, the worker must
// see the eviction at once instead of waiting its whole timeout for an
// answer that cannot come; its entry is free afterwards.
BOOST_AUTO_TEST_CASE(evicted_in_the_middle_of_a_detach_does_not_wait_the_timeout) {
  test::ServerProcess server(test::unique_name("stop"),
                             {"--tensor", "w:1", "--max-workers", "1", "--stopped-worker-timeout-ms", "200"});
  Shared* shared = test::map_shared<Shared>();
  auto victim = test::Process::fork_fn([&] {
    ::setenv("SHMPS_FAULT", "before_publish:2:stop", 1);  // 1: the ping, 2: the detach
    auto w = test::try_connect(server.name(), 3s);
    if (!w) return 2;
    if (!w->ping().ok()) return 3;
    const uint64_t t0 = shm::monotonic_ns();
    const Status s = w->detach();
    shared->victim_last_code.store(static_cast<uint32_t>(s.code()));
    shared->victim_acked.store((shm::monotonic_ns() - t0) / 1'000'000);  // ms, stop included
    ::unsetenv("SHMPS_FAULT");
    return test::try_connect(server.name(), 3s) ? 0 : 4;  // the only entry was given back
  });
  BOOST_REQUIRE(test::eventually([&] { return is_stopped(victim.pid()); }, 10s));
  BOOST_REQUIRE(test::eventually([&] { return read_stat(server.name(), &shm::StatsBlock::workers_evicted) == 1; }, 5s));
  victim.resume();
  BOOST_TEST(victim.wait(20s) == 0);
  BOOST_TEST(shared->victim_acked.load() < 2000u,
             "detach took " << shared->victim_acked.load() << " ms, code " << shared->victim_last_code.load());
  BOOST_TEST(server.stop() == 0);
}

// 60 workers attach and detach as fast as they can: the server writes at
// most 20 lifecycle lines per second and counts the rest, so the lines
// plus the counts account for all 120 events.
BOOST_AUTO_TEST_CASE(worker_lifecycle_lines_are_rate_limited) {
  const std::string name = test::unique_name("stoplog");
  const std::string log_path = "/tmp/" + name + ".log";
  const std::string server_path = test::program_path("shmps-server");
  auto server = test::Process::fork_fn([&] {
    const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ::dup2(fd, 2) < 0) return 126;
    const char* argv[] = {server_path.c_str(), "--name", name.c_str(), "--tensor", "w:1",
                          "--max-workers",     "64",     nullptr};
    ::execv(argv[0], const_cast<char* const*>(argv));
    return 127;
  });
  BOOST_REQUIRE(test::eventually([&] {
    auto seg = shm::Segment::open(name, true);
    return seg.ok();
  }));
  constexpr int kWorkers = 60;
  std::vector<test::Process> workers;
  for (int k = 0; k < kWorkers; ++k)
    workers.push_back(test::Process::fork_fn([&] {
      auto w = test::try_connect(name, 5s);
      return w && w->detach().ok() ? 0 : 1;
    }));
  for (auto& w : workers) BOOST_TEST(w.wait(20s) == 0);
  server.signal(SIGTERM);
  BOOST_TEST(server.wait(10s) == 0);

  std::ifstream in(log_path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(log_path.c_str());
  const std::regex event(R"(worker \d+ (attached|detached) \(pid)");
  const std::regex summary(R"((\d+) more worker attach/detach/death/eviction lines in the last [0-9.]+ s not logged)");
  uint64_t logged = 0, suppressed = 0, summaries = 0;
  std::string line;
  while (std::getline(text, line)) {
    std::smatch m;
    if (std::regex_search(line, event)) ++logged;
    if (std::regex_search(line, m, summary)) {
      suppressed += std::stoull(m[1]);
      ++summaries;
    }
  }
  BOOST_TEST(logged + suppressed == uint64_t{2 * kWorkers}, text.str());
  BOOST_TEST(summaries >= 1u, "120 events in a few seconds must exceed 20 lines per second:\n" << text.str());
  BOOST_TEST(logged < uint64_t{2 * kWorkers});
}

BOOST_AUTO_TEST_SUITE_END()
