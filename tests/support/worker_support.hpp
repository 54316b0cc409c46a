// Worker-side fixtures of the multi-process tests: connecting a Worker
// (failing the test, or returning nullptr inside a forked child where
// Boost.Test macros must not be used), counters in a shared anonymous page
// that forked children update, and a bystander process that pushes without
// pause so a test can prove that nothing stalls it. Header-only: include it
// after BOOST_TEST_MODULE's unit_test.hpp. Not thread-safe.
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "shmps/shm/futex.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"

namespace shmps::test {

// Rings entry `id`'s doorbell and wakes the server, as a worker does after
// writing to its entry or lane (for tests that play a worker by hand).
inline void ring_doorbell(const shm::Segment& seg, uint32_t id) {
  // seq_cst: the Dekker pattern with the server's sleep, as a worker rings.
  seg.header().doorbell[id / 64].fetch_or(uint64_t{1} << (id % 64), std::memory_order_seq_cst);  // SYNC(doorbell)
  shm::notify(seg.header().server_wake);
}

// A Worker of server `name`, or nullptr (for forked children: they report
// failure by exit code).
inline WorkerOptions worker_options(const std::string& name, std::chrono::milliseconds timeout, bool reconnect) {
  WorkerOptions o;
  o.name = name;
  o.timeout = timeout;
  o.reconnect = reconnect;
  return o;
}

inline std::unique_ptr<Worker> try_connect(const std::string& name,
                                           std::chrono::milliseconds timeout = std::chrono::seconds(10),
                                           bool reconnect = false) {
  auto w = Worker::connect(worker_options(name, timeout, reconnect));
  return w.ok() ? std::move(w).value() : nullptr;
}

// A Worker of server `name`; fails the test (with the reason) if it cannot
// connect. The test's main process only.
inline std::unique_ptr<Worker> connect(const std::string& name,
                                       std::chrono::milliseconds timeout = std::chrono::seconds(10),
                                       bool reconnect = false) {
  auto w = Worker::connect(worker_options(name, timeout, reconnect));
  BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  return std::move(w).value();
}

// A value-initialized T in its own MAP_SHARED anonymous mapping: forked
// children see and update the parent's copy (use atomics). Never unmapped:
// it lives as long as the test process.
template <class T>
T* map_shared() {
  void* p = ::mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap of a shared page failed");
  return new (p) T{};
}

// What a bystander reports, in a map_shared() page.
struct BystanderCounters {
  std::atomic<uint64_t> stop{0};            // set to 1 to end it
  std::atomic<uint64_t> acked{0};           // pushes acknowledged
  std::atomic<uint64_t> errors{0};          // pushes that failed
  std::atomic<uint64_t> max_latency_ns{0};  // slowest acknowledged push
};

// A child process that pushes a gradient of -1.0 (fp32) to tensor 0, which
// must have one element, computed at version 0, as fast as it can until
// counters->stop; it exits 0, or 2/3 if it cannot connect or register.
inline Process start_bystander(const std::string& name, BystanderCounters* counters) {
  return Process::fork_fn([name, counters] {
    auto w = try_connect(name);
    if (!w) return 2;
    auto buf = w->register_buffer(4);
    if (!buf.ok()) return 3;
    *static_cast<float*>(buf->data) = -1.0f;
    while (counters->stop.load() == 0) {
      const uint64_t t0 = shm::monotonic_ns();
      auto v = w->push(0, buf->id, 0, 4, Dtype::kF32, 0);
      const uint64_t dt = shm::monotonic_ns() - t0;
      if (!v.ok()) {
        counters->errors.fetch_add(1);
        continue;
      }
      counters->acked.fetch_add(1);
      uint64_t seen = counters->max_latency_ns.load();
      while (dt > seen && !counters->max_latency_ns.compare_exchange_weak(seen, dt)) {
      }
    }
    return 0;
  });
}

// Boost.Test precondition: the build's Gloo federation plugin
// (SHMPS_BUILD_DIR/lib/shmps/libshmps_fed_gloo.so) exists; it is built
// only where Debian's libgloo-dev is installed.
inline boost::test_tools::assertion_result has_gloo_plugin(boost::unit_test::test_unit_id) {
  const char* build = std::getenv("SHMPS_BUILD_DIR");
  boost::test_tools::assertion_result r(
      build != nullptr && std::filesystem::exists(std::filesystem::path(build) / "lib/shmps/libshmps_fed_gloo.so"));
  r.message() << "no Gloo plugin in the build (SHMPS_BUILD_DIR/lib/shmps/libshmps_fed_gloo.so)";
  return r;
}

}  // namespace shmps::test
