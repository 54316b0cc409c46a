// The CUDA backend end to end on one GPU: a real shmps-server process
// (--backend cuda) and worker processes pushing from and pulling into
// device memory through real CUDA IPC handles and interprocess events.
// The seed's two tests on device memory, two gradients inside one
// allocation with poison around them, one buffer pushed 100 times (one
// open), 1,000 register/push/unregister cycles (IPC handle opens ==
// closes, device memory back), a worker killed with a push in flight, and
// the caller's
// stream ordering blocking and asynchronous calls; and a worker in the
// server's own process, whose device buffers go by offer, not IPC. The
// counts are the server's (StatsBlock): mappings_* count its PeerBuffers,
// ipc_handles_* its cudaIpcOpenMemHandle calls and the
// cudaIpcCloseMemHandle calls that succeeded.
// CUDA runs only in forked children: the test process itself never
// initialises CUDA (a child forked after that could not use it). Without a
// device every case is skipped with the reason (docs/cuda.md: run on an
// H200 by tools/gpu-check.sh).
#define BOOST_TEST_MODULE test_gpu_ipc
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "shmps/server/server.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

namespace {

// Memory shared with forked children: a counter and a reason text.
struct Shared {
  std::atomic<uint64_t> counter{0};
  char text[1024] = {};
};
Shared* shared_page() {
  static Shared* page = [] {
    void* p = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return new (p) Shared;
  }();
  return page;
}

// Precondition of every case: a device, probed in a child process.
boost::test_tools::assertion_result has_cuda_device(boost::unit_test::test_unit_id) {
  Shared* s = shared_page();
  std::snprintf(s->text, sizeof s->text, "the probe process died");
  auto probe = test::Process::fork_fn([s] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    std::snprintf(s->text, sizeof s->text, "%s",
                  e != cudaSuccess ? cudaGetErrorName(e)
                  : count == 0     ? "0 devices"
                                   : "");
    return e == cudaSuccess && count > 0 ? 0 : 1;
  });
  if (probe.wait(30s) == 0) return true;
  boost::test_tools::assertion_result result(false);
  result.message() << "no CUDA device: " << s->text;
  return result;
}

// In a child: a failed expectation prints its reason and fails the child.
#define EXPECT(cond, what)                                                                           \
  do {                                                                                               \
    if (!(cond)) {                                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #cond, std::string(what).c_str()); \
      return 1;                                                                                      \
    }                                                                                                \
  } while (0)
#define CK(expr) EXPECT((expr) == cudaSuccess, cudaGetErrorName(cudaGetLastError()))

std::unique_ptr<Worker> connect(const std::string& name) {
  WorkerOptions o;
  o.name = name;
  o.timeout = 30s;
  auto w = Worker::connect(o);
  if (!w.ok()) {
    std::fprintf(stderr, "connect: %s\n", w.status().to_string().c_str());
    return nullptr;
  }
  return std::move(w).value();
}

// Runs fn in a child and requires exit code 0.
void in_child(const std::function<int()>& fn, std::chrono::seconds timeout = 240s) {
  auto child = test::Process::fork_fn(fn);
  BOOST_TEST(child.wait(timeout) == 0);
}

std::vector<std::string> cuda_args(std::vector<std::string> more) {
  std::vector<std::string> a = {"--backend", "cuda", "--lr", "0.5", "--init", "uniform", "--init-seed", "7"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<float> download(const float* device, size_t n) {
  std::vector<float> out(n);
  if (cudaMemcpy(out.data(), device, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) out.assign(n, NAN);
  return out;
}

uint64_t stat_of(const std::string& name, std::atomic<uint64_t> shm::StatsBlock::*field) {
  auto seg = shm::Segment::open(name, /*read_only=*/true);
  if (!seg.ok()) return UINT64_MAX;
  return ((*seg)->stats().*field).load(std::memory_order_relaxed);  // relaxed: a statistic
}

// In a child, on a fresh server (lr 0.5): device buffers for a gradient
// and the weights, a pull at version 0, a push that returns 1, and the
// pulled weights w - lr * g.
int first_push_applies_sgd(Worker& w) {
  const uint64_t n = w.total_elements();
  float *grad = nullptr, *weights = nullptr;
  CK(cudaMalloc(&grad, n * 4));
  CK(cudaMalloc(&weights, n * 4));
  auto g = w.register_device_buffer(grad, n * 4);
  EXPECT(g.ok(), g.status().to_string());
  auto wb = w.register_device_buffer(weights, n * 4);
  EXPECT(wb.ok(), wb.status().to_string());
  auto v = w.pull(kAllTensors, *wb, 0);
  EXPECT(v.ok() && *v == 0, v.status().to_string());
  const std::vector<float> before = download(weights, n);
  std::vector<float> host(n);
  for (uint64_t i = 0; i < n; ++i) host[i] = 0.25f * static_cast<float>(i) - 1.0f;
  CK(cudaMemcpy(grad, host.data(), n * 4, cudaMemcpyHostToDevice));
  auto pushed = w.push(kAllTensors, *g, 0, n * 4, Dtype::kF32, 0, /*stream=*/nullptr);
  EXPECT(pushed.ok() && *pushed == 1, pushed.status().to_string());
  v = w.pull(kAllTensors, *wb, 0);
  EXPECT(v.ok() && *v == 1, v.status().to_string());
  const std::vector<float> after = download(weights, n);
  for (uint64_t i = 0; i < n; ++i)
    EXPECT(std::fabs(after[i] - (before[i] - 0.5f * host[i])) <= 1e-6f, "element " + std::to_string(i));
  return 0;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(gpu_ipc, *boost::unit_test::precondition(has_cuda_device))

// Seed test 1 on device memory: a push at version 0 returns 1 and w -= lr * g.
BOOST_AUTO_TEST_CASE(seed_push_at_version_0_returns_1_and_applies_sgd_from_device_memory) {
  test::ServerProcess server(test::unique_name("gseed1"), cuda_args({"--tensor", "w:4x2", "--tensor", "b:8"}));
  in_child([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect");
    return first_push_applies_sgd(*w);
  });
}

// A worker in the server's own process (a process cannot open its own IPC
// handles): its device buffers reach the server as offers in the process's
// memory (shm/in_process.hpp), and a push and a pull through them do what
// they do from another process.
BOOST_AUTO_TEST_CASE(a_worker_in_the_servers_process_pushes_and_pulls_device_memory) {
  in_child([&] {
    server::ServerConfig config;
    config.name = test::unique_name("ginproc");
    config.tensors = {{"w", {8}}};
    config.backend = server::BackendKind::kCuda;
    config.optimizer.lr = 0.5f;
    auto created = server::Server::create(config);
    EXPECT(created.ok(), created.status().to_string());
    std::unique_ptr<server::Server> srv = std::move(created).value();
    std::atomic<bool> run_ok{false};
    std::thread serving([&] { run_ok = srv->run().ok(); });
    const int code = [&] {
      auto w = connect(config.name);
      EXPECT(w != nullptr, "connect");
      if (const int failed = first_push_applies_sgd(*w); failed != 0) return failed;
      EXPECT(stat_of(config.name, &shm::StatsBlock::mappings_opened) == 2, "mappings_opened");
      EXPECT(stat_of(config.name, &shm::StatsBlock::ipc_handles_opened) == 0, "ipc_handles_opened: offers need no IPC");
      EXPECT(w->detach().ok(), "detach");
      return 0;
    }();
    srv->request_stop();
    serving.join();
    EXPECT(run_ok.load(), "the server's run() failed");
    return code;
  });
}

// The caller's stream orders the server's work after its own, for the
// blocking calls (which wait for the stream before they send) and the
// asynchronous ones (which record an interprocess event the server's
// stream waits for): a host function holds the stream 50 ms before the
// gradient is copied in, and the push applies that gradient; a copy out of
// the weights' buffer held the same way still reads the old weights, not
// the pull's.
BOOST_AUTO_TEST_CASE(the_callers_stream_orders_blocking_and_async_calls) {
  test::ServerProcess server(test::unique_name("gorder"), cuda_args({"--tensor", "w:4096"}));
  in_child([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect");
    const uint64_t n = w->total_elements();
    float *grad = nullptr, *weights = nullptr, *host = nullptr, *snapshot = nullptr;
    CK(cudaMalloc(&grad, n * 4));
    CK(cudaMalloc(&weights, n * 4));
    CK(cudaMallocHost(&host, n * 4));  // pinned: the copies stay asynchronous
    CK(cudaMallocHost(&snapshot, n * 4));
    cudaStream_t stream = nullptr;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto g = w->register_device_buffer(grad, n * 4);
    EXPECT(g.ok(), g.status().to_string());
    auto wb = w->register_device_buffer(weights, n * 4);
    EXPECT(wb.ok(), wb.status().to_string());
    auto v = w->pull(kAllTensors, *wb, 0, stream);
    EXPECT(v.ok() && *v == 0, v.status().to_string());
    uint64_t version = *v;
    const cudaHostFn_t hold = [](void*) { std::this_thread::sleep_for(50ms); };
    for (const bool async : {false, true}) {
      const std::string call = async ? "push_async/pull_async" : "push/pull";
      const std::vector<float> before = download(weights, n);
      for (uint64_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 7) - 3.0f + (async ? 0.5f : 0.0f);
      CK(cudaMemsetAsync(grad, 0, n * 4, stream));
      CK(cudaLaunchHostFunc(stream, hold, nullptr));
      CK(cudaMemcpyAsync(grad, host, n * 4, cudaMemcpyHostToDevice, stream));
      Result<uint64_t> pushed = Status{ErrorCode::kInvalidArgument, "not pushed"};
      if (async) {
        auto t = w->push_async(kAllTensors, *g, 0, n * 4, Dtype::kF32, version, stream);
        EXPECT(t.ok(), call + ": " + t.status().to_string());
        pushed = w->wait(*t);
      } else {
        pushed = w->push(kAllTensors, *g, 0, n * 4, Dtype::kF32, version, stream);
      }
      EXPECT(pushed.ok() && *pushed == version + 1, call + ": " + pushed.status().to_string());
      version = *pushed;
      CK(cudaLaunchHostFunc(stream, hold, nullptr));
      CK(cudaMemcpyAsync(snapshot, weights, n * 4, cudaMemcpyDeviceToHost, stream));
      Result<uint64_t> pulled = Status{ErrorCode::kInvalidArgument, "not pulled"};
      if (async) {
        auto t = w->pull_async(kAllTensors, *wb, 0, stream);
        EXPECT(t.ok(), call + ": " + t.status().to_string());
        pulled = w->wait(*t);
      } else {
        pulled = w->pull(kAllTensors, *wb, 0, stream);
      }
      EXPECT(pulled.ok() && *pulled == version, call + ": " + pulled.status().to_string());
      CK(cudaStreamSynchronize(stream));
      const std::vector<float> after = download(weights, n);
      for (uint64_t i = 0; i < n; ++i) {
        EXPECT(snapshot[i] == before[i],
               call + ": the copy out read the pull's weights at element " + std::to_string(i));
        EXPECT(std::fabs(after[i] - (before[i] - 0.5f * host[i])) <= 1e-6f,
               call + ": the push applied an unfinished gradient at element " + std::to_string(i));
      }
    }
    return 0;
  });
}

// Seed test 2 on device memory: a push more than max_staleness behind is
// rejected, both numbers named, nothing applied.
BOOST_AUTO_TEST_CASE(seed_stale_push_is_rejected_and_nothing_applied_on_the_device) {
  test::ServerProcess server(test::unique_name("gseed2"),
                             cuda_args({"--tensor", "w:4x2", "--tensor", "b:8", "--max-staleness", "1"}));
  in_child([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect");
    const uint64_t n = w->total_elements();
    float *grad = nullptr, *weights = nullptr;
    CK(cudaMalloc(&grad, n * 4));
    CK(cudaMalloc(&weights, n * 4));
    const std::vector<float> ones(n, 1.0f);
    CK(cudaMemcpy(grad, ones.data(), n * 4, cudaMemcpyHostToDevice));
    auto g = w->register_device_buffer(grad, n * 4);
    auto wb = w->register_device_buffer(weights, n * 4);
    EXPECT(g.ok() && wb.ok(), "register");
    EXPECT(w->push(kAllTensors, *g, 0, n * 4, Dtype::kF32, 0).ok(), "push 1");
    EXPECT(w->push(kAllTensors, *g, 0, n * 4, Dtype::kF32, 0).ok(), "push 2");
    EXPECT(w->pull(kAllTensors, *wb, 0).ok(), "pull");
    const std::vector<float> before = download(weights, n);
    auto stale = w->push(kAllTensors, *g, 0, n * 4, Dtype::kF32, 0);
    EXPECT(stale.status().code() == ErrorCode::kStale, stale.status().to_string());
    EXPECT(stale.status().message().find("staleness 2 > max_staleness 1") != std::string::npos,
           stale.status().message());
    auto v = w->pull(kAllTensors, *wb, 0);
    EXPECT(v.ok() && *v == 2, v.status().to_string());
    EXPECT(download(weights, n) == before, "weights changed");
    return 0;
  });
}

// Two gradients inside one cudaMalloc, at offsets that are not 16-byte
// aligned, with NaN poison before, between and after: both pushes pass the
// non-finite check and apply exactly their own range.
BOOST_AUTO_TEST_CASE(two_gradients_at_offsets_of_one_allocation_read_only_their_ranges) {
  test::ServerProcess server(test::unique_name("goffs"), cuda_args({"--tensor", "w:1000", "--max-staleness", "100"}));
  in_child([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect");
    const uint64_t n = w->total_elements(), bytes = n * 4, gap = 4100;
    unsigned char* block = nullptr;
    CK(cudaMalloc(&block, gap + bytes + gap + bytes + gap));
    CK(cudaMemset(block, 0xFF, gap + bytes + gap + bytes + gap));  // 0xFFFFFFFF: NaN
    float* a = reinterpret_cast<float*>(block + gap);
    float* b = reinterpret_cast<float*>(block + gap + bytes + gap);
    const std::vector<float> ga(n, 1.0f), gb(n, 2.0f);
    CK(cudaMemcpy(a, ga.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, gb.data(), bytes, cudaMemcpyHostToDevice));
    float* weights = nullptr;
    CK(cudaMalloc(&weights, bytes));
    auto ia = w->register_device_buffer(a, bytes);
    auto ib = w->register_device_buffer(b, bytes);
    auto iw = w->register_device_buffer(weights, bytes);
    EXPECT(ia.ok() && ib.ok() && iw.ok(), "register");
    EXPECT(w->pull(kAllTensors, *iw, 0).ok(), "pull");
    const std::vector<float> before = download(weights, n);
    auto pa = w->push(kAllTensors, *ia, 0, bytes, Dtype::kF32, 0);
    EXPECT(pa.ok(), pa.status().to_string());
    auto pb = w->push(kAllTensors, *ib, 0, bytes, Dtype::kF32, 1);
    EXPECT(pb.ok(), pb.status().to_string());
    EXPECT(w->pull(kAllTensors, *iw, 0).ok(), "pull");
    const std::vector<float> after = download(weights, n);
    for (uint64_t i = 0; i < n; ++i)
      EXPECT(std::isfinite(after[i]) && std::fabs(after[i] - (before[i] - 0.5f - 1.0f)) <= 1e-5f,
             "element " + std::to_string(i));
    return 0;
  });
}

// One registration, 100 pushes: one IPC open, no open per push.
BOOST_AUTO_TEST_CASE(one_buffer_pushed_100_times_is_opened_once) {
  test::ServerProcess server(test::unique_name("g100"), cuda_args({"--tensor", "w:4096", "--max-staleness", "1000"}));
  in_child([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect");
    const uint64_t bytes = w->total_elements() * 4;
    float* grad = nullptr;
    CK(cudaMalloc(&grad, bytes));
    CK(cudaMemset(grad, 0, bytes));
    auto id = w->register_device_buffer(grad, bytes);
    EXPECT(id.ok(), id.status().to_string());
    cudaStream_t stream = nullptr;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (uint64_t v = 0; v < 100; ++v) {
      CK(cudaMemsetAsync(grad, 0, bytes, stream));  // "computes" the gradient on its own stream
      auto p = w->push(kAllTensors, *id, 0, bytes, Dtype::kF32, v, stream);
      EXPECT(p.ok() && *p == v + 1, p.status().to_string());
    }
    EXPECT(stat_of(server.name(), &shm::StatsBlock::mappings_opened) == 1, "mappings_opened");
    EXPECT(stat_of(server.name(), &shm::StatsBlock::mappings_closed) == 0, "mappings_closed");
    EXPECT(stat_of(server.name(), &shm::StatsBlock::ipc_handles_opened) == 1, "ipc_handles_opened");
    EXPECT(stat_of(server.name(), &shm::StatsBlock::ipc_handles_closed) == 0, "ipc_handles_closed");
    EXPECT(w->unregister_buffer(*id).ok(), "unregister");
    EXPECT(stat_of(server.name(), &shm::StatsBlock::mappings_closed) == 1, "mappings_closed after unregister");
    EXPECT(stat_of(server.name(), &shm::StatsBlock::ipc_handles_closed) == 1, "ipc_handles_closed after unregister");
    return 0;
  });
}

// 1,000 cycles of cudaMalloc / register / push / unregister / cudaFree:
// every open is closed, and the device's free memory comes back (a
// mapping the server kept would pin its allocation after cudaFree).
BOOST_AUTO_TEST_CASE(register_push_unregister_1000_times_closes_every_mapping_and_returns_memory) {
  test::ServerProcess server(test::unique_name("g1000"),
                             cuda_args({"--tensor", "w:1024", "--max-staleness", "100000"}));
  in_child(
      [&] {
        auto w = connect(server.name());
        EXPECT(w != nullptr, "connect");
        const uint64_t bytes = w->total_elements() * 4;
        const size_t block = 2u << 20;  // 2 MiB each: 2 GiB would leak if nothing were closed
        size_t free_before = 0, free_after = 0, total = 0;
        uint64_t version = 0;
        for (int i = 0; i <= 1000; ++i) {
          if (i == 1) CK(cudaMemGetInfo(&free_before, &total));  // after one warm-up cycle
          void* p = nullptr;
          CK(cudaMalloc(&p, block));
          CK(cudaMemset(p, 0, bytes));
          auto id = w->register_device_buffer(p, bytes);
          EXPECT(id.ok(), "cycle " + std::to_string(i) + ": " + id.status().to_string());
          auto pushed = w->push(kAllTensors, *id, 0, bytes, Dtype::kF32, version);
          EXPECT(pushed.ok(), "cycle " + std::to_string(i) + ": " + pushed.status().to_string());
          version = *pushed;
          EXPECT(w->unregister_buffer(*id).ok(), "unregister");
          CK(cudaFree(p));
        }
        CK(cudaMemGetInfo(&free_after, &total));
        EXPECT(free_after + (64u << 20) >= free_before,
               "free device memory " + std::to_string(free_before) + " -> " + std::to_string(free_after));
        const uint64_t opened = stat_of(server.name(), &shm::StatsBlock::mappings_opened);
        const uint64_t closed = stat_of(server.name(), &shm::StatsBlock::mappings_closed);
        EXPECT(opened == 1001 && closed == 1001,
               "mappings: " + std::to_string(opened) + " opened, " + std::to_string(closed) + " closed");
        const uint64_t ipc_opened = stat_of(server.name(), &shm::StatsBlock::ipc_handles_opened);
        const uint64_t ipc_closed = stat_of(server.name(), &shm::StatsBlock::ipc_handles_closed);
        EXPECT(ipc_opened == 1001 && ipc_closed == 1001,
               "IPC handles: " + std::to_string(ipc_opened) + " opened, " + std::to_string(ipc_closed) + " closed");
        return 0;
      },
      280s);
}

// A worker SIGKILLed while its pushes are in flight: the server survives,
// closes the dead worker's mapping once its kernels are done, and serves
// another worker.
BOOST_AUTO_TEST_CASE(a_worker_killed_with_a_push_in_flight_leaves_the_server_serving) {
  test::ServerProcess server(test::unique_name("gkill"),
                             cuda_args({"--tensor", "w:67108864", "--max-staleness", "1000000", "--allow-nonfinite"}));
  Shared* s = shared_page();
  s->counter = 0;
  auto victim = test::Process::fork_fn([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect");
    const uint64_t bytes = w->total_elements() * 4;  // 256 MiB: each apply takes a while
    void* grad = nullptr;
    CK(cudaMalloc(&grad, bytes));
    CK(cudaMemset(grad, 0, bytes));
    auto id = w->register_device_buffer(grad, bytes);
    EXPECT(id.ok(), id.status().to_string());
    while (true) {  // killed by the test
      auto t = w->push_async(kAllTensors, *id, 0, bytes, Dtype::kF32, 0);
      EXPECT(t.ok() || t.status().code() == ErrorCode::kBusy, t.status().to_string());
      s->counter.fetch_add(1);
    }
  });
  BOOST_REQUIRE(test::eventually([&] { return s->counter.load() >= 20; }, 60s));
  victim.kill_and_reap();
  in_child([&] {
    auto w = connect(server.name());
    EXPECT(w != nullptr, "connect after the kill");
    const uint64_t bytes = w->total_elements() * 4;
    void* grad = nullptr;
    CK(cudaMalloc(&grad, bytes));
    CK(cudaMemset(grad, 0, bytes));
    auto id = w->register_device_buffer(grad, bytes);
    EXPECT(id.ok(), id.status().to_string());
    for (int i = 0; i < 5; ++i) {
      auto p = w->push(kAllTensors, *id, 0, bytes, Dtype::kF32, 0);
      EXPECT(p.ok(), p.status().to_string());
    }
    return 0;
  });
  BOOST_TEST(server.process().wait(1ms) == -1);  // still running
  BOOST_TEST(test::eventually(
      [&] {
        return stat_of(server.name(), &shm::StatsBlock::mappings_opened) ==
                   stat_of(server.name(), &shm::StatsBlock::mappings_closed) &&
               stat_of(server.name(), &shm::StatsBlock::ipc_handles_opened) ==
                   stat_of(server.name(), &shm::StatsBlock::ipc_handles_closed);
      },
      30s));
  BOOST_TEST(stat_of(server.name(), &shm::StatsBlock::ipc_handles_opened) >= 2u);  // the victim's and the survivor's
  BOOST_TEST(stat_of(server.name(), &shm::StatsBlock::workers_died) >= 1u);
}

BOOST_AUTO_TEST_SUITE_END()
