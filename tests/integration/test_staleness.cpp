// The staleness policies end to end (--staleness-policy reject | wait |
// scale), --lr-schedule with them, and the apply-thread choice
// (--apply-threads), with a real
// shmps-server and real worker processes. The slow worker is a forked
// child that pushes only when the test tells it to (a page of shared
// counters), or dies when the test kills it.
#define BOOST_TEST_MODULE test_staleness
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numbers>
#include <span>
#include <thread>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

// What the test and its slow worker share.
struct Control {
  std::atomic<uint64_t> pushes_wanted{0};  // the child pushes until it has done this many
  std::atomic<uint64_t> pushes_done{0};
  std::atomic<uint64_t> last_push_ns{0};  // when its last push returned
  std::atomic<uint64_t> failed{0};
  std::atomic<uint32_t> entry{UINT32_MAX};  // a forked fast worker's entry
};

// A worker process that pushes a gradient of ones to a tensor (tensor 0
// of 4 elements unless told) whenever control->pushes_wanted grows,
// pulling before each push.
test::Process start_slow_worker(const std::string& name, Control* control, uint32_t tensor = 0, uint64_t elements = 4) {
  return test::Process::fork_fn([name, control, tensor, elements] {
    auto w = test::try_connect(name);
    if (!w) return 2;
    auto grad = w->register_buffer(elements * 4);
    auto weights = w->register_buffer(elements * 4);
    if (!grad.ok() || !weights.ok()) return 3;
    std::fill_n(static_cast<float*>(grad->data), elements, 1.0f);
    while (true) {
      if (control->pushes_done.load() >= control->pushes_wanted.load()) {
        std::this_thread::sleep_for(1ms);
        continue;
      }
      auto v = w->pull(tensor, weights->id, 0);
      auto p = v.ok() ? w->push(tensor, grad->id, 0, elements * 4, Dtype::kF32, *v) : Result<uint64_t>(v.status());
      if (!p.ok()) control->failed.fetch_add(1);
      control->last_push_ns.store(shm::monotonic_ns());
      control->pushes_done.fetch_add(1);
    }
  });
}

// The test process's own worker: pull, then push (a step).
struct FastWorker {
  explicit FastWorker(const std::string& name, std::chrono::milliseconds timeout = 10s)
      : FastWorker(test::connect(name, timeout)) {}
  explicit FastWorker(std::unique_ptr<Worker> worker) : w(std::move(worker)) {
    auto g = w->register_buffer(16);
    auto p = w->register_buffer(16);
    BOOST_REQUIRE(g.ok() && p.ok());
    grad = *g;
    weights = *p;
    std::fill_n(static_cast<float*>(grad.data), 4, 1.0f);
  }
  Result<uint64_t> pull() { return w->pull(0, weights.id, 0); }
  void step() {
    auto v = pull();
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    auto p = w->push(0, grad.id, 0, 16, Dtype::kF32, *v);
    BOOST_REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  }
  ServerStats stats() {
    auto s = w->stats();
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    return *s;
  }
  std::unique_ptr<Worker> w;
  Buffer grad{}, weights{};
};

// A pull run on its own thread: done once it returned, with its result.
struct PendingPull {
  explicit PendingPull(FastWorker& fast)
      : thread([this, &fast] {
          result = fast.pull();
          returned_ns.store(shm::monotonic_ns());
          done.store(true);
        }) {}
  ~PendingPull() {
    if (thread.joinable()) thread.join();
  }
  bool finished_within(std::chrono::milliseconds t) {
    return test::eventually([&] { return done.load(); }, t);
  }
  std::atomic<bool> done{false};
  std::atomic<uint64_t> returned_ns{0};
  Result<uint64_t> result{Status{ErrorCode::kInternal, "not returned"}};
  std::thread thread;
};

// Pushes w's gradient (tensor w, 4 elements; g[e] = 0.1 (e + 1) - slope k
// at push k) against the version `stalenesses[k]` behind the server's,
// runs the same updates through the kernels from the weights pulled
// first, each with the lr lr_of(version, staleness), and checks that the
// server's weights equal them bit for bit (the same fp32 operations).
// Returns the version reached.
uint64_t push_and_match_the_kernels(FastWorker& w, kernels::OptimizerConfig config,
                                    std::span<const uint64_t> stalenesses, float slope,
                                    const std::function<float(uint64_t, uint64_t)>& lr_of) {
  auto v0 = w.pull();
  BOOST_REQUIRE(v0.ok());
  std::vector<float> weights(static_cast<const float*>(w.weights.data), static_cast<const float*>(w.weights.data) + 4);
  std::vector<float> state(8, 0.0f);
  float* g = static_cast<float*>(w.grad.data);
  uint64_t version = *v0;
  for (uint64_t k = 0; k < stalenesses.size(); ++k) {
    for (int e = 0; e < 4; ++e) g[e] = 0.1f * static_cast<float>(e + 1) - slope * static_cast<float>(k);
    const uint64_t at = version - std::min(version, stalenesses[k]);
    auto v = w.w->push(0, w.grad.id, 0, 16, Dtype::kF32, at);
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    config.lr = lr_of(version, version - at);
    kernels::TensorState ts;
    ts.weights = weights.data();
    ts.state[0] = state.data();
    ts.state[1] = state.data() + 4;
    ts.n = 4;
    kernels::apply_cpu(config, ts, g, kernels::GradDtype::kF32, k + 1);
    version = *v;
  }
  BOOST_REQUIRE(w.pull().ok());
  const float* served = static_cast<const float*>(w.weights.data);
  for (int e = 0; e < 4; ++e) BOOST_TEST(served[e] == weights[e]);
  return version;
}

const std::vector<std::string> kWait = {"--tensor",        "w:4", "--lr", "0.5", "--staleness-policy", "wait",
                                        "--max-staleness", "2"};

// The slow worker pushes once and counts from then on; the fast one is 2
// clocks ahead after its own first step (it joins at the slow one's clock,
// as many pushes as it) plus two: at the bound, not past it.
void fast_at_the_bound(Control* control, FastWorker& fast) {
  control->pushes_wanted.store(1);
  BOOST_REQUIRE(test::eventually([&] { return control->pushes_done.load() == 1; }));
  fast.step();  // clock 1, as the slow one: neither ahead
  BOOST_TEST(fast.stats().my_pulls_waited == 0u);
  for (int k = 0; k < 2; ++k) fast.step();  // clocks 2, 3 against the slow one's 1
}

// The server's gauge of the pulls it holds now (refreshed every 10 ms).
uint64_t pulls_held(const std::string& name) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  // relaxed: a gauge.
  return seg.ok() ? (*seg)->stats().pulls_held.load(std::memory_order_relaxed) : 0;
}

// The threads the server's updates split over here: its CPUs, as far as
// OpenMP splits at all (OMP_NUM_THREADS; 1 in a build without OpenMP, the
// tsan preset), as this process's copy of the same kernels reports.
uint64_t split_threads() {
  cpu_set_t mine;
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return 1;
  return std::min<uint64_t>(static_cast<uint64_t>(CPU_COUNT(&mine)), kernels::set_cpu_threads(0));
}

boost::test_tools::assertion_result updates_split(boost::unit_test::test_unit_id) {
  boost::test_tools::assertion_result r(split_threads() >= 2);
  r.message() << "the server's updates run on " << split_threads()
              << " thread here (one CPU, or no OpenMP): no worker to leave out of the count";
  return r;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(staleness)

// SSP: the fast worker's pull waits exactly while it is more than
// max_staleness clocks ahead of the slowest, and goes on when the slow
// worker pushes.
BOOST_AUTO_TEST_CASE(wait_holds_a_pull_while_more_than_the_bound_ahead_and_releases_it_on_a_push) {
  test::ServerProcess server(test::unique_name("ssp"), kWait);
  auto* control = test::map_shared<Control>();
  test::Process slow = start_slow_worker(server.name(), control);
  FastWorker fast(server.name());
  fast_at_the_bound(control, fast);
  // 3 - 1 = 2: at the bound, its pull is served at once.
  BOOST_REQUIRE(fast.pull().ok());
  BOOST_TEST(fast.stats().my_pulls_waited == 0u);
  auto v = fast.pull();
  BOOST_REQUIRE(v.ok());
  BOOST_REQUIRE(fast.w->push(0, fast.grad.id, 0, 16, Dtype::kF32, *v).ok());  // clock 4: 3 ahead

  PendingPull held(fast);
  // Published, then held, by the time the gauge shows it.
  BOOST_REQUIRE(test::eventually([&] { return pulls_held(server.name()) == 1u; }));
  const uint64_t held_seen = shm::monotonic_ns();
  BOOST_TEST(!held.finished_within(300ms), "the pull 3 clocks ahead was not held");
  const uint64_t pushed_at = shm::monotonic_ns();
  control->pushes_wanted.store(2);  // the slow worker reaches clock 2: the fast one is 2 ahead again
  BOOST_REQUIRE_MESSAGE(held.finished_within(5s), "the slow worker's push did not release the pull");
  BOOST_REQUIRE_MESSAGE(held.result.ok(), held.result.status().to_string());
  BOOST_TEST(held.returned_ns.load() >= pushed_at);
  BOOST_TEST(control->failed.load() == 0u);
  const ServerStats s = fast.stats();
  BOOST_TEST(s.my_pulls_waited == 1u);
  // Counted from its publish, before the gauge showed it, to its answer,
  // after the push: at least the 300 ms watched.
  BOOST_TEST(s.my_wait_ns >= pushed_at - held_seen);
  BOOST_TEST(s.pulls_waited == 1u);
  BOOST_TEST(s.rejected_stale == 0u);
}

// A dead slowest worker stops counting at once: the held pull goes on.
BOOST_AUTO_TEST_CASE(wait_releases_a_held_pull_when_the_slowest_worker_is_killed) {
  test::ServerProcess server(test::unique_name("ssp_kill"), kWait);
  auto* control = test::map_shared<Control>();
  test::Process slow = start_slow_worker(server.name(), control);
  FastWorker fast(server.name());
  fast_at_the_bound(control, fast);
  fast.step();  // clock 4
  PendingPull held(fast);
  BOOST_TEST(!held.finished_within(300ms));
  // The stats block shows it held now, before it is answered.
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  // relaxed: a gauge the server refreshes every 10 ms.
  const auto held_now = [&] { return (*seg)->stats().pulls_held.load(std::memory_order_relaxed); };
  BOOST_TEST(test::eventually([&] { return held_now() == 1u; }));
  BOOST_TEST((*seg)->stats().pulls_waited.load(std::memory_order_relaxed) == 0u);  // counted once answered
  const uint64_t killed_at = shm::monotonic_ns();
  slow.signal(SIGKILL);
  BOOST_REQUIRE_MESSAGE(held.finished_within(5s), "the pull stayed held after the slowest worker died");
  BOOST_REQUIRE_MESSAGE(held.result.ok(), held.result.status().to_string());
  // The server finds dead workers every 50 ms.
  BOOST_TEST(held.returned_ns.load() - killed_at < 2'000'000'000u);
  BOOST_TEST(test::eventually([&] { return held_now() == 0u; }));
  fast.step();  // alone now: never held
  BOOST_TEST(fast.stats().my_pulls_waited == 1u);
}

// A held pull whose session ends (its worker evicted as stopped too long,
// or killed) is dropped unanswered, and counted as waited with its time.
BOOST_AUTO_TEST_CASE(a_held_pull_dropped_with_its_session_counts_as_waited) {
  std::vector<std::string> args = kWait;
  args.insert(args.end(), {"--stopped-worker-timeout-ms", "200"});
  test::ServerProcess server(test::unique_name("ssp_drop"), args);
  auto* control = test::map_shared<Control>();
  test::Process slow = start_slow_worker(server.name(), control);
  control->pushes_wanted.store(1);
  BOOST_REQUIRE(test::eventually([&] { return control->pushes_done.load() == 1; }));
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  // relaxed: counters the server refreshes; polled until they settle.
  const auto stat = [&](std::atomic<uint64_t> shm::StatsBlock::*field) {
    return ((*seg)->stats().*field).load(std::memory_order_relaxed);
  };
  const std::string name = server.name();
  // Four steps (clock 4 against the slow worker's 1), then a pull: held.
  const auto held_worker = [name] {
    return test::Process::fork_fn([name] {
      auto w = test::try_connect(name, 20s);
      if (!w) return 2;
      auto grad = w->register_buffer(16);
      auto weights = w->register_buffer(16);
      if (!grad.ok() || !weights.ok()) return 3;
      for (int k = 0; k < 4; ++k) {
        auto v = w->pull(0, weights->id, 0);
        if (!v.ok() || !w->push(0, grad->id, 0, 16, Dtype::kF32, *v).ok()) return 4;
      }
      (void)w->pull(0, weights->id, 0);
      return 5;
    });
  };
  test::Process stopped = held_worker();
  BOOST_REQUIRE(test::eventually([&] { return stat(&shm::StatsBlock::pulls_held) == 1u; }));
  stopped.signal(SIGSTOP);
  BOOST_REQUIRE(test::eventually([&] { return stat(&shm::StatsBlock::workers_evicted) == 1u; }, 5s));
  BOOST_TEST(test::eventually([&] { return stat(&shm::StatsBlock::pulls_held) == 0u; }));
  BOOST_TEST(test::eventually([&] { return stat(&shm::StatsBlock::pulls_waited) == 1u; }));
  BOOST_TEST(stat(&shm::StatsBlock::wait_ns) >= 200'000'000u);  // held at least until the eviction
  stopped.signal(SIGKILL);
  BOOST_TEST(stopped.wait(10s) == 128 + SIGKILL);

  test::Process killed = held_worker();
  BOOST_REQUIRE(test::eventually([&] { return stat(&shm::StatsBlock::pulls_held) == 1u; }));
  killed.signal(SIGKILL);
  BOOST_TEST(killed.wait(10s) == 128 + SIGKILL);
  BOOST_TEST(test::eventually([&] { return stat(&shm::StatsBlock::pulls_waited) == 2u; }, 5s));
  BOOST_TEST(test::eventually([&] { return stat(&shm::StatsBlock::pulls_held) == 0u; }));  // a gauge: every 10 ms
  BOOST_TEST(control->failed.load() == 0u);
}

// A pull held for its whole wait fails with kTimeout naming whom it waited
// for; the session goes on, and the next pull is served once the slow
// worker caught up.
BOOST_AUTO_TEST_CASE(wait_times_out_cleanly_and_the_session_goes_on) {
  test::ServerProcess server(test::unique_name("ssp_timeout"), kWait);
  auto* control = test::map_shared<Control>();
  test::Process slow = start_slow_worker(server.name(), control);
  FastWorker fast(server.name(), 800ms);
  fast_at_the_bound(control, fast);
  fast.step();  // clock 4
  const uint64_t t0 = shm::monotonic_ns();
  auto v = fast.pull();
  const uint64_t took = shm::monotonic_ns() - t0;
  BOOST_REQUIRE(!v.ok());
  BOOST_TEST((v.status().code() == ErrorCode::kTimeout), v.status().to_string());
  BOOST_TEST(v.status().message().find("at clock 4, more than 2 ahead of worker ") != std::string::npos,
             v.status().message());
  BOOST_TEST(v.status().message().ends_with(" at 1"), v.status().message());
  // All but a quarter of the 800 ms timeout, counted from the submit (the
  // message is the server's answer, not the worker's own deadline's).
  BOOST_TEST(took >= 550'000'000u);
  control->pushes_wanted.store(2);
  BOOST_REQUIRE(test::eventually([&] { return control->pushes_done.load() == 2; }));
  auto again = fast.pull();
  BOOST_REQUIRE_MESSAGE(again.ok(), again.status().to_string());
  const ServerStats s = fast.stats();
  BOOST_TEST(s.rejected_timeout == 1u);
  BOOST_TEST(s.my_pulls_waited == 1u);
  BOOST_TEST(s.my_pushes_rejected == 0u);
  // The entry counts its own timeouts (shmps-inspect's per-worker view).
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  // relaxed: the completions above ordered the server's counts before us.
  BOOST_TEST((*seg)->worker(fast.w->worker_id()).pulls_timed_out.load(std::memory_order_relaxed) == 1u);
}

// WorkerOptions::interrupted, asked while a held pull sleeps, ends its wait
// at once with kInterrupted, and the worker cancels the pull: the server
// answers it at once (kInterrupted, not counted as a rejection) instead of
// at the end of its wait, so the rest of the lane (here a ping, as a
// detach would be) goes on while the slow worker is still behind.
BOOST_AUTO_TEST_CASE(an_interrupted_wait_cancels_the_held_pull_and_the_session_goes_on) {
  test::ServerProcess server(test::unique_name("ssp_interrupt"), kWait);
  auto* control = test::map_shared<Control>();
  test::Process slow = start_slow_worker(server.name(), control);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> asked{0};
  WorkerOptions o = test::worker_options(server.name(), 20s, false);
  o.interrupted = [&] {
    asked.fetch_add(1);
    return stop.load();
  };
  auto connected = Worker::connect(o);
  BOOST_REQUIRE_MESSAGE(connected.ok(), connected.status().to_string());
  FastWorker fast(std::move(connected).value());
  fast_at_the_bound(control, fast);
  fast.step();  // clock 4: the next pull is held
  {
    PendingPull held(fast);
    BOOST_TEST(!held.finished_within(300ms));
    BOOST_TEST(test::eventually([&] { return asked.load() > 0u; }));  // asked while it slept
    // A cancel word below the held pull's id (9: two registrations, three
    // steps, then this pull) releases nothing: a stale or garbage word
    // withdraws only pulls up to it, and only this worker's.
    auto seg = shm::Segment::open(server.name(), /*read_only=*/false);
    BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
    const uint32_t id = fast.w->worker_id();
    for (uint64_t garbage : {uint64_t{1}, uint64_t{8}}) {
      // relaxed: garbage on purpose, published by the doorbell below.
      (*seg)->worker(id).cancel_request.store(garbage, std::memory_order_relaxed);
      test::ring_doorbell(**seg, id);
      BOOST_TEST(!held.finished_within(150ms));
    }
    const uint64_t t0 = shm::monotonic_ns();
    stop.store(true);
    BOOST_REQUIRE(held.finished_within(2s));
    BOOST_TEST(held.returned_ns.load() - t0 < 1'000'000'000u);  // a 20 ms slice, not the 20 s timeout
    BOOST_TEST((held.result.status().code() == ErrorCode::kInterrupted), held.result.status().to_string());
    BOOST_TEST(
        held.result.status().message().find("interrupted while waiting for the server's answer") != std::string::npos,
        held.result.status().message());
  }
  stop.store(false);
  // The slow worker has not moved, and the lane is not stuck behind the pull.
  const uint64_t t1 = shm::monotonic_ns();
  BOOST_TEST(fast.w->ping().ok());
  BOOST_TEST(shm::monotonic_ns() - t1 < 2'000'000'000u);
  BOOST_TEST(control->pushes_done.load() == 1u);
  ServerStats s = fast.stats();
  BOOST_TEST(s.my_pulls_waited == 1u);
  BOOST_TEST(s.rejected_timeout == 0u);
  BOOST_TEST(s.rejected_invalid == 0u);
  BOOST_TEST(s.my_pulls == 4u);  // the cancelled pull copied nothing
  // The next pull is held again until the slow worker catches up.
  control->pushes_wanted.store(3);
  BOOST_REQUIRE(test::eventually([&] { return control->pushes_done.load() == 3; }));
  auto again = fast.pull();
  BOOST_REQUIRE_MESSAGE(again.ok(), again.status().to_string());
  BOOST_TEST(*again == 7u);  // the fast worker's 4 pushes and the slow one's 3
  BOOST_TEST(control->failed.load() == 0u);
}

// A worker killed between writing its cancel word and ringing its doorbell
// (fault point after_cancel) takes its held pull with its session, and the
// next owner of its entry starts with the word cleared: its own held pull,
// of the same request id, stays held until the slow worker pushes.
BOOST_AUTO_TEST_CASE(a_worker_killed_while_cancelling_leaves_no_cancel_behind) {
  test::ServerProcess server(test::unique_name("ssp_cancel_kill"), kWait);
  auto* control = test::map_shared<Control>();
  test::Process slow = start_slow_worker(server.name(), control);
  control->pushes_wanted.store(1);
  BOOST_REQUIRE(test::eventually([&] { return control->pushes_done.load() == 1; }));
  const std::string name = server.name();
  // Both take the same steps: 2 registrations, 4 pulls and 4 pushes (clock
  // 4 against the slow worker's 1: the first push joins at 1), then pull
  // number 11, which is held.
  const auto ahead = [](FastWorker& w) {
    for (int k = 0; k < 4; ++k) w.step();
  };
  test::Process doomed = test::Process::fork_fn([name, ahead, control] {
    ::setenv("SHMPS_FAULT", "after_cancel", 1);
    WorkerOptions o = test::worker_options(name, 20s, false);
    std::atomic<uint64_t> armed_at{0};  // asked to stop 300 ms into the last pull only
    o.interrupted = [&armed_at] {
      const uint64_t t = armed_at.load();
      return t != 0 && shm::monotonic_ns() - t > 300'000'000u;
    };
    auto w = Worker::connect(o);
    if (!w.ok()) return 2;
    FastWorker fast(std::move(w).value());
    control->entry.store(fast.w->worker_id());
    ahead(fast);
    armed_at.store(shm::monotonic_ns());
    (void)fast.pull();  // held, interrupted, killed at after_cancel
    return 3;
  });
  BOOST_TEST(doomed.wait(20s) == 128 + SIGKILL);
  auto seg = shm::Segment::open(name, /*read_only=*/true);  // watched without taking an entry
  BOOST_REQUIRE_MESSAGE(seg.ok(), seg.status().to_string());
  const uint32_t entry = control->entry.load();
  BOOST_REQUIRE(entry < shm::kMaxWorkersLimit);
  BOOST_REQUIRE(test::eventually([&] {
    // relaxed: polled until the server has counted the death and freed the entry.
    return (*seg)->stats().workers_died.load(std::memory_order_relaxed) == 1u &&
           (*seg)->worker(entry).owner.load(std::memory_order_relaxed) == 0u;
  }));
  FastWorker next(name);
  BOOST_REQUIRE(next.w->worker_id() == entry);  // the dead worker's entry
  ahead(next);
  PendingPull held(next);
  BOOST_TEST(!held.finished_within(400ms));  // not cancelled by the dead worker's word
  control->pushes_wanted.store(3);
  BOOST_REQUIRE(held.finished_within(5s));
  BOOST_TEST(held.result.ok(), held.result.status().to_string());
  BOOST_TEST(control->failed.load() == 0u);
}

// A worker that attaches late joins at the slowest clock, and one that only
// pulls (an evaluator) holds nobody back.
BOOST_AUTO_TEST_CASE(wait_counts_a_worker_from_its_first_push_only) {
  test::ServerProcess server(test::unique_name("ssp_join"), kWait);
  FastWorker fast(server.name());
  FastWorker evaluator(server.name());
  for (int k = 0; k < 10; ++k) fast.step();  // far ahead of a worker that never pushes
  BOOST_TEST(fast.stats().my_pulls_waited == 0u);
  FastWorker late(server.name());
  late.step();  // joins at clock 10, so it is 0 behind
  for (int k = 0; k < 2; ++k) fast.step();
  BOOST_TEST(fast.stats().my_pulls_waited == 0u);
  BOOST_TEST(evaluator.pull().ok());
}

// scale: a push t versions old, past the bound b = max(1, max_staleness),
// is applied with lr * b / t, never rejected; the step count and the
// moments advance as for any push: bitwise what the kernels compute with
// that lr.
BOOST_AUTO_TEST_CASE(scale_applies_lr_times_bound_over_staleness_bitwise_and_rejects_nothing) {
  struct Case {
    const char* optimizer;
    uint64_t max_staleness;
    uint64_t scaled;        // pushes past the bound
    uint64_t factor_micro;  // the sum of their factors
  };
  // Stalenesses 0, 1, 2, 1, 3: past 1, the last two (1/2 + 1/3); past 2, the last (2/3).
  for (const Case& c : {Case{"sgd", 1, 2, 500'000 + 333'333}, Case{"adam", 1, 2, 500'000 + 333'333},
                        Case{"adam", 0, 2, 500'000 + 333'333}, Case{"adamw", 2, 1, 666'666}}) {
    BOOST_TEST_CONTEXT(c.optimizer << ", max_staleness " << c.max_staleness) {
      const char* optimizer = c.optimizer;
      test::ServerProcess server(test::unique_name("scale"),
                                 {"--tensor", "w:4", "--lr", "0.3", "--optimizer", optimizer, "--staleness-policy",
                                  "scale", "--max-staleness", std::to_string(c.max_staleness), "--init", "uniform"});
      FastWorker w(server.name());
      kernels::OptimizerConfig config;
      BOOST_REQUIRE(kernels::parse_optimizer_kind(optimizer, &config.kind));
      if (config.kind == kernels::OptimizerKind::kAdamW) config.weight_decay = 0.01f;  // the server's default for AdamW
      const uint64_t stalenesses[] = {0, 1, 2, 1, 3};
      push_and_match_the_kernels(w, config, stalenesses, 0.05f, [&](uint64_t, uint64_t t) {
        const uint64_t b = std::max<uint64_t>(1, c.max_staleness);
        return t > b ? 0.3f * static_cast<float>(b) / static_cast<float>(t) : 0.3f;
      });
      const ServerStats s = w.stats();
      BOOST_TEST(s.rejected_stale == 0u);
      BOOST_TEST(s.pushes_scaled == c.scaled);
      BOOST_TEST(s.my_pushes_scaled == c.scaled);
      BOOST_TEST(s.scale_factor_sum_micro == c.factor_micro);
      BOOST_TEST(s.my_scale_factor_sum_micro == c.factor_micro);
    }
  }
}

// --lr-schedule: each update gets the schedule's lr at the version it
// applies to, here a linear warm-up then cosine annealing (as torch's
// SequentialLR runs them), followed past T_max, and under scale that lr
// times b / staleness: bitwise against the kernels run with the lr of
// torch's closed forms, written out here. The stats block's gauge shows
// the next update's lr.
BOOST_AUTO_TEST_CASE(lr_schedule_gives_each_update_its_lr_under_scale_too) {
  const double base = 0.3f;  // the server's lr is a float
  // SequentialLR([LinearLR(opt, 0.25, 1.0, 3), CosineAnnealingLR(opt, 4, 0.01)], milestones=[3]).
  const auto torch_lr = [base](uint64_t k) {
    if (k < 3) return base * (0.25 + 0.75 * static_cast<double>(k) / 3.0);
    return 0.01 + (base - 0.01) * (1.0 + std::cos(std::numbers::pi * static_cast<double>(k - 3) / 4.0)) / 2.0;
  };
  test::ServerProcess server(
      test::unique_name("lrsched"),
      {"--tensor", "w:4", "--lr", "0.3", "--optimizer", "adam", "--lr-schedule", "linear:0.25:1:3,cosine:4:0.01",
       "--staleness-policy", "scale", "--max-staleness", "1", "--init", "uniform"});
  FastWorker w(server.name());
  kernels::OptimizerConfig config;
  config.kind = kernels::OptimizerKind::kAdam;
  const uint64_t stalenesses[] = {0, 1, 2, 0, 3, 1, 0, 2, 0, 0, 1};  // 2 and 3: scaled by 1/2 and 1/3
  const uint64_t version = push_and_match_the_kernels(w, config, stalenesses, 0.03f, [&](uint64_t v, uint64_t t) {
    const auto lr = static_cast<float>(torch_lr(v));
    return t > 1 ? lr * 1.0f / static_cast<float>(t) : lr;
  });
  BOOST_TEST(w.stats().pushes_scaled == 3u);
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  const auto expected_pico =
      static_cast<uint64_t>(static_cast<double>(static_cast<float>(torch_lr(version))) * 1e12 + 0.5);
  BOOST_TEST(test::eventually([&] {
               return (*seg)->stats().scheduled_lr_pico.load(std::memory_order_relaxed) ==
                      expected_pico;  // relaxed: a statistic
             }),
             (*seg)->stats().scheduled_lr_pico.load(std::memory_order_relaxed) << " vs " << expected_pico);
}

// CosineAnnealingLR with eta_min 0 reaches lr 0 at T_max (torch allows
// it): that update is applied, moving no weight, and the schedule rises
// again past it, as torch's closed form does.
BOOST_AUTO_TEST_CASE(an_lr_schedule_that_reaches_zero_applies_that_update) {
  const double base = 0.3f;
  const auto torch_lr = [base](uint64_t k) {
    return base * (1.0 + std::cos(std::numbers::pi * static_cast<double>(k) / 2.0)) / 2.0;
  };
  BOOST_REQUIRE(static_cast<float>(torch_lr(2)) == 0.0f);
  test::ServerProcess server(test::unique_name("lrzero"), {"--tensor", "w:4", "--lr", "0.3", "--optimizer", "adam",
                                                           "--lr-schedule", "cosine:2", "--init", "uniform"});
  FastWorker w(server.name());
  kernels::OptimizerConfig config;
  config.kind = kernels::OptimizerKind::kAdam;
  const uint64_t stalenesses[] = {0, 0, 0, 0};  // lr 0.3, 0.15, 0, 0.15
  BOOST_TEST(push_and_match_the_kernels(w, config, stalenesses, 0.03f,
                                        [&](uint64_t v, uint64_t) { return static_cast<float>(torch_lr(v)); }) == 4u);
}

// A schedule whose lr stays finite but makes Adam's step size, lr / (1 -
// beta1), pass the float range has that update refused: applied, it would
// write Inf and NaN into every weight.
BOOST_AUTO_TEST_CASE(an_lr_schedule_past_adams_step_size_range_is_refused_and_changes_nothing) {
  test::ServerProcess server(test::unique_name("lrstep"), {"--tensor", "w:4", "--lr", "1e37", "--optimizer", "adam",
                                                           "--lr-schedule", "exponential:10", "--init", "uniform"});
  FastWorker w(server.name());
  BOOST_REQUIRE(w.w->push(0, w.grad.id, 0, 16, Dtype::kF32, 0).ok());  // lr 1e37: a step size of 1e38
  BOOST_REQUIRE(w.pull().ok());
  const std::vector<float> before(static_cast<const float*>(w.weights.data),
                                  static_cast<const float*>(w.weights.data) + 4);
  for (const float x : before) BOOST_TEST(std::isfinite(x));
  auto refused = w.w->push(0, w.grad.id, 0, 16, Dtype::kF32, 1);  // lr 1e38: 1e39
  BOOST_TEST((refused.status().code() == ErrorCode::kNonFinite));
  BOOST_TEST(refused.status().message().find("lr-schedule") != std::string::npos, refused.status().message());
  auto v = w.pull();
  BOOST_REQUIRE(v.ok());
  BOOST_TEST(*v == 1u);
  const auto* after = static_cast<const float*>(w.weights.data);
  for (int e = 0; e < 4; ++e) BOOST_TEST(after[e] == before[e]);
}

// A new session on a reused entry starts its policy counters at 0.
BOOST_AUTO_TEST_CASE(policy_counters_start_at_zero_in_a_new_session) {
  test::ServerProcess server(test::unique_name("scale_reattach"),
                             {"--tensor", "w:4", "--staleness-policy", "scale", "--max-workers", "1"});
  {
    FastWorker w(server.name());
    for (int k = 0; k < 6; ++k) BOOST_REQUIRE(w.w->push(0, w.grad.id, 0, 16, Dtype::kF32, 0).ok());
    BOOST_TEST(w.stats().my_pushes_scaled == 1u);  // staleness 5, past the default max_staleness 4
  }
  FastWorker again(server.name());  // the one entry, reused
  const ServerStats s = again.stats();
  BOOST_TEST(s.my_pushes_scaled == 0u);
  BOOST_TEST(s.my_pulls_waited == 0u);
  BOOST_TEST(s.pushes_scaled == 1u);  // the server's own count stays
}

// reject, the default, still refuses what is more than max_staleness old.
BOOST_AUTO_TEST_CASE(reject_is_the_default) {
  test::ServerProcess server(test::unique_name("reject"), {"--tensor", "w:4", "--max-staleness", "1"});
  FastWorker w(server.name());
  for (int k = 0; k < 3; ++k) BOOST_REQUIRE(w.w->push(0, w.grad.id, 0, 16, Dtype::kF32, k).ok());
  auto stale = w.w->push(0, w.grad.id, 0, 16, Dtype::kF32, 0);
  BOOST_TEST((stale.status().code() == ErrorCode::kStale));
  BOOST_TEST(w.stats().pushes_scaled == 0u);
}

// --apply-threads auto: the server's CPUs, less one per other attached
// worker that is computing (nothing queued); a number is taken as it is.
// Host backend: apply threads split the CPU kernels (the CUDA backend
// reports 0).
BOOST_AUTO_TEST_CASE(apply_threads_follow_the_computing_workers) {
  cpu_set_t mine;
  BOOST_REQUIRE(sched_getaffinity(0, sizeof mine, &mine) == 0);
  // The server's CPUs, as far as its kernels split at all: OpenMP's own
  // count (OMP_NUM_THREADS), 1 in a build without OpenMP (the tsan preset),
  // as this process's copy of the same kernels reports.
  const auto cpus = std::min<uint64_t>(static_cast<uint64_t>(CPU_COUNT(&mine)), kernels::set_cpu_threads(0));
  const uint64_t elements = kernels::kCpuSplitMinElements;
  const std::string tensor = "w:" + std::to_string(elements);
  const auto push_and_read = [&](Worker& w, const Buffer& b) {
    BOOST_REQUIRE(w.push(0, b.id, 0, elements * 4, Dtype::kF32, w.last_version()).ok());
    auto s = w.stats();
    BOOST_REQUIRE(s.ok());
    return s->apply_threads;
  };
  {
    test::ServerProcess server(test::unique_name("threads"), {"--tensor", tensor, "--backend", "host"});
    auto a = test::connect(server.name());
    auto buf = a->register_buffer(elements * 4);
    BOOST_REQUIRE(buf.ok());
    std::memset(buf->data, 0, elements * 4);
    BOOST_TEST(push_and_read(*a, *buf) == cpus);  // alone: every CPU
    auto idle = test::connect(server.name());     // attached, nothing queued: computing
    BOOST_TEST(push_and_read(*a, *buf) == std::max<uint64_t>(1, cpus - 1));
    idle.reset();  // detached: no longer counted
    BOOST_TEST(push_and_read(*a, *buf) == cpus);
  }
  {
    // A number caps the team even for a worker alone (auto would take
    // every CPU); more than OpenMP's own count runs on that count.
    test::ServerProcess server(test::unique_name("threads1"),
                               {"--tensor", tensor, "--backend", "host", "--apply-threads", "1"});
    auto a = test::connect(server.name());
    auto buf = a->register_buffer(elements * 4);
    BOOST_REQUIRE(buf.ok());
    std::memset(buf->data, 0, elements * 4);
    BOOST_TEST(push_and_read(*a, *buf) == 1u);
  }
  {
    test::ServerProcess server(test::unique_name("threads_many"),
                               {"--tensor", tensor, "--backend", "host", "--apply-threads", "1024"});
    auto a = test::connect(server.name());
    auto buf = a->register_buffer(elements * 4);
    BOOST_REQUIRE(buf.ok());
    std::memset(buf->data, 0, elements * 4);
    BOOST_TEST(push_and_read(*a, *buf) == cpus);
  }
}

// A worker whose pull --staleness-policy wait holds waits on the server:
// auto does not count it as computing. The slowest worker's update of a
// large tensor, while the fast one's pull is held, gets every CPU.
BOOST_AUTO_TEST_CASE(apply_threads_do_not_count_a_worker_whose_pull_is_held,
                     *boost::unit_test::precondition(updates_split)) {
  const uint64_t cpus = split_threads();
  const uint64_t elements = kernels::kCpuSplitMinElements;
  std::vector<std::string> args = kWait;
  args.insert(args.end(), {"--tensor", "big:" + std::to_string(elements), "--backend", "host"});
  test::ServerProcess server(test::unique_name("threads_held"), args);
  auto* control = test::map_shared<Control>();
  // The slowest worker updates the large tensor (1).
  test::Process slow = start_slow_worker(server.name(), control, 1, elements);
  FastWorker fast(server.name());
  auto seg = shm::Segment::open(server.name(), /*read_only=*/true);
  BOOST_REQUIRE(seg.ok());
  // relaxed: a statistic, written before the push's answer.
  const auto threads = [&] { return (*seg)->stats().apply_threads.load(std::memory_order_relaxed); };
  fast_at_the_bound(control, fast);
  BOOST_TEST(threads() == cpus - 1);  // the slow worker's first update: the fast one attached, computing
  fast.step();                        // clock 4 against the slow one's 1
  PendingPull held(fast);
  BOOST_REQUIRE(test::eventually([&] { return pulls_held(server.name()) == 1u; }));
  control->pushes_wanted.store(2);  // its update, the fast one's pull held; then it releases the pull
  BOOST_REQUIRE(test::eventually([&] { return control->pushes_done.load() == 2; }));
  BOOST_TEST(control->failed.load() == 0u);
  BOOST_TEST(threads() == cpus);  // the held worker waits on the server: every CPU
  BOOST_REQUIRE(held.finished_within(5s));
  BOOST_REQUIRE_MESSAGE(held.result.ok(), held.result.status().to_string());
}

BOOST_AUTO_TEST_SUITE_END()
