// shmps-gpu-bench: the CUDA backend's numbers on one GPU (docs/cuda.md,
// "GPU benchmarks"). Prints one table:
//   - apply throughput per optimizer (SGD 12 B/param, SGD+momentum 20,
//     Adam 28) as a fraction of the device-to-device copy bandwidth
//     measured in the same run (goal >= 80%);
//   - cudaIpcOpenMemHandle + close cost per allocation size (2 MiB .. 8 GiB;
//     the exporting process is a child forked before CUDA starts here);
//   - push round trip of a 4 KB gradient from device memory (Worker::push,
//     blocking, on the caller's stream), p50/p99, against a shmps-server
//     --backend cuda;
//   - pushes/s of 8 worker processes on one GPU (this program re-executed),
//     all counting over one window of CLOCK_MONOTONIC given to every one
//     after all are set up;
//   - a 64 MiB gradient three ways: shmps push+apply by IPC handle, the same
//     work in one process (check + apply on a stream), and the staged path a
//     user would otherwise build (device to pinned host, a Unix socket to a
//     receiving process, host to device, check + apply there).
// Medians over repeats. --quick: fewer sizes, repeats and seconds.
// Without a device: prints "no CUDA device: skipped (...)" and exits 0.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/kernels/optimizer_cuda.hpp"
#include "shmps/worker.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// The exporter and receiver children: a failure kills and reaps them, so
// none is left holding a CUDA context.
std::vector<pid_t> g_children;

// Waits for a child that was told to end, and forgets it.
void reap(pid_t pid) {
  ::waitpid(pid, nullptr, 0);
  std::erase(g_children, pid);
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "shmps-gpu-bench: %s\n", what.c_str());
  for (pid_t pid : g_children) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  std::exit(1);
}

#define CK(expr)                                                                                                  \
  do {                                                                                                            \
    const cudaError_t e_ = (expr);                                                                                \
    if (e_ != cudaSuccess)                                                                                        \
      die(std::string(#expr) + ": " + cudaGetErrorName(e_) + " at " + __FILE__ + ":" + std::to_string(__LINE__)); \
  } while (0)

using shmps::bench::beside_this_program;
using shmps::bench::median;
using shmps::bench::now_ns;
using shmps::bench::percentile;
using shmps::bench::read_full;
using shmps::bench::write_full;

// Whether a device exists, asked in a child so this process has not
// started CUDA yet (children forked later must be able to use it).
bool probe_device(std::string* reason) {
  int fds[2];
  if (::pipe(fds) != 0) die("pipe");
  const pid_t pid = ::fork();
  if (pid == 0) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    const std::string why = e != cudaSuccess ? cudaGetErrorName(e) : count == 0 ? "0 devices" : "";
    (void)!::write(fds[1], why.data(), why.size());
    ::_exit(e == cudaSuccess && count > 0 ? 0 : 1);
  }
  ::close(fds[1]);
  char buf[256] = {};
  (void)!::read(fds[0], buf, sizeof buf - 1);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  *reason = buf;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// ---------------------------------------------------------------- IPC open cost
// A child that allocates what the parent asks for and sends the IPC handle:
// requests are sizes (uint64; 0 ends it), answers the 64 handle bytes, then
// it waits for one byte before freeing.
struct Exporter {
  pid_t pid = -1;
  int to_child = -1, from_child = -1;
};
Exporter start_exporter() {
  int down[2], up[2];
  // Close-on-exec: the servers and workers this program starts must not
  // hold the children's ends open.
  if (::pipe2(down, O_CLOEXEC) != 0 || ::pipe2(up, O_CLOEXEC) != 0) die("pipe");
  Exporter ex;
  ex.pid = ::fork();
  if (ex.pid < 0) die("fork");
  if (ex.pid > 0) g_children.push_back(ex.pid);
  if (ex.pid == 0) {
    ::close(down[1]);
    ::close(up[0]);
    uint64_t size = 0;
    while (::read(down[0], &size, sizeof size) == sizeof size && size != 0) {
      void* p = nullptr;
      cudaIpcMemHandle_t h{};
      if (cudaMalloc(&p, size) != cudaSuccess || cudaIpcGetMemHandle(&h, p) != cudaSuccess)
        std::memset(&h, 0, sizeof h);
      (void)!::write(up[1], &h, sizeof h);
      char ack = 0;
      (void)!::read(down[0], &ack, 1);
      if (p != nullptr) (void)cudaFree(p);
    }
    ::_exit(0);
  }
  ::close(down[0]);
  ::close(up[1]);
  ex.to_child = down[1];
  ex.from_child = up[0];
  return ex;
}

// Median microseconds of open + close of one allocation of `size` bytes.
double ipc_open_us(Exporter& ex, uint64_t size, int repeats, double* open_only_us) {
  if (::write(ex.to_child, &size, sizeof size) != sizeof size) die("exporter gone");
  cudaIpcMemHandle_t h{};
  if (::read(ex.from_child, &h, sizeof h) != sizeof h) die("exporter gone");
  static const cudaIpcMemHandle_t zero{};
  std::vector<double> total, open;
  if (std::memcmp(&h, &zero, sizeof h) != 0) {
    for (int r = 0; r < repeats; ++r) {
      void* p = nullptr;
      const auto t0 = Clock::now();
      CK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
      const auto t1 = Clock::now();
      CK(cudaIpcCloseMemHandle(p));
      const auto t2 = Clock::now();
      open.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      total.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
    }
  }
  const char ack = 1;
  (void)!::write(ex.to_child, &ack, 1);
  *open_only_us = open.empty() ? -1 : median(open);
  return total.empty() ? -1 : median(total);
}

// ---------------------------------------------------------------- staged path
// The path without shmps: the worker copies its gradient to pinned host
// memory and writes it to a Unix socket; the receiving process (a child
// forked before CUDA starts here) reads it into pinned memory, copies it to
// the device, checks it for NaN/Inf and applies SGD, then answers one byte.
// Each message is a uint64 byte count (0 ends it) and the bytes.
struct Receiver {
  pid_t pid = -1;
  int fd = -1;
};

[[noreturn]] void receive_staged(int fd) {
  uint64_t size = 0;
  void* host = nullptr;
  float *grad = nullptr, *weights = nullptr;
  int* flag = nullptr;
  uint64_t capacity = 0, step = 0;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) ::_exit(1);
  while (read_full(fd, &size, sizeof size) && size != 0) {
    if (size > capacity) {
      (void)cudaFreeHost(host);
      (void)cudaFree(grad);
      (void)cudaFree(weights);
      if (cudaMallocHost(&host, size) != cudaSuccess || cudaMalloc(&grad, size) != cudaSuccess ||
          cudaMalloc(&weights, size) != cudaSuccess ||
          (flag == nullptr && cudaMalloc(&flag, sizeof(int)) != cudaSuccess))
        ::_exit(1);
      (void)cudaMemset(weights, 0, size);
      capacity = size;
    }
    if (!read_full(fd, host, size)) break;
    shmps::kernels::TensorState ts;
    ts.weights = weights;
    ts.n = size / 4;
    bool finite = false;
    if (cudaMemcpyAsync(grad, host, size, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
        !shmps::kernels::all_finite_cuda(grad, shmps::kernels::GradDtype::kF32, ts.n, flag, stream, &finite).ok() ||
        !shmps::kernels::apply_cuda({}, ts, grad, shmps::kernels::GradDtype::kF32, ++step, stream).ok() ||
        cudaStreamSynchronize(stream) != cudaSuccess)
      ::_exit(1);
    const char ack = finite ? 1 : 2;
    if (!write_full(fd, &ack, 1)) break;
  }
  ::_exit(0);
}

// Forked after the exporter, whose parent-side ends it closes (the exporter
// sees its end of file when this process is gone).
Receiver start_receiver(const Exporter& exporter) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) die("socketpair");
  Receiver r;
  r.pid = ::fork();
  if (r.pid < 0) die("fork");
  if (r.pid > 0) g_children.push_back(r.pid);
  if (r.pid == 0) {
    ::close(exporter.to_child);
    ::close(exporter.from_child);
    ::close(fds[0]);
    receive_staged(fds[1]);
  }
  ::close(fds[1]);
  r.fd = fds[0];
  return r;
}

// Median milliseconds of one staged round trip of `bytes` from device memory.
double staged_ms(Receiver& r, uint64_t bytes, int repeats) {
  void* grad = nullptr;
  void* host = nullptr;
  CK(cudaMalloc(&grad, bytes));
  CK(cudaMemset(grad, 0, bytes));
  CK(cudaMallocHost(&host, bytes));
  std::vector<double> ms;
  for (int i = 0; i <= repeats; ++i) {  // the first is a warm-up
    const auto t0 = Clock::now();
    CK(cudaMemcpy(host, grad, bytes, cudaMemcpyDeviceToHost));
    char ack = 0;
    if (!write_full(r.fd, &bytes, sizeof bytes) || !write_full(r.fd, host, bytes) || !read_full(r.fd, &ack, 1) ||
        ack != 1)
      die("the staged receiver failed");
    if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  CK(cudaFreeHost(host));
  CK(cudaFree(grad));
  return median(ms);
}

// ---------------------------------------------------------------- server
// A --backend cuda server for `elements` fp32 weights; dies with its error.
std::unique_ptr<shmps::ServerProcess> start_server(const std::string& tag, uint64_t elements) {
  auto s = shmps::bench::start_server_process(
      shmps::server_binary(), "gpubench_" + tag + "_" + std::to_string(::getpid()),
      {"--tensor", "w:" + std::to_string(elements), "--backend", "cuda", "--max-staleness", "1000000000",
       "--max-workers", "16", "--log-level", "warn"},
      "");
  if (!s.ok()) die("shmps-server --backend cuda: " + s.status().to_string());
  return std::move(s).value();
}

// A worker of server `name` that pushes the server's whole model (4 KB or
// 64 MiB here) from device memory with Worker::push on a stream of its own.
class DevicePusher {
 public:
  explicit DevicePusher(const std::string& name) {
    shmps::WorkerOptions o;
    o.name = name;
    auto w = shmps::Worker::connect(o);
    if (!w.ok()) die("connect: " + w.status().to_string());
    worker_ = std::move(w).value();
    bytes_ = worker_->total_elements() * 4;
    CK(cudaMalloc(&grad_, bytes_));
    CK(cudaMemset(grad_, 0, bytes_));
    CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    auto id = worker_->register_device_buffer(grad_, bytes_);
    if (!id.ok()) die("register_device_buffer: " + id.status().to_string());
    id_ = *id;
  }
  ~DevicePusher() {
    (void)worker_->unregister_buffer(id_);
    (void)cudaStreamDestroy(stream_);
    (void)cudaFree(grad_);
  }
  DevicePusher(const DevicePusher&) = delete;
  DevicePusher& operator=(const DevicePusher&) = delete;
  // One blocking push of the whole model; dies with the error.
  void push() {
    auto v = worker_->push(shmps::kAllTensors, id_, 0, bytes_, shmps::Dtype::kF32, version_, stream_);
    if (!v.ok()) die("push: " + v.status().to_string());
    version_ = *v;
  }

 private:
  std::unique_ptr<shmps::Worker> worker_;
  uint64_t bytes_ = 0;
  void* grad_ = nullptr;
  cudaStream_t stream_ = nullptr;
  uint32_t id_ = 0;
  uint64_t version_ = 0;
};

// Pushes for `seconds` as one DevicePusher; returns pushes/s (p50/p99 of
// the round trip in *lat_us when given).
double push_loop(const std::string& name, double seconds, std::vector<double>* lat_us) {
  DevicePusher pusher(name);
  uint64_t n = 0;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    const auto t0 = Clock::now();
    pusher.push();
    if (lat_us) lat_us->push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    ++n;
  }
  return static_cast<double>(n) / std::chrono::duration<double>(Clock::now() - start).count();
}

// One of the 8 push workers (--push-worker NAME GO_FD): sets up, pushes
// once (the server opens the IPC handle), prints "ready", then reads the
// window [start, end) (two uint64 of CLOCK_MONOTONIC ns) from GO_FD, which
// the parent writes once every worker is ready; prints the pushes that
// completed within the window. The same window for all: their counts add
// up to the server's rate over it.
int push_worker(const std::string& name, int go_fd) {
  DevicePusher pusher(name);
  pusher.push();
  std::printf("ready\n");
  std::fflush(stdout);
  uint64_t window[2] = {};
  if (!read_full(go_fd, window, sizeof window)) die("push worker: no window from the parent");
  ::close(go_fd);
  if (now_ns() >= window[0]) die("push worker: the window had begun before it was received");
  const timespec start{static_cast<time_t>(window[0] / 1'000'000'000), static_cast<long>(window[0] % 1'000'000'000)};
  while (::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &start, nullptr) == EINTR) {
  }
  uint64_t n = 0;
  while (now_ns() < window[1]) {
    pusher.push();
    if (now_ns() <= window[1]) ++n;
  }
  std::printf("%llu\n", static_cast<unsigned long long>(n));
  return 0;
}

// ---------------------------------------------------------------- device bandwidth
double time_ms(cudaStream_t stream, int repeats, const std::function<void()>& work) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> ms;
  work();  // warm-up
  for (int r = 0; r < repeats; ++r) {
    CK(cudaEventRecord(a, stream));
    work();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--push-worker" && i + 2 < argc) {
      // Internal: one of the 8 worker processes (push_worker()).
      return push_worker(argv[i + 1], std::atoi(argv[i + 2]));
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: shmps-gpu-bench [--quick | --version]\n  the CUDA backend's apply throughput, IPC open cost, push "
          "round trip, 8-worker pushes/s and a 64 MiB push against the staged path on the first visible GPU "
          "(docs/cuda.md)\n");
      return 0;
    } else if (a == "--version") {
      std::printf("shmps-gpu-bench %s\n", SHMPS_VERSION);
      return 0;
    } else {
      die("unknown argument '" + a + "' (try --help)");
    }
  }
  std::string reason;
  if (!probe_device(&reason)) {
    std::printf("no CUDA device: skipped (%s)\n", reason.c_str());
    return 0;
  }
  // A child that died makes a write fail (reported) rather than kill us.
  // Inherited by the servers and workers started here, which write to no
  // pipe a reader may leave.
  std::signal(SIGPIPE, SIG_IGN);
  Exporter exporter = start_exporter();  // both before CUDA starts in this process
  Receiver receiver = start_receiver(exporter);

  const int repeats = quick ? 5 : 20;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaSetDevice(0));
  std::printf("shmps-gpu-bench%s on %s (sm_%d%d, %.1f GiB)\n", quick ? " --quick" : "", prop.name, prop.major,
              prop.minor, static_cast<double>(prop.totalGlobalMem) / (1ull << 30));
  cudaStream_t stream = nullptr;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // D2D copy bandwidth (bytes read + written per second) and the applies.
  const uint64_t n = quick ? (64ull << 20) : (256ull << 20);  // parameters: 256 MiB / 1 GiB of fp32
  const uint64_t bytes = n * 4;
  float *src = nullptr, *dst = nullptr, *grad = nullptr, *state[3] = {};
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMalloc(&grad, bytes));
  for (auto& s : state) CK(cudaMalloc(&s, bytes));
  CK(cudaMemset(src, 0, bytes));
  CK(cudaMemset(grad, 0, bytes));
  for (auto& s : state) CK(cudaMemset(s, 0, bytes));
  const double copy_ms =
      time_ms(stream, repeats, [&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); });
  const double copy_gbs = 2.0 * static_cast<double>(bytes) / (copy_ms * 1e6);
  std::printf("\n%-28s %12s %12s %10s\n", "apply (fp32 gradient)", "GB/s", "% of D2D", "goal 80%");
  std::printf("%-28s %12.1f %12s %10s\n", "D2D copy (read + write)", copy_gbs, "100.0", "");
  struct Case {
    const char* name;
    shmps::kernels::OptimizerConfig config;
    double bytes_per_param;
  };
  std::vector<Case> cases(3);
  cases[0] = {"SGD (12 B/param)", {}, 12};
  cases[1] = {"SGD+momentum (20 B/param)", {}, 20};
  cases[1].config.momentum = 0.9f;
  cases[2] = {"Adam (28 B/param)", {}, 28};
  cases[2].config.kind = shmps::kernels::OptimizerKind::kAdam;
  bool goal_met = true;
  for (const Case& c : cases) {
    shmps::kernels::TensorState ts;
    ts.weights = dst;
    for (int i = 0; i < 3; ++i) ts.state[i] = state[i];
    ts.n = n;
    uint64_t step = 1;
    const double ms = time_ms(stream, repeats, [&] {
      const std::string e =
          shmps::kernels::apply_cuda(c.config, ts, grad, shmps::kernels::GradDtype::kF32, step++, stream).message();
      if (!e.empty()) die(e);
    });
    const double gbs = c.bytes_per_param * static_cast<double>(n) / (ms * 1e6);
    const double pct = 100.0 * gbs / copy_gbs;
    goal_met &= pct >= 80.0;
    std::printf("%-28s %12.1f %12.1f %10s\n", c.name, gbs, pct, pct >= 80.0 ? "met" : "MISSED");
  }
  CK(cudaFree(src));
  CK(cudaFree(dst));
  CK(cudaFree(grad));
  for (auto& s : state) CK(cudaFree(s));

  // IPC open cost per allocation size.
  std::printf("\n%-28s %12s %16s\n", "cudaIpcOpenMemHandle", "open (us)", "open+close (us)");
  std::vector<uint64_t> sizes =
      quick ? std::vector<uint64_t>{2ull << 20, 64ull << 20, 1ull << 30}
            : std::vector<uint64_t>{2ull << 20, 16ull << 20, 128ull << 20, 1ull << 30, 8ull << 30};
  for (uint64_t size : sizes) {
    double open_us = 0;
    const double total_us = ipc_open_us(exporter, size, quick ? 3 : 7, &open_us);
    const std::string label =
        size >= (1ull << 30) ? std::to_string(size >> 30) + " GiB" : std::to_string(size >> 20) + " MiB";
    if (total_us < 0)
      std::printf("%-28s %12s %16s\n", label.c_str(), "(no alloc)", "");
    else
      std::printf("%-28s %12.1f %16.1f\n", label.c_str(), open_us, total_us);
  }
  const uint64_t end_marker = 0;
  (void)!::write(exporter.to_child, &end_marker, sizeof end_marker);
  reap(exporter.pid);

  // Push round trip of a 4 KB gradient (1024 fp32), one worker.
  const auto server = start_server("rt", 1024);
  std::vector<double> lat;
  (void)push_loop(server->name(), quick ? 1.0 : 3.0, &lat);
  std::printf("\n%-28s %12s %12s %10s\n", "push round trip, 4 KB", "p50 (us)", "p99 (us)", "pushes");
  std::printf("%-28s %12.1f %12.1f %10zu\n", "device buffer, blocking push", percentile(lat, 0.5),
              percentile(lat, 0.99), lat.size());

  // 8 worker processes (this program with --push-worker), one GPU, one
  // window: each reads its start and end from the go pipe (its read end
  // inherited, the write end close-on-exec) once all 8 said "ready".
  const int workers = 8;
  const double seconds = quick ? 2.0 : 5.0;
  int go[2];
  if (::pipe(go) != 0 || ::fcntl(go[1], F_SETFD, FD_CLOEXEC) != 0) die("pipe");
  std::vector<FILE*> pipes;
  for (int i = 0; i < workers; ++i) {
    const std::string cmd = "'" + beside_this_program("shmps-gpu-bench") + "' --push-worker " + server->name() + " " +
                            std::to_string(go[0]);
    FILE* f = ::popen(cmd.c_str(), "r");
    if (f == nullptr) die("popen");
    pipes.push_back(f);
  }
  ::close(go[0]);
  int ready = 0;
  for (FILE* f : pipes) {
    char line[16] = {};
    if (std::fgets(line, sizeof line, f) != nullptr && std::string(line) == "ready\n") ++ready;
  }
  if (ready == workers) {
    // 250 ms for the last worker to read it; then every count covers the same window.
    const uint64_t start = now_ns() + 250'000'000, end = start + static_cast<uint64_t>(seconds * 1e9);
    for (int i = 0; i < workers; ++i) {
      const uint64_t window[2] = {start, end};
      if (!write_full(go[1], window, sizeof window)) break;
    }
  }
  ::close(go[1]);  // a worker still waiting reads end of file and fails
  uint64_t total = 0;
  int failed = 0;
  for (FILE* f : pipes) {
    unsigned long long count = 0;
    const bool read = std::fscanf(f, "%llu", &count) == 1;
    const int status = ::pclose(f);
    if (read && WIFEXITED(status) && WEXITSTATUS(status) == 0)
      total += count;
    else
      ++failed;
  }
  if (failed > 0 || ready != workers)
    die(std::to_string(std::max(failed, workers - ready)) + " of the " + std::to_string(workers) +
        " push workers failed");
  std::printf("%-28s %12.0f pushes/s (%d processes, 4 KB each, over one %.0f s window)\n", "8 workers, one GPU",
              static_cast<double>(total) / seconds, workers, seconds);
  server->stop();

  // A 64 MiB gradient: shmps push+apply, the same work in one process,
  // and the staged path. The server applies SGD (its default) after the
  // NaN/Inf check; so do the other two.
  const uint64_t big = 64ull << 20;
  double same_work_ms = 0;
  {
    float *w = nullptr, *g = nullptr;
    int* flag = nullptr;
    CK(cudaMalloc(&w, big));
    CK(cudaMalloc(&g, big));
    CK(cudaMalloc(&flag, sizeof(int)));
    CK(cudaMemset(w, 0, big));
    CK(cudaMemset(g, 0, big));
    shmps::kernels::TensorState ts;
    ts.weights = w;
    ts.n = big / 4;
    uint64_t step = 1;
    std::vector<double> ms;
    for (int i = 0; i <= repeats; ++i) {
      const auto t0 = Clock::now();
      bool finite = false;
      if (!shmps::kernels::all_finite_cuda(g, shmps::kernels::GradDtype::kF32, ts.n, flag, stream, &finite).ok() ||
          !shmps::kernels::apply_cuda({}, ts, g, shmps::kernels::GradDtype::kF32, step++, stream).ok())
        die("check + apply failed");
      CK(cudaStreamSynchronize(stream));
      if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    same_work_ms = median(ms);
    CK(cudaFree(w));
    CK(cudaFree(g));
    CK(cudaFree(flag));
  }
  const auto big_server = start_server("big", big / 4);
  std::vector<double> big_lat;
  (void)push_loop(big_server->name(), quick ? 0.5 : 2.0, &big_lat);
  big_server->stop();
  const double shmps_ms = median(big_lat) / 1000.0;
  const double staged = staged_ms(receiver, big, quick ? 5 : repeats);
  const uint64_t receiver_end = 0;
  (void)write_full(receiver.fd, &receiver_end, sizeof receiver_end);
  reap(receiver.pid);
  std::printf("\n%-40s %12s %14s\n", "64 MiB gradient, check + SGD apply", "median (ms)", "staged / this");
  std::printf("%-40s %12.3f %14.1f\n", "shmps push+apply (IPC handle)", shmps_ms, staged / shmps_ms);
  std::printf("%-40s %12.3f %14.1f\n", "same work in one process", same_work_ms, staged / same_work_ms);
  std::printf("%-40s %12.3f %14s\n", "staged: D2H, Unix socket, H2D", staged, "1.0");
  std::printf("staged path goal (>= 20x slower than shmps): %s\n", staged >= 20.0 * shmps_ms ? "met" : "MISSED");
  std::printf("\napply goal (>= 80%% of D2D): %s\n== shmps-gpu-bench done ==\n", goal_met ? "met" : "MISSED");
  return 0;
}
