// shmps-gpu-sync-probe: what ordering a server's device work after a
// worker process's stream costs, by mechanism (docs/cuda.md, "Ordering
// across processes: what it costs"). Two processes on GPU 0: a "worker"
// (forked before CUDA starts here) and this "server". Per iteration the
// worker enqueues one operation on its idle stream and says so through
// shared memory; the server, spinning on that word, times its own device
// work from then until a host poll sees it done. Medians of 1,500
// iterations after 50 of warm-up. Table 1: the server's tiny kernel after
// each kind of worker operation. Table 2: the ways the server can wait for
// the worker's stream. Without a device: "no CUDA device: skipped" and exit
// 0 (CTest gpu_sync_probe_smoke).
#include <cuda.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace {

// What the worker enqueues before it says "done" (Shared::seq).
enum class WorkerOp : int { kNone, kPlainEvent, kIpcEvent, kWriteValue, kExit };

struct Shared {
  std::atomic<uint64_t> seq{0}, ack{0};
  std::atomic<int> op{0};
  std::atomic<int> ready{0};  // 1: handles written; -1: the worker failed (error); -2: no device (error)
  cudaIpcEventHandle_t event{};
  cudaIpcMemHandle_t word{};
  char error[256] = {};
};

using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

WriteValueFn driver_fn(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<WriteValueFn>(p);
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "shmps-gpu-sync-probe: %s\n", what.c_str());
  std::exit(1);
}

#define CK(x)                                                                                      \
  do {                                                                                             \
    const cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess)                                                                         \
      die(std::string(#x) + ": " + cudaGetErrorName(e_) + " at line " + std::to_string(__LINE__)); \
  } while (0)

__global__ void tiny(float* p) {
  if (threadIdx.x == 0) p[0] += 1.0f;
}

[[noreturn]] void run_worker(Shared* sh) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never left spinning by a server that died
  const auto fail = [sh](const char* what, cudaError_t e, int code = -1) {
    std::snprintf(sh->error, sizeof sh->error, "%s: %s", what, cudaGetErrorName(e));
    sh->ready.store(code);
    _exit(1);
  };
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || (e == cudaSuccess && count == 0))
    fail("cudaGetDeviceCount", e == cudaSuccess ? cudaErrorNoDevice : e, -2);  // the only skip
  if (e != cudaSuccess) fail("cudaGetDeviceCount", e);
  if ((e = cudaSetDevice(0)) != cudaSuccess) fail("cudaSetDevice(0)", e);
  cudaStream_t s = nullptr;
  cudaEvent_t ipc = nullptr, plain = nullptr;
  uint32_t* word = nullptr;
  if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess) fail("cudaStreamCreate", e);
  if ((e = cudaEventCreateWithFlags(&ipc, cudaEventDisableTiming | cudaEventInterprocess)) != cudaSuccess)
    fail("cudaEventCreate(interprocess)", e);
  if ((e = cudaEventCreateWithFlags(&plain, cudaEventDisableTiming)) != cudaSuccess) fail("cudaEventCreate", e);
  if ((e = cudaIpcGetEventHandle(&sh->event, ipc)) != cudaSuccess) fail("cudaIpcGetEventHandle", e);
  if ((e = cudaMalloc(&word, 2 << 20)) != cudaSuccess) fail("cudaMalloc", e);
  if ((e = cudaMemset(word, 0, 2 << 20)) != cudaSuccess) fail("cudaMemset", e);
  if ((e = cudaIpcGetMemHandle(&sh->word, word)) != cudaSuccess) fail("cudaIpcGetMemHandle", e);
  const WriteValueFn write_value = driver_fn("cuStreamWriteValue32");
  if (write_value == nullptr) fail("cuStreamWriteValue32 entry point", cudaErrorNotSupported);
  sh->ready.store(1);
  for (uint64_t k = 0;;) {
    while (sh->ack.load() != k) {
    }
    const auto op = static_cast<WorkerOp>(sh->op.load());
    if (op == WorkerOp::kExit) break;
    ++k;
    switch (op) {
      case WorkerOp::kPlainEvent:
        if ((e = cudaEventRecord(plain, s)) != cudaSuccess) fail("cudaEventRecord(plain)", e);
        break;
      case WorkerOp::kIpcEvent:
        if ((e = cudaEventRecord(ipc, s)) != cudaSuccess) fail("cudaEventRecord(interprocess)", e);
        break;
      case WorkerOp::kWriteValue:
        if (write_value(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(word), static_cast<cuuint32_t>(k),
                        0) != CUDA_SUCCESS)
          fail("cuStreamWriteValue32", cudaErrorUnknown);
        break;
      default:
        break;
    }
    sh->seq.store(k);
  }
  _exit(0);
}

using Clock = std::chrono::steady_clock;

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    const std::string a = argv[1];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: shmps-gpu-sync-probe\n  what ordering device work after another process's stream costs on GPU 0, "
          "by mechanism (docs/cuda.md)\n");
      return 0;
    }
    die("unknown argument '" + a + "' (try --help)");
  }
  auto* sh =
      static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (sh == MAP_FAILED) die("mmap");
  new (sh) Shared();
  const pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) run_worker(sh);
  while (sh->ready.load() == 0) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) break;
  }
  if (sh->ready.load() == -2) {
    waitpid(pid, nullptr, 0);
    std::printf("no CUDA device: skipped (%s)\n", sh->error);
    return 0;
  }
  if (sh->ready.load() != 1) {
    waitpid(pid, nullptr, 0);
    die(std::string("the worker process failed: ") + (sh->error[0] ? sh->error : "it died"));
  }

  CK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("shmps-gpu-sync-probe on %s\n", prop.name);
  cudaStream_t s = nullptr, s2 = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t ipc = nullptr, fence = nullptr, local = nullptr;
  CK(cudaIpcOpenEventHandle(&ipc, sh->event));
  void* word = nullptr;
  CK(cudaIpcOpenMemHandle(&word, sh->word, cudaIpcMemLazyEnablePeerAccess));
  CK(cudaEventCreateWithFlags(&fence, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&local, cudaEventDisableTiming));
  float* p = nullptr;
  int* flag_dev = nullptr;
  int* flag_pinned = nullptr;
  CK(cudaMalloc(&p, 4096));
  CK(cudaMalloc(&flag_dev, sizeof(int)));
  CK(cudaMallocHost(&flag_pinned, sizeof(int)));
  using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  const auto wait_value = reinterpret_cast<WaitValueFn>(driver_fn("cuStreamWaitValue32"));
  if (wait_value == nullptr) die("cuStreamWaitValue32: driver entry point not found");

  const auto kernel_and_fence = [&] {
    tiny<<<1, 32, 0, s>>>(p);
    CK(cudaGetLastError());
    CK(cudaEventRecord(fence, s));
    cudaError_t q;
    while ((q = cudaEventQuery(fence)) == cudaErrorNotReady) {
    }
    CK(q);
  };
  uint64_t k = 0;
  // Median microseconds of `server` after the worker's `op`.
  const auto measure = [&](WorkerOp op, const auto& server) {
    constexpr int kWarmUp = 50, kRuns = 1500;
    std::vector<double> us;
    for (int i = 0; i < kWarmUp + kRuns; ++i) {
      sh->op.store(static_cast<int>(op));
      sh->ack.store(k);
      ++k;
      for (uint64_t polls = 1; sh->seq.load() != k; ++polls)
        if (sh->ready.load() != 1 || (polls % 65536 == 0 && waitpid(pid, nullptr, WNOHANG) == pid))
          die(std::string("the worker process failed: ") + (sh->error[0] ? sh->error : "it died"));
      const auto t0 = Clock::now();
      server(k);
      const auto t1 = Clock::now();
      if (i >= kWarmUp) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(us.begin(), us.end());
    return std::pair<double, double>{us[us.size() / 2], us[us.size() * 99 / 100]};
  };
  const auto row = [](const char* what, std::pair<double, double> m) {
    std::printf("%-62s %9.1f %9.1f\n", what, m.first, m.second);
    std::fflush(stdout);
  };

  std::printf("\n%-62s %9s %9s\n", "server: tiny kernel + fence, polled; the worker enqueued", "p50 (us)", "p99 (us)");
  row("nothing", measure(WorkerOp::kNone, [&](uint64_t) { kernel_and_fence(); }));
  row("a plain event record", measure(WorkerOp::kPlainEvent, [&](uint64_t) { kernel_and_fence(); }));
  row("cuStreamWriteValue32", measure(WorkerOp::kWriteValue, [&](uint64_t) { kernel_and_fence(); }));
  row("an interprocess event record", measure(WorkerOp::kIpcEvent, [&](uint64_t) { kernel_and_fence(); }));
  row("an interprocess event record; server synchronises the stream", measure(WorkerOp::kIpcEvent, [&](uint64_t) {
        tiny<<<1, 32, 0, s>>>(p);
        CK(cudaStreamSynchronize(s));
      }));

  std::printf("\n%-62s %9s %9s\n", "server waits for the worker's stream, then kernel + fence", "p50 (us)", "p99 (us)");
  row("cudaStreamWaitEvent(the worker's interprocess event)", measure(WorkerOp::kIpcEvent, [&](uint64_t) {
        CK(cudaStreamWaitEvent(s, ipc, 0));
        kernel_and_fence();
      }));
  row("cudaStreamWaitEvent(its own event), worker: a plain event", measure(WorkerOp::kPlainEvent, [&](uint64_t) {
        CK(cudaEventRecord(local, s2));
        CK(cudaStreamWaitEvent(s, local, 0));
        kernel_and_fence();
      }));
  row("cuStreamWaitValue32(the worker's word, >= seq)", measure(WorkerOp::kWriteValue, [&](uint64_t seq) {
        if (wait_value(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(word), static_cast<cuuint32_t>(seq),
                       CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
          die("cuStreamWaitValue32 failed");
        kernel_and_fence();
      }));
  row("host polls cudaEventQuery(the interprocess event) only", measure(WorkerOp::kIpcEvent, [&](uint64_t) {
        cudaError_t q;
        while ((q = cudaEventQuery(ipc)) == cudaErrorNotReady) {
        }
        CK(q);
      }));
  row("interprocess event wait + kernel + flag to pinned host + sync", measure(WorkerOp::kIpcEvent, [&](uint64_t) {
        CK(cudaStreamWaitEvent(s, ipc, 0));
        tiny<<<1, 32, 0, s>>>(p);
        CK(cudaMemcpyAsync(flag_pinned, flag_dev, sizeof(int), cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
      }));

  sh->op.store(static_cast<int>(WorkerOp::kExit));
  sh->ack.store(k);
  waitpid(pid, nullptr, 0);
  std::printf("== shmps-gpu-sync-probe done ==\n");
  return 0;
}
