// Workers SIGKILLed at every step of the protocol (worker_lib's fault
// points) while a bystander keeps pushing: the bystander never stalls, the
// dead worker's entry and buffers are reclaimed, nothing leaks in /dev/shm,
// every acknowledged push is applied exactly once and an unacknowledged one
// at most once.
#define BOOST_TEST_MODULE test_faults
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cstdlib>
#include <filesystem>
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
};

// Buffer objects of process `pid` still in /dev/shm.
size_t leftover_buffers(const std::string& name, pid_t pid) {
  size_t n = 0;
  const std::string prefix = shm::buffer_object_prefix(name, pid);
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
  return n;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(faults)

// A buffer object whose process is gone and holds no entry (a worker
// evicted before it died, or one of a server before this one) is removed
// by the server's periodic sweep, not left until the server stops.
BOOST_AUTO_TEST_CASE(a_dead_processs_buffer_without_an_entry_is_swept) {
  test::ServerProcess server(test::unique_name("sweep"), {"--tensor", "w:1"});
  auto gone = test::Process::fork_fn([] { return 0; });
  const pid_t pid = gone.pid();
  BOOST_REQUIRE(gone.wait() == 0);  // reaped: no process holds the pid
  const std::string object = shm::buffer_object_name(server.name(), pid, 0);
  auto made = shm::ShmObject::create(object, 4096, 0600);
  BOOST_REQUIRE_MESSAGE(made.ok(), made.status().to_string());
  BOOST_TEST(leftover_buffers(server.name(), pid) == 1u);
  BOOST_TEST(test::eventually([&] { return leftover_buffers(server.name(), pid) == 0; }, 5s));
}

BOOST_AUTO_TEST_CASE(worker_killed_at_each_protocol_step) {
  // in_release: as the victim's Worker gives its entry back after the
  // detach at its end (the word in kReleasing, the start time cleared).
  const char* points[] = {"after_claim",   "after_buffer_create", "after_register",   "before_publish",
                          "after_publish", "after_doorbell",      "after_completion", "in_release"};
  for (const char* point : points) {
    BOOST_TEST_CONTEXT("fault point " << point) {
      test::ServerProcess server(test::unique_name("fault"), {"--tensor", "w:1", "--lr", "1", "--max-staleness",
                                                              "1000000000", "--max-workers", "3"});
      Shared* shared = test::map_shared<Shared>();
      auto bystander = test::start_bystander(server.name(), &shared->bystander);
      BOOST_REQUIRE(test::eventually([&] { return shared->bystander.acked.load() > 50; }));

      // The victim dies at the point, on its 3rd visit for per-request points.
      const std::string spec = std::string(point) + (std::string(point).find("publish") != std::string::npos ||
                                                             std::string(point).find("doorbell") != std::string::npos ||
                                                             std::string(point) == "after_completion"
                                                         ? ":3"
                                                         : "");
      auto victim = test::Process::fork_fn([&] {
        ::setenv("SHMPS_FAULT", spec.c_str(), 1);
        auto w = test::try_connect(server.name());
        if (!w) return 2;
        auto buf = w->register_buffer(4);
        if (!buf.ok()) return 3;
        *static_cast<float*>(buf->data) = -1.0f;
        for (int i = 0; i < 10; ++i) {
          auto v = w->push(0, buf->id, 0, 4, Dtype::kF32, 0);
          if (!v.ok()) return 4;
          shared->victim_acked.fetch_add(1);
        }
        return 0;  // should have died before (in_release: in the detach as `w` goes)
      });
      const pid_t victim_pid = victim.pid();
      BOOST_TEST(victim.wait(10s) == 128 + SIGKILL);

      // Its entry comes back: the bystander plus two fresh workers fit in 3.
      std::vector<std::unique_ptr<Worker>> fresh;
      BOOST_TEST(test::eventually(
          [&] {
            if (auto w = test::try_connect(server.name())) fresh.push_back(std::move(w));
            return fresh.size() == 2;
          },
          3s));
      BOOST_TEST(test::eventually([&] { return leftover_buffers(server.name(), victim_pid) == 0; }, 3s),
                 leftover_buffers(server.name(), victim_pid) << " buffer objects left in /dev/shm");
      std::this_thread::sleep_for(100ms);  // the bystander keeps going past the reaping
      shared->bystander.stop.store(1);
      BOOST_TEST(bystander.wait(10s) == 0);
      BOOST_TEST(shared->bystander.errors.load() == 0u);
      BOOST_TEST(shared->bystander.max_latency_ns.load() < 1'000'000'000u,
                 "bystander stalled for " << shared->bystander.max_latency_ns.load() / 1000000 << " ms");
      BOOST_REQUIRE(!fresh.empty());
      auto s = fresh[0]->stats();
      BOOST_REQUIRE(s.ok());
      const uint64_t acked = shared->bystander.acked.load() + shared->victim_acked.load();
      // A push published but not acknowledged is applied at most once.
      BOOST_TEST(s->gradients_applied >= acked);
      BOOST_TEST(s->gradients_applied <= acked + 1);
      auto out = fresh[0]->register_buffer(4);
      BOOST_REQUIRE(out.ok());
      BOOST_REQUIRE(fresh[0]->pull(0, out->id, 0).ok());
      BOOST_TEST(*static_cast<float*>(out->data) == static_cast<float>(s->gradients_applied));
    }
  }
}

// A worker process whose main thread exits (pthread_exit) while another
// thread keeps pushing is alive: /proc shows its leader as a zombie, but the
// server must not reap its entry under the running thread.
BOOST_AUTO_TEST_CASE(worker_whose_main_thread_exited_is_not_reaped) {
  test::ServerProcess server(test::unique_name("zleader"),
                             {"--tensor", "w:1", "--lr", "1", "--max-staleness", "1000000000"});
  struct Counters {
    std::atomic<uint64_t> acked;
    std::atomic<uint64_t> errors;
    std::atomic<uint64_t> stop;
  };
  Counters* shared = test::map_shared<Counters>();
  auto worker = test::Process::fork_fn([&]() -> int {
    static std::unique_ptr<Worker> w;  // outlives main's exit
    w = test::try_connect(server.name());
    if (!w) return 2;
    static auto buf = w->register_buffer(4);
    if (!buf.ok()) return 3;
    *static_cast<float*>(buf->data) = -1.0f;
    pthread_t t;
    ::pthread_create(
        &t, nullptr,
        [](void* arg) -> void* {
          auto* c = static_cast<Counters*>(arg);
          while (c->stop.load() == 0) {
            if (w->push(0, buf->id, 0, 4, Dtype::kF32, 0).ok())
              c->acked.fetch_add(1);
            else
              c->errors.fetch_add(1);
          }
          std::_Exit(0);
        },
        shared);
    // Only this thread ends (the raw exit system call: no unwinding through
    // fork_fn, no exit of the thread group).
    ::syscall(SYS_exit, 0);
    return 4;
  });
  BOOST_REQUIRE(test::eventually([&] { return shared->acked.load() > 10; }));
  // Several of the server's 50 ms liveness sweeps pass.
  std::this_thread::sleep_for(400ms);
  const uint64_t mid = shared->acked.load();
  BOOST_TEST(test::eventually([&] { return shared->acked.load() > mid; }));
  BOOST_TEST(shared->errors.load() == 0u);
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  BOOST_TEST((*seg)->stats().workers_died.load() == 0u);
  shared->stop.store(1);
  BOOST_TEST(worker.wait(10s) == 0);
}

BOOST_AUTO_TEST_SUITE_END()
