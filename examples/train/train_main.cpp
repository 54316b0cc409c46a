// shmps-train: asynchronous data-parallel training of a 784-256-10 MLP on
// Fashion-MNIST through a shmps-server.
//
// The parent loads the data, writes a He initialisation to a temp file,
// starts shmps-server with it (or uses --connect), attaches as a worker of
// its own for evaluation, and forks N worker processes. Each worker pulls
// all weights, computes one minibatch gradient of its shard and pushes it
// with the version it pulled; the server applies it unless it is more than
// --max-staleness versions old (then the worker pulls and tries again).
// The parent evaluates every epoch of applied pushes and prints a curve.
//
// --in-process is the ceiling the server path is measured against: the
// same training loop (train_shard) with the same data order, batch and
// optimizer in this one process, each gradient applied at once with
// shmps::kernels::apply_cpu; no server, no shared memory.
//
// Exit status: 0 done, 1 a runtime failure (server, worker, mismatch of
// counts), 2 bad usage, missing dataset, or a --connect server whose
// weights are all zero.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <boost/program_options.hpp>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idx.hpp"
#include "mlp.hpp"
#include "shmps/cli.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/status.hpp"
#include "shmps/worker.hpp"

namespace po = boost::program_options;
using Clock = std::chrono::steady_clock;

namespace shmps::train {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr size_t kTrainLossSamples = 10000;  // fixed training subset the parent scores
constexpr size_t kEvalBatch = 1000;
// Weight snapshots an --eval-every run may keep for scoring after training
// (814 KB each for the default model).
constexpr uint64_t kMaxSnapshots = 500;

struct Options {
  size_t workers = 4;
  size_t epochs = 20;
  size_t batch = 64;
  std::string optimizer = "adam";
  double lr = 0.0;  // 0: the optimizer's default
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = -1.0;  // < 0: the server's default (0; AdamW 0.01)
  uint64_t max_staleness = 8;
  size_t train_limit = 0;
  size_t test_limit = 0;
  size_t evals_per_epoch = 1;
  uint64_t eval_every = 0;  // > 0: snapshot every N applied updates, score after training
  bool in_process = false;  // the ceiling: no server, apply_cpu in this process
  std::string data_dir = kDefaultFashionMnistDir;
  std::string csv;
  uint64_t seed = 1;
  std::string name;
  std::string server_bin;
  std::string connect;
  uint64_t checkpoint_every = 1000;  // own server: checkpoint so a restart resumes
};

double default_lr(const std::string& optimizer) { return optimizer == "sgd" ? 0.01 : 1e-3; }

// Parses argv; returns the exit code to leave with when there is nothing to
// run (help, usage error).
std::optional<int> parse_options(int argc, char** argv, Options& o) {
  po::options_description desc("shmps-train options");
  // clang-format off
  desc.add_options()
    ("help,h", "show this help")
    ("version", "print the version and exit")
    ("workers", po::value(&o.workers)->default_value(o.workers), "worker processes")
    ("epochs", po::value(&o.epochs)->default_value(o.epochs), "passes over the training set")
    ("batch", po::value(&o.batch)->default_value(o.batch), "minibatch size per push")
    ("optimizer", po::value(&o.optimizer)->default_value(o.optimizer), "adam, adamw or sgd")
    ("lr", po::value(&o.lr), "learning rate (default: adam/adamw 0.001, sgd 0.01)")
    ("momentum", po::value(&o.momentum)->default_value(o.momentum, "0.9"), "SGD momentum")
    ("nesterov", po::bool_switch(&o.nesterov), "SGD with Nesterov momentum")
    ("weight-decay", po::value(&o.weight_decay), "weight decay (default: the server's, 0 or AdamW 0.01)")
    ("max-staleness", po::value(&o.max_staleness)->default_value(o.max_staleness),
     "versions a push may lag behind the server before it is rejected")
    ("train-limit", po::value(&o.train_limit)->default_value(0), "use the first N training images (0: all)")
    ("test-limit", po::value(&o.test_limit)->default_value(0), "use the first N test images (0: all)")
    ("evals-per-epoch", po::value(&o.evals_per_epoch)->default_value(1), "evaluations per epoch")
    ("eval-every", po::value(&o.eval_every)->default_value(0),
     "evaluate every N applied updates instead: the weights are snapshotted during training and scored "
     "after it, so elapsed_s excludes evaluation (0: --evals-per-epoch)")
    ("in-process", po::bool_switch(&o.in_process),
     "the ceiling: one process applies each gradient with the CPU optimizer itself (no server, no shared "
     "memory); same model, data order, batch and optimizer as --workers 1")
    ("data-dir", po::value(&o.data_dir)->default_value(o.data_dir), "folder of the Fashion-MNIST IDX files")
    ("csv", po::value(&o.csv), "write the learning curve to this CSV file")
    ("seed", po::value(&o.seed)->default_value(o.seed), "seed of the initialisation and the shuffles")
    ("name", po::value(&o.name), "server segment name (default: train_<pid>)")
    ("server-bin", po::value(&o.server_bin), "shmps-server to start (default: beside shmps-train)")
    ("connect", po::value(&o.connect), "use the running server of this name instead of starting one")
    ("checkpoint-every", po::value(&o.checkpoint_every)->default_value(o.checkpoint_every),
     "own server: checkpoint every N updates; if the server dies it is restarted and resumes there (0: no restart)");
  // clang-format on
  po::variables_map vm;
  try {
    const po::parsed_options parsed = po::parse_command_line(argc, argv, desc);
    cli::refuse_negative_unsigned(parsed);
    po::store(parsed, vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "shmps-train: " << e.what() << "\n" << desc;
    return kExitUsage;
  }
  if (vm.count("help") != 0) {
    std::cout << desc;
    return 0;
  }
  if (vm.count("version") != 0) {
    std::cout << cli::version_line("shmps-train") << "\n";
    return 0;
  }
  std::string bad;
  if (o.workers < 1 || o.workers > 256) bad = "--workers must be 1..256";
  if (o.epochs < 1) bad = "--epochs must be >= 1";
  if (o.batch < 1 || o.batch > 8192) bad = "--batch must be 1..8192";
  if (o.optimizer != "adam" && o.optimizer != "adamw" && o.optimizer != "sgd") {
    bad = "--optimizer must be adam, adamw or sgd";
  }
  if (o.lr == 0.0) o.lr = default_lr(o.optimizer);
  if (!(o.lr > 0.0) || !std::isfinite(o.lr)) bad = "--lr must be > 0";
  if (o.evals_per_epoch < 1 || o.evals_per_epoch > 1000) bad = "--evals-per-epoch must be 1..1000";
  if (o.in_process) {
    if (vm.count("workers") != 0 && !vm["workers"].defaulted() && o.workers != 1)
      bad = "--in-process runs one training loop: --workers must be 1";
    if (!o.connect.empty()) bad = "--in-process uses no server: drop --connect";
    o.workers = 1;
  }
  if (!bad.empty()) {
    std::cerr << "shmps-train: " << bad << "\n";
    return kExitUsage;
  }
  if (o.name.empty()) o.name = "train_" + std::to_string(::getpid());
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// Counters a worker process shares with the parent, in an anonymous shared
// mapping made before fork. Each slot has one writer (its worker).

struct alignas(64) WorkerSlot {
  // Progress counters for the parent's display; relaxed: they order nothing,
  // and the final values are read after waitpid(), which synchronises.
  std::atomic<uint64_t> pushes_applied{0};
  std::atomic<uint64_t> pushes_rejected{0};
  // This worker's counters as the server reports them (stats() at the end).
  std::atomic<uint64_t> server_applied{0};
  std::atomic<uint64_t> server_rejected{0};
  std::atomic<uint32_t> worker_id{0};
  // Pushes lost with a server that died (kServerRestarted), and the server
  // generation the worker ended on.
  std::atomic<uint64_t> pushes_lost{0};
  std::atomic<uint64_t> generation{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "counters shared across fork need lock-free atomics");

// The start gate: workers attach, then wait for it, so the parent scores the
// initial weights before the first push and times training alone.
struct alignas(64) StartGate {
  std::atomic<uint32_t> open{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the gate is shared across fork");

class SharedSlots {
 public:
  explicit SharedSlots(size_t n) : n_(n) {
    void* p = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
    base_ = p;
    gate_ = new (p) StartGate();
    slots_ = reinterpret_cast<WorkerSlot*>(static_cast<char*>(p) + sizeof(StartGate));
    for (size_t i = 0; i < n_; ++i) new (&slots_[i]) WorkerSlot();
  }
  ~SharedSlots() { ::munmap(base_, bytes()); }
  SharedSlots(const SharedSlots&) = delete;
  SharedSlots& operator=(const SharedSlots&) = delete;
  WorkerSlot& operator[](size_t i) { return slots_[i]; }
  StartGate& gate() { return *gate_; }

 private:
  size_t bytes() const { return sizeof(StartGate) + n_ * sizeof(WorkerSlot); }
  size_t n_;
  void* base_ = nullptr;
  StartGate* gate_ = nullptr;
  WorkerSlot* slots_ = nullptr;
};

// ---------------------------------------------------------------------------
// Worker process.

struct WorkerPlan {
  size_t index = 0;  // 0..workers-1; takes examples index, index+workers, ...
  size_t workers = 1;
  size_t epochs = 1;
  size_t batch = 64;
  uint64_t seed = 1;
  std::string server_name;
};

size_t shard_size(size_t count, size_t index, size_t workers) {
  return count > index ? (count - index + workers - 1) / workers : 0;
}

size_t steps_per_epoch(size_t shard, size_t batch) { return (shard + batch - 1) / batch; }

// The optimizer as the server started by shmps-train runs it (its option
// defaults: momentum only for SGD, weight decay 0, AdamW 0.01).
kernels::OptimizerConfig optimizer_config(const Options& o) {
  kernels::OptimizerConfig c;
  kernels::parse_optimizer_kind(o.optimizer, &c.kind);  // checked by parse_options
  c.lr = static_cast<float>(o.lr);
  if (c.kind == kernels::OptimizerKind::kSgd) {
    c.momentum = static_cast<float>(o.momentum);
    c.nesterov = o.nesterov;
  }
  c.weight_decay = o.weight_decay >= 0.0 ? static_cast<float>(o.weight_decay)
                   : c.kind == kernels::OptimizerKind::kAdamW ? 0.01f
                                                              : 0.0f;
  return c;
}

// ---------------------------------------------------------------------------
// The training loop, and the two places its gradients go.

// Where the loop gets its weights and sends its gradients: the parameter
// server (ServerPath, a worker process) or the optimizer applied in place
// (LocalPath, --in-process). One thread at a time.
class UpdatePath {
 public:
  virtual ~UpdatePath() = default;
  // Makes weights() current; returns their version (applied updates).
  virtual Result<uint64_t> pull() = 0;
  // Sends grad(), computed from weights() at `version`. kStale (too old,
  // nothing applied) and kServerRestarted (lost with a dead server) are
  // retried by the loop on fresh weights; any other error ends it.
  virtual Result<uint64_t> push(uint64_t version) = 0;
  virtual const float* weights() const = 0;
  virtual float* grad() = 0;
};

// Pull and push through a shmps-server: one registered buffer holds the
// pulled weights, then the gradient pushed from them.
class ServerPath final : public UpdatePath {
 public:
  ServerPath(Worker& w, const Buffer& buffer, size_t params)
      : w_(w), buffer_(buffer), range_bytes_(params * sizeof(float)), params_(params) {}
  Result<uint64_t> pull() override { return w_.pull(kAllTensors, buffer_.id, 0); }
  Result<uint64_t> push(uint64_t version) override {
    return w_.push(kAllTensors, buffer_.id, range_bytes_, range_bytes_, Dtype::kF32, version);
  }
  const float* weights() const override { return static_cast<const float*>(buffer_.data); }
  float* grad() override { return static_cast<float*>(buffer_.data) + params_; }

 private:
  Worker& w_;
  Buffer buffer_;
  uint64_t range_bytes_;
  size_t params_;
};

// The in-process ceiling: weights, optimizer state and update rule of the
// server's host backend (the non-finite check, then apply_cpu per tensor
// with PyTorch's per-tensor step count), in this process's memory. Every
// push is applied: nothing is ever stale.
class LocalPath final : public UpdatePath {
 public:
  LocalPath(const MlpShape& shape, std::vector<float> init, const kernels::OptimizerConfig& config)
      : config_(config), tensors_(mlp_tensors(shape)), weights_(std::move(init)), grad_(weights_.size()),
        steps_(tensors_.size(), 0) {
    state_.resize(kernels::state_arrays(config_));
    for (std::vector<float>& a : state_) a.assign(weights_.size(), 0.0f);
  }
  Result<uint64_t> pull() override { return version_; }
  Result<uint64_t> push(uint64_t /*version: always current*/) override {
    if (!kernels::all_finite_cpu(grad_.data(), kernels::GradDtype::kF32, grad_.size()))
      return Status(ErrorCode::kNonFinite, "NaN or Inf in the gradient");
    for (size_t t = 0; t < tensors_.size(); ++t) {
      kernels::TensorState ts;
      ts.weights = weights_.data() + tensors_[t].offset;
      for (size_t i = 0; i < state_.size(); ++i) ts.state[i] = state_[i].data() + tensors_[t].offset;
      ts.n = tensors_[t].count;
      kernels::apply_cpu(config_, ts, grad_.data() + tensors_[t].offset, kernels::GradDtype::kF32, ++steps_[t]);
    }
    return ++version_;
  }
  const float* weights() const override { return weights_.data(); }
  float* grad() override { return grad_.data(); }

 private:
  kernels::OptimizerConfig config_;
  std::vector<ParamTensor> tensors_;
  std::vector<float> weights_;
  std::vector<std::vector<float>> state_;
  std::vector<float> grad_;
  std::vector<uint64_t> steps_;  // per tensor, as the server counts them
  uint64_t version_ = 0;
};

// Called after each applied push with the loop's applied count; false
// stops the loop (with an error).
using AfterApply = std::function<bool(uint64_t applied)>;

// Trains on the shard of `plan` (examples index, index+workers, ...,
// reshuffled every epoch from the worker's seed) for plan.epochs epochs:
// per minibatch, pull, compute the gradient, push; a stale push is counted
// and retried on fresh weights with the same minibatch, and so is one lost
// with a server that died (the Worker re-attaches to its successor).
// Counts go to `slot`. Returns the first error that is not retried.
Status train_shard(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, UpdatePath& path,
                   WorkerSlot& slot, const AfterApply& after_apply) {
  std::vector<uint32_t> shard;
  for (size_t i = plan.index; i < train.count; i += plan.workers) shard.push_back(static_cast<uint32_t>(i));
  const size_t features = train.features;
  std::vector<float> x(plan.batch * features);
  std::vector<uint8_t> y(plan.batch);
  Mlp mlp(shape, plan.batch);
  std::mt19937_64 rng(plan.seed * 0x9E3779B97F4A7C15ull + plan.index + 1);

  uint64_t applied = 0;
  uint64_t rejected = 0;
  uint64_t lost = 0;
  for (size_t epoch = 0; epoch < plan.epochs; ++epoch) {
    std::shuffle(shard.begin(), shard.end(), rng);
    for (size_t start = 0; start < shard.size(); start += plan.batch) {
      const size_t n = std::min(plan.batch, shard.size() - start);
      for (size_t i = 0; i < n; ++i) {
        const size_t ex = shard[start + i];
        std::copy_n(train.images.data() + ex * features, features, x.data() + i * features);
        y[i] = train.labels[ex];
      }
      while (true) {
        Result<uint64_t> version = path.pull();
        if (!version.ok() && version.status().code() == ErrorCode::kServerRestarted) continue;
        if (!version.ok()) return Status(version.status().code(), "pull: " + version.status().to_string());
        mlp.loss_and_gradient(path.weights(), x.data(), y.data(), n, path.grad());
        Result<uint64_t> pushed = path.push(*version);
        if (pushed.ok()) {
          slot.pushes_applied.store(++applied, std::memory_order_relaxed);  // display only
          break;
        }
        if (pushed.status().code() == ErrorCode::kServerRestarted) {
          slot.pushes_lost.store(++lost, std::memory_order_relaxed);  // display only
          continue;
        }
        if (pushed.status().code() != ErrorCode::kStale)
          return Status(pushed.status().code(), "push: " + pushed.status().to_string());
        slot.pushes_rejected.store(++rejected, std::memory_order_relaxed);  // display only
      }
      if (after_apply && !after_apply(applied)) return Status(ErrorCode::kInternal, "stopped after an update");
    }
  }
  return Status::Ok();
}

// The body of one worker process; returns its exit code.
int run_worker(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, StartGate& gate,
               WorkerSlot& slot) {
  const std::string who = "shmps-train worker " + std::to_string(plan.index) + ": ";
  set_blas_threads(1);
  Result<std::unique_ptr<Worker>> connected =
      Worker::connect(WorkerOptions{plan.server_name, std::chrono::milliseconds(10000), /*reconnect=*/true});
  if (!connected.ok()) {
    std::cerr << who << "connect: " << connected.status().to_string() << "\n";
    return kExitFailure;
  }
  Worker& w = **connected;
  slot.worker_id.store(w.worker_id(), std::memory_order_relaxed);  // read after waitpid
  const size_t params = mlp_parameter_count(shape);
  Result<Buffer> buffer = w.register_buffer(2 * params * sizeof(float));
  if (!buffer.ok()) {
    std::cerr << who << "register_buffer: " << buffer.status().to_string() << "\n";
    return kExitFailure;
  }
  ServerPath path(w, *buffer, params);

  // SYNC(start_gate): nothing is published through it; acquire for symmetry.
  while (gate.open.load(std::memory_order_acquire) == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (Status s = train_shard(plan, train, shape, path, slot, nullptr); !s.ok()) {
    std::cerr << who << s.message() << "\n";
    return kExitFailure;
  }
  Result<ServerStats> stats = w.stats();
  if (!stats.ok() && stats.status().code() == ErrorCode::kServerRestarted) stats = w.stats();
  if (!stats.ok()) {
    std::cerr << who << "stats: " << stats.status().to_string() << "\n";
    return kExitFailure;
  }
  slot.server_applied.store(stats->my_pushes_applied, std::memory_order_relaxed);  // read after waitpid
  slot.generation.store(w.generation(), std::memory_order_relaxed);
  slot.server_rejected.store(stats->my_pushes_rejected, std::memory_order_relaxed);
  if (Status s = w.detach(); !s.ok()) {
    std::cerr << who << "detach: " << s.to_string() << "\n";
    return kExitFailure;
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Child processes.

class Child {
 public:
  Child() = default;
  explicit Child(pid_t pid) : pid_(pid) {}
  Child(Child&& o) noexcept : pid_(std::exchange(o.pid_, -1)), status_(o.status_) {}
  Child& operator=(Child&& o) noexcept {
    std::swap(pid_, o.pid_);
    status_ = o.status_;
    return *this;
  }
  ~Child() { kill_and_reap(); }

  bool running() const { return pid_ > 0; }
  void signal(int signo) const {
    if (pid_ > 0) ::kill(pid_, signo);
  }
  // Reaps the child if it has exited; true once it has.
  bool poll() {
    if (pid_ <= 0) return true;
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r != pid_) return false;
    pid_ = -1;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return true;
  }
  // Waits up to `timeout`; true once exited.
  bool wait_for(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!poll()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }
  void kill_and_reap() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    status_ = 128 + SIGKILL;
  }
  // Exit code, or 128 + signal; valid once poll() returned true.
  int status() const { return status_; }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
};

Child spawn_server(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // do not outlive a crashed trainer
    // libgomp's threads spin after every parallel apply by default, taking
    // the CPUs the workers need (docs/benchmarks.md); it reads the policy
    // at load, so it is set here, before exec.
    ::setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/0);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "shmps-train: exec %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  return Child(pid);
}

std::string default_server_bin() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "shmps-server";
  return (self.parent_path() / "shmps-server").string();
}

std::string tensor_arg(const ParamTensor& t) {
  std::string s = t.name + ":";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? "x" : "") + std::to_string(t.shape[i]);
  return s;
}

// Shortest text that reads back as the same double.
std::string format_double(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// Writes the flat parameters as raw little-endian fp32 to a new temp file.
Result<std::string> write_init_file(const std::vector<float>& params) {
  static_assert(std::endian::native == std::endian::little, "the init file is little-endian fp32");
  const char* tmp = std::getenv("TMPDIR");
  std::string path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/shmps-train-init-XXXXXX";
  const int fd = ::mkstemp(path.data());
  if (fd < 0) return Status(ErrorCode::kIo, path + ": mkstemp: " + std::strerror(errno));
  const auto* p = reinterpret_cast<const char*>(params.data());
  size_t left = params.size() * sizeof(float);
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      ::unlink(path.c_str());
      return Status(ErrorCode::kIo, path + ": write: " + err);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::close(fd) != 0) return Status(ErrorCode::kIo, path + ": close: " + std::strerror(errno));
  return path;
}

// Retries connect while the server is starting (no segment yet). With a
// server of our own (`server` != nullptr) a layout mismatch is retried too:
// between the server's shm_open and its header write, the object is briefly
// empty or zero, which connect reports as a foreign file.
Result<std::unique_ptr<Worker>> connect_with_retry(const std::string& name, Child* server,
                                                   std::chrono::milliseconds patience) {
  const auto deadline = Clock::now() + patience;
  while (true) {
    Result<std::unique_ptr<Worker>> w =
        Worker::connect(WorkerOptions{name, std::chrono::milliseconds(10000), /*reconnect=*/true});
    const ErrorCode code = w.status().code();
    const bool starting =
        code == ErrorCode::kServerNotRunning || (server != nullptr && code == ErrorCode::kLayoutMismatch);
    if (w.ok() || !starting || Clock::now() >= deadline) return w;
    if (server != nullptr && server->poll()) {
      return Status(ErrorCode::kServerNotRunning, "shmps-server exited with status " +
                                                      std::to_string(server->status()) +
                                                      " before it was ready (see its message above)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Checks that a running server holds this model's tensors, in order.
Status check_tensors(const Worker& w, const MlpShape& shape) {
  const std::vector<ParamTensor> want = mlp_tensors(shape);
  const std::vector<TensorInfo>& have = w.tensors();
  bool same = have.size() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) {
    same = have[i].name == want[i].name && have[i].shape == want[i].shape &&
           have[i].element_offset == want[i].offset && have[i].dtype == Dtype::kF32;
  }
  if (same) return Status::Ok();
  std::string msg = "the server's tensors do not match the model; want";
  for (const ParamTensor& t : want) msg += " " + tensor_arg(t);
  msg += ", have";
  for (const TensorInfo& t : have) {
    ParamTensor p{t.name, t.shape, 0, 0};
    msg += " " + tensor_arg(p);
  }
  return Status(ErrorCode::kInvalidArgument, msg);
}

struct CurvePoint {
  double epoch = 0;
  uint64_t version = 0;  // applied pushes since the start of this run
  double train_loss = 0;
  double test_loss = 0;
  double test_acc = 0;
  double pushes_per_s = 0;
  uint64_t rejected = 0;
  double avg_staleness = 0;
  double elapsed_s = 0;
};

// The weights at one evaluation point, with what the curve records about
// them; scored at once (live) or after training (--eval-every, --in-process).
struct Snapshot {
  uint64_t version = 0;  // applied pushes since the start of this run
  double elapsed_s = 0;  // training time when they were taken
  uint64_t rejected = 0;
  double avg_staleness = 0;
  std::vector<float> weights;
};

// The evaluation points during training, in applied pushes: points 1 ..
// count()-1 at at(k); the final weights are scored after training.
struct EvalSchedule {
  uint64_t total = 0;      // applied pushes of the whole run
  uint64_t per_epoch = 1;  // applied pushes per epoch
  uint64_t epochs = 1;
  uint64_t evals_per_epoch = 1;
  uint64_t eval_every = 0;  // > 0: every N pushes instead
  uint64_t count() const {
    return eval_every != 0 ? (total + eval_every - 1) / eval_every : epochs * evals_per_epoch;
  }
  uint64_t at(uint64_t k) const { return eval_every != 0 ? k * eval_every : per_epoch * k / evals_per_epoch; }
  // Deferred scoring keeps every snapshot until training ends: refuse a
  // schedule that would hold more than kMaxSnapshots.
  bool fits() const { return eval_every == 0 || count() + 1 <= kMaxSnapshots; }
  std::string too_many() const {
    return "--eval-every " + std::to_string(eval_every) + " takes " + std::to_string(count() + 1) +
           " snapshots of the weights over " + std::to_string(total) + " updates; at most " +
           std::to_string(kMaxSnapshots) + " (raise --eval-every)";
  }
};

// The parent's side of the job. The destructor cleans up after any exit
// path: kills the workers, detaches the evaluation worker, then stops the
// server.
class Trainer {
 public:
  explicit Trainer(Options o) : o_(std::move(o)), shape_() {}
  ~Trainer() {
    for (Child& c : workers_) c.kill_and_reap();
    eval_.reset();
    stop_server();
    if (!init_file_.empty()) ::unlink(init_file_.c_str());
    if (!checkpoint_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(checkpoint_dir_, ec);
    }
  }
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  int run();

 private:
  int run_in_process();
  int load_data();
  int start_server();
  bool stop_server();
  bool restart_server();
  Result<Snapshot> pull_snapshot();
  bool record(Snapshot snapshot);
  void score(const Snapshot& snapshot);
  void score_deferred();
  void print(const CurvePoint& p) const;
  bool write_csv() const;

  Options o_;
  MlpShape shape_;
  Dataset train_;
  Dataset test_;
  Child server_;
  bool own_server_ = false;
  std::vector<std::string> server_argv_;
  std::string checkpoint_dir_;  // own server with --checkpoint-every: a temp dir
  int server_restarts_ = 0;
  std::string init_file_;
  std::unique_ptr<Worker> eval_;
  Buffer eval_buffer_;
  std::unique_ptr<Mlp> mlp_;
  std::vector<Child> workers_;
  std::vector<CurvePoint> curve_;
  // Snapshots kept for scoring after training, when deferred.
  bool defer_scoring_ = false;
  std::vector<Snapshot> deferred_;
  uint64_t last_recorded_version_ = 0;
  uint64_t per_epoch_ = 1;  // applied pushes per epoch
  uint64_t base_version_ = 0;
  uint64_t base_rejected_ = 0;
  uint64_t base_applied_ = 0;
  Clock::time_point start_;
};

int Trainer::load_data() {
  const auto t0 = Clock::now();
  Result<Dataset> train = load_fashion_mnist(o_.data_dir, Split::kTrain, o_.train_limit);
  Result<Dataset> test = train.ok() ? load_fashion_mnist(o_.data_dir, Split::kTest, o_.test_limit) : train;
  if (!train.ok() || !test.ok()) {
    const Status& s = train.ok() ? test.status() : train.status();
    std::cerr << "shmps-train: " << s.message() << "\n";
    return kExitUsage;
  }
  train_ = std::move(*train);
  test_ = std::move(*test);
  if (train_.count < o_.workers) {
    std::cerr << "shmps-train: " << train_.count << " training images for " << o_.workers << " workers\n";
    return kExitUsage;
  }
  std::printf("shmps-train: %zu training and %zu test images from %s (%.1f s)\n", train_.count, test_.count,
              o_.data_dir.c_str(), std::chrono::duration<double>(Clock::now() - t0).count());
  return 0;
}

int Trainer::start_server() {
  std::vector<float> init(mlp_parameter_count(shape_));
  he_init(shape_, init, o_.seed);
  Result<std::string> path = write_init_file(init);
  if (!path.ok()) {
    std::cerr << "shmps-train: " << path.status().message() << "\n";
    return kExitFailure;
  }
  init_file_ = *path;
  const std::string bin = o_.server_bin.empty() ? default_server_bin() : o_.server_bin;
  if (::access(bin.c_str(), X_OK) != 0) {
    std::cerr << "shmps-train: cannot run the server " << bin << ": " << std::strerror(errno)
              << " (build shmps-server or pass --server-bin)\n";
    return kExitFailure;
  }
  // The workers compute on the CPU into host shm buffers: the host backend
  // serves them in place ("auto" would pick a GPU where one is present and
  // copy every gradient to it and back).
  std::vector<std::string> argv{bin, "--name", o_.name, "--backend", "host"};
  for (const ParamTensor& t : mlp_tensors(shape_)) {
    argv.push_back("--tensor");
    argv.push_back(tensor_arg(t));
  }
  argv.insert(argv.end(), {"--optimizer", o_.optimizer, "--lr", format_double(o_.lr)});
  if (o_.optimizer == "sgd") {
    argv.insert(argv.end(), {"--momentum", format_double(o_.momentum)});
    if (o_.nesterov) argv.push_back("--nesterov");
  }
  if (o_.weight_decay >= 0.0) argv.insert(argv.end(), {"--weight-decay", format_double(o_.weight_decay)});
  argv.insert(argv.end(), {"--max-staleness", std::to_string(o_.max_staleness), "--max-workers",
                           std::to_string(o_.workers + 2), "--init-file", init_file_});
  if (o_.checkpoint_every != 0) {
    // A server that dies mid-run is restarted and resumes from its last
    // checkpoint (what systemd's Restart=on-failure does for a service).
    char dir[] = "/tmp/shmps-train-ckpt-XXXXXX";
    if (::mkdtemp(dir) == nullptr) {
      std::cerr << "shmps-train: mkdtemp: " << std::strerror(errno) << "\n";
      return kExitFailure;
    }
    checkpoint_dir_ = dir;
    argv.insert(argv.end(), {"--checkpoint-dir", checkpoint_dir_, "--checkpoint-every",
                             std::to_string(o_.checkpoint_every), "--checkpoint-keep", "2"});
  }
  server_argv_ = argv;
  server_ = spawn_server(argv);
  own_server_ = true;
  return 0;
}

// Starts the server again after it died; it restores its last checkpoint
// and the workers re-attach (WorkerOptions::reconnect). False when restarts
// are off or too frequent.
bool Trainer::restart_server() {
  if (checkpoint_dir_.empty() || server_restarts_ >= 10) return false;
  ++server_restarts_;
  std::cerr << "shmps-train: shmps-server exited with status " << server_.status()
            << "; restarting it from its last checkpoint (restart " << server_restarts_ << ")\n";
  server_ = spawn_server(server_argv_);
  return true;
}

// SIGTERM, wait up to 10 s (then SIGKILL); true if it exited 0.
bool Trainer::stop_server() {
  if (!own_server_ || !server_.running()) return !own_server_ || server_.status() == 0;
  server_.signal(SIGTERM);
  if (!server_.wait_for(std::chrono::seconds(10))) {
    std::cerr << "shmps-train: shmps-server did not stop within 10 s of SIGTERM; killing it\n";
    server_.kill_and_reap();
  }
  return server_.status() == 0;
}

// Stats and the weights of the running server, through the evaluation
// worker.
Result<Snapshot> Trainer::pull_snapshot() {
  // A call that finds the server dead fails once (kServerRestarted); the
  // retry re-attaches to its successor.
  Result<ServerStats> stats = eval_->stats();
  if (!stats.ok() && stats.status().code() == ErrorCode::kServerRestarted) stats = eval_->stats();
  if (!stats.ok()) return stats.status();
  Result<uint64_t> version = eval_->pull(kAllTensors, eval_buffer_.id, 0);
  if (!version.ok() && version.status().code() == ErrorCode::kServerRestarted)
    version = eval_->pull(kAllTensors, eval_buffer_.id, 0);
  if (!version.ok()) return version.status();
  const auto* params = static_cast<const float*>(eval_buffer_.data);
  Snapshot s;
  s.version = *version - base_version_;
  s.elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
  s.rejected = stats->rejected_stale - base_rejected_;
  s.avg_staleness = stats->avg_staleness;
  s.weights.assign(params, params + mlp_parameter_count(shape_));
  return s;
}

// Scores `snapshot` now, or keeps it for score_deferred().
bool Trainer::record(Snapshot snapshot) {
  last_recorded_version_ = snapshot.version;
  if (defer_scoring_) {
    deferred_.push_back(std::move(snapshot));
    return true;
  }
  score(snapshot);
  return true;
}

void Trainer::score_deferred() {
  for (const Snapshot& s : deferred_) score(s);
  deferred_.clear();
}

// Test accuracy and loss, and the loss on the fixed training subset; the
// rate is over the interval since the previous point.
void Trainer::score(const Snapshot& s) {
  const size_t train_n = std::min(train_.count, kTrainLossSamples);
  const float* params = s.weights.data();
  const EvalResult tr = mlp_->evaluate(params, train_.images.data(), train_.labels.data(), train_n);
  const EvalResult te = mlp_->evaluate(params, test_.images.data(), test_.labels.data(), test_.count);
  CurvePoint p;
  p.version = s.version;
  p.epoch = static_cast<double>(p.version) / static_cast<double>(per_epoch_);
  p.train_loss = tr.loss;
  p.test_loss = te.loss;
  p.test_acc = te.accuracy;
  if (!curve_.empty()) {
    const CurvePoint& prev = curve_.back();
    const double dt = s.elapsed_s - prev.elapsed_s;
    p.pushes_per_s = dt > 0 && p.version >= prev.version ? static_cast<double>(p.version - prev.version) / dt : 0;
  }
  p.rejected = s.rejected;
  p.avg_staleness = s.avg_staleness;
  p.elapsed_s = s.elapsed_s;
  print(p);
  curve_.push_back(p);
}

void Trainer::print(const CurvePoint& p) const {
  std::printf(
      "epoch %.2f  train_loss %.4f  test_acc %.4f  pushes/s %.0f  rejected %llu  avg_staleness %.2f\n",
      p.epoch, p.train_loss, p.test_acc, p.pushes_per_s, static_cast<unsigned long long>(p.rejected),
      p.avg_staleness);
  std::fflush(stdout);
}

bool Trainer::write_csv() const {
  if (o_.csv.empty()) return true;
  errno = 0;
  std::ofstream csv(o_.csv);
  if (!csv) {
    std::cerr << "shmps-train: --csv " << o_.csv << ": cannot open for writing: " << errno_text(errno) << "\n";
    return false;
  }
  csv << "epoch,version,train_loss,test_loss,test_acc,pushes_per_s,rejected,avg_staleness,elapsed_s\n";
  for (const CurvePoint& p : curve_) {
    csv << p.epoch << ',' << p.version << ',' << p.train_loss << ',' << p.test_loss << ',' << p.test_acc << ','
        << p.pushes_per_s << ',' << p.rejected << ',' << p.avg_staleness << ',' << p.elapsed_s << '\n';
  }
  csv.close();
  if (!csv) {
    std::cerr << "shmps-train: --csv " << o_.csv << ": write failed: " << errno_text(errno) << "\n";
    return false;
  }
  return true;
}

// The ceiling: train_shard with a LocalPath, in this process. Evaluation
// points are snapshots (a copy of the weights) scored after training, so
// the wall time is training alone.
int Trainer::run_in_process() {
  const kernels::OptimizerConfig config = optimizer_config(o_);
  if (const Status bad = kernels::validate(config); !bad.ok()) {
    std::cerr << "shmps-train: " << bad.message() << "\n";  // what the server would have said
    return kExitUsage;
  }
  std::vector<float> init(mlp_parameter_count(shape_));
  he_init(shape_, init, o_.seed);
  LocalPath path(shape_, std::move(init), config);
  set_blas_threads(1);  // as a worker: the comparison is of where updates are applied
  mlp_ = std::make_unique<Mlp>(shape_, kEvalBatch);
  defer_scoring_ = true;

  per_epoch_ = steps_per_epoch(train_.count, o_.batch);
  const EvalSchedule schedule{per_epoch_ * o_.epochs, per_epoch_, o_.epochs, o_.evals_per_epoch, o_.eval_every};
  if (!schedule.fits()) {
    std::cerr << "shmps-train: " << schedule.too_many() << "\n";
    return kExitUsage;
  }
  std::printf("shmps-train: in-process (no server), batch %zu, %s lr %s, %zu epochs of %llu updates\n", o_.batch,
              o_.optimizer.c_str(), format_double(o_.lr).c_str(), o_.epochs,
              static_cast<unsigned long long>(per_epoch_));
  std::fflush(stdout);

  start_ = Clock::now();
  auto snapshot = [&](uint64_t version) {
    Snapshot s;
    s.version = version;
    s.elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
    s.weights.assign(path.weights(), path.weights() + mlp_parameter_count(shape_));
    return s;
  };
  record(snapshot(0));
  deferred_.back().elapsed_s = 0.0;
  start_ = Clock::now();
  uint64_t next_eval = 1;
  WorkerSlot slot;  // the loop's counts; nothing shares it
  const WorkerPlan plan{0, 1, o_.epochs, o_.batch, o_.seed, ""};
  const Status s = train_shard(plan, train_, shape_, path, slot, [&](uint64_t applied) {
    if (next_eval < schedule.count() && applied >= schedule.at(next_eval)) {
      record(snapshot(applied));
      ++next_eval;
    }
    return true;
  });
  const double train_s = std::chrono::duration<double>(Clock::now() - start_).count();
  if (!s.ok()) {
    std::cerr << "shmps-train: " << s.message() << "\n";
    return kExitFailure;
  }
  const uint64_t applied = slot.pushes_applied.load(std::memory_order_relaxed);  // this thread wrote it
  if (last_recorded_version_ != applied) record(snapshot(applied));
  score_deferred();
  std::printf("updates: applied %llu in this process (no server)\n", static_cast<unsigned long long>(applied));
  std::printf("final test accuracy: %.4f (wall time %.1f s, in-process)\n", curve_.back().test_acc, train_s);
  std::fflush(stdout);
  if (!write_csv()) return kExitFailure;
  return applied == schedule.total ? 0 : kExitFailure;
}

int Trainer::run() {
  if (int rc = load_data(); rc != 0) return rc;
  if (o_.in_process) return run_in_process();
  Child* server = nullptr;
  std::string server_name = o_.connect.empty() ? o_.name : o_.connect;
  if (o_.connect.empty()) {
    if (int rc = start_server(); rc != 0) return rc;
    server = &server_;
  }
  Result<std::unique_ptr<Worker>> eval = connect_with_retry(server_name, server, std::chrono::seconds(10));
  if (!eval.ok()) {
    std::cerr << "shmps-train: connect to server '" << server_name << "': " << eval.status().to_string()
              << "\n";
    return kExitFailure;
  }
  eval_ = std::move(*eval);
  if (!init_file_.empty() && checkpoint_dir_.empty()) {  // read; no restart will need it
    ::unlink(init_file_.c_str());
    init_file_.clear();
  }
  if (Status s = check_tensors(*eval_, shape_); !s.ok()) {
    std::cerr << "shmps-train: " << s.message() << "\n";
    return kExitFailure;
  }
  Result<Buffer> buffer = eval_->register_buffer(mlp_parameter_count(shape_) * sizeof(float));
  if (!buffer.ok()) {
    std::cerr << "shmps-train: register_buffer: " << buffer.status().to_string() << "\n";
    return kExitFailure;
  }
  eval_buffer_ = *buffer;
  // A running server may hold all-zero weights (shmps-server's default
  // --init zero). From there every hidden ReLU unit outputs 0 for every
  // input, so no gradient reaches fc1 or fc2.weight and only fc2.bias moves:
  // the run would end at the class prior and exit 0. Our own server starts
  // from the He initialisation.
  if (!own_server_) {
    Result<uint64_t> pulled = eval_->pull(kAllTensors, eval_buffer_.id, 0);
    if (!pulled.ok()) {
      std::cerr << "shmps-train: pull: " << pulled.status().to_string() << "\n";
      return kExitFailure;
    }
    const auto* w = static_cast<const float*>(eval_buffer_.data);
    if (std::all_of(w, w + mlp_parameter_count(shape_), [](float x) { return x == 0.0f; })) {
      std::cerr << "shmps-train: every weight of server '" << server_name << "' is zero (version " << *pulled
                << "): a ReLU MLP started from all-zero weights never learns (its hidden units stay 0, so no "
                   "gradient reaches the first layer). Start the server with random weights, e.g. --init normal "
                   "--init-scale 0.05, or --init-file PATH (raw fp32, all tensors in order)\n";
      return kExitUsage;
    }
  }
  Result<ServerStats> base = eval_->stats();
  if (!base.ok()) {
    std::cerr << "shmps-train: stats: " << base.status().to_string() << "\n";
    return kExitFailure;
  }
  base_version_ = base->version;
  base_rejected_ = base->rejected_stale;
  base_applied_ = base->gradients_applied;

  // Applied pushes per epoch: every worker's minibatches of its shard.
  per_epoch_ = 0;
  for (size_t i = 0; i < o_.workers; ++i)
    per_epoch_ += steps_per_epoch(shard_size(train_.count, i, o_.workers), o_.batch);
  const uint64_t per_epoch = per_epoch_;
  const uint64_t total = per_epoch * o_.epochs;
  const EvalSchedule schedule{total, per_epoch, o_.epochs, o_.evals_per_epoch, o_.eval_every};
  if (!schedule.fits()) {
    std::cerr << "shmps-train: " << schedule.too_many() << "\n";
    return kExitUsage;
  }
  // Snapshots are scored after training: the parent's evaluations then
  // take no CPU from the workers, and elapsed_s is training time alone.
  defer_scoring_ = o_.eval_every != 0;
  std::string setup =
      o_.optimizer + " lr " + format_double(o_.lr) + ", max_staleness " + std::to_string(o_.max_staleness);
  if (!own_server_) setup = "the running server's optimizer and max_staleness";
  std::printf("shmps-train: server '%s', %zu workers, batch %zu, %s, %zu epochs of %llu pushes\n",
              server_name.c_str(), o_.workers, o_.batch, setup.c_str(), o_.epochs,
              static_cast<unsigned long long>(per_epoch));
  std::fflush(stdout);

  SharedSlots slots(o_.workers);
  // Fork the workers before this process touches OpenBLAS.
  for (size_t i = 0; i < o_.workers; ++i) {
    WorkerPlan plan{i, o_.workers, o_.epochs, o_.batch, o_.seed, server_name};
    std::fflush(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::cerr << "shmps-train: fork: " << std::strerror(errno) << "\n";
      return kExitFailure;
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(kExitFailure);  // it died before prctl
      int rc = kExitFailure;
      try {
        rc = run_worker(plan, train_, shape_, slots.gate(), slots[i]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "shmps-train worker %zu: %s\n", i, e.what());
      }
      // _exit: the parent's objects (its Worker, the server child) are not ours to destroy.
      std::fflush(nullptr);
      ::_exit(rc);
    }
    workers_.emplace_back(pid);
  }
  set_blas_threads(1);
  mlp_ = std::make_unique<Mlp>(shape_, kEvalBatch);

  auto take = [&]() -> bool {
    Result<Snapshot> s = pull_snapshot();
    if (!s.ok()) {
      std::cerr << "shmps-train: evaluation: " << s.status().to_string() << "\n";
      return false;
    }
    return record(std::move(*s));
  };
  start_ = Clock::now();
  if (!take()) return kExitFailure;
  // Training time runs from the gate on; the first point is its start.
  if (defer_scoring_) deferred_.back().elapsed_s = 0.0;
  else curve_.back().elapsed_s = 0.0;
  start_ = Clock::now();
  // SYNC(start_gate): see run_worker.
  slots.gate().open.store(1, std::memory_order_release);

  const uint64_t evals = schedule.count();
  uint64_t next_eval = 1;
  // Snapshots are cheap (a pull), so --eval-every polls more often to take
  // each close to its point.
  const auto poll_every = std::chrono::milliseconds(defer_scoring_ ? 5 : 20);
  size_t running = workers_.size();
  int failed = 0;
  while (running > 0) {
    std::this_thread::sleep_for(poll_every);
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!workers_[i].running() || !workers_[i].poll()) continue;
      --running;
      if (workers_[i].status() != 0 && failed == 0) {
        failed = workers_[i].status();
        std::cerr << "shmps-train: worker " << i << " failed with status " << failed << "\n";
      }
    }
    if (failed != 0) break;
    if (server != nullptr && server->poll()) {
      if (server->status() == 0 || !restart_server()) {
        std::cerr << "shmps-train: shmps-server exited with status " << server->status()
                  << " during training\n";
        return kExitFailure;
      }
      continue;
    }
    Result<ServerStats> stats = eval_->stats();
    const ErrorCode code = stats.status().code();
    // The server died since poll(): the next round restarts it.
    if (code == ErrorCode::kServerRestarted || (code == ErrorCode::kServerNotRunning && !checkpoint_dir_.empty()))
      continue;
    if (!stats.ok()) {
      std::cerr << "shmps-train: stats: " << stats.status().to_string() << "\n";
      return kExitFailure;
    }
    const uint64_t progress = stats->version - base_version_;
    if (next_eval < evals && progress >= schedule.at(next_eval)) {
      if (!take()) return kExitFailure;
      // Skip boundaries passed meanwhile, so a slow evaluation cannot queue up.
      while (next_eval < evals && last_recorded_version_ >= schedule.at(next_eval)) ++next_eval;
    }
  }
  if (failed != 0) return kExitFailure;  // the destructor kills the rest
  const double train_s = std::chrono::duration<double>(Clock::now() - start_).count();
  // The last evaluation may have seen the final weights already.
  if (last_recorded_version_ != total && !take()) return kExitFailure;

  // The workers' own counts against the server's.
  Result<ServerStats> end = eval_->stats();
  if (!end.ok()) {
    std::cerr << "shmps-train: stats: " << end.status().to_string() << "\n";
    return kExitFailure;
  }
  score_deferred();
  uint64_t applied = 0;
  uint64_t rejected = 0;
  uint64_t lost = 0;
  bool agree = true;
  for (size_t i = 0; i < o_.workers; ++i) {
    const WorkerSlot& s = slots[i];  // the worker has exited: waitpid ordered its stores
    applied += s.pushes_applied.load(std::memory_order_relaxed);
    rejected += s.pushes_rejected.load(std::memory_order_relaxed);
    lost += s.pushes_lost.load(std::memory_order_relaxed);
    // A restarted server counts only what it saw since its start.
    const bool differ = s.pushes_applied.load(std::memory_order_relaxed) !=
                            s.server_applied.load(std::memory_order_relaxed) ||
                        s.pushes_rejected.load(std::memory_order_relaxed) !=
                            s.server_rejected.load(std::memory_order_relaxed);
    if (server_restarts_ == 0 && differ) {
      std::fprintf(
          stderr,
          "shmps-train: worker %zu (id %u) counted %llu applied / %llu rejected, the server %llu / %llu\n", i,
          s.worker_id.load(std::memory_order_relaxed),
          static_cast<unsigned long long>(s.pushes_applied.load(std::memory_order_relaxed)),
          static_cast<unsigned long long>(s.pushes_rejected.load(std::memory_order_relaxed)),
          static_cast<unsigned long long>(s.server_applied.load(std::memory_order_relaxed)),
          static_cast<unsigned long long>(s.server_rejected.load(std::memory_order_relaxed)));
      agree = false;
    }
  }
  const uint64_t server_applied = end->gradients_applied - base_applied_;
  const uint64_t server_rejected = end->rejected_stale - base_rejected_;
  // With a server of our own the totals must match; a shared one may have
  // other clients, so only the per-worker counts are compared.
  if (server_restarts_ > 0) {
    // Acknowledged pushes after the last checkpoint died with the server.
    std::printf("server restarted %d times: %llu pushes in flight were lost and redone; the server's version is "
                "%llu of %llu acknowledged pushes (the rest were after a checkpoint)\n",
                server_restarts_, static_cast<unsigned long long>(lost),
                static_cast<unsigned long long>(end->version - base_version_), static_cast<unsigned long long>(applied));
  } else if (own_server_ && (server_applied != applied || server_rejected != rejected)) {
    agree = false;
  }
  if (applied != total) agree = false;
  std::printf("pushes: workers applied %llu rejected %llu; server applied %llu rejected_stale %llu (%s)\n",
              static_cast<unsigned long long>(applied), static_cast<unsigned long long>(rejected),
              static_cast<unsigned long long>(server_applied),
              static_cast<unsigned long long>(server_rejected),
              !agree ? "MISMATCH" : server_restarts_ > 0 ? "not comparable across restarts" : "agree");
  std::printf("final test accuracy: %.4f (wall time %.1f s, %zu workers)\n", curve_.back().test_acc, train_s,
              o_.workers);
  std::fflush(stdout);

  if (!write_csv()) return kExitFailure;
  eval_.reset();  // detach before the server stops
  if (!stop_server()) {
    std::cerr << "shmps-train: shmps-server exited with status " << server_.status() << "\n";
    return kExitFailure;
  }
  return agree ? 0 : kExitFailure;
}

}  // namespace
}  // namespace shmps::train

namespace {

// OpenBLAS fixes its kernels when it is loaded: when it took this CPU for
// an older one (shmps::train::better_blas_coretype()), run this program
// again with OPENBLAS_CORETYPE set, before anything else happens (the
// workers are forked from this process and keep its choice). A user's
// own OPENBLAS_CORETYPE is never overridden; a failed exec only costs
// the speed.
void use_the_cpus_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string chosen = shmps::train::blas_corename();
  const std::string better = shmps::train::better_blas_coretype(chosen, shmps::train::cpu_features());
  if (better.empty()) return;
  std::fprintf(stderr,
               "shmps-train: OpenBLAS chose its %s kernels, but this CPU runs %s ones (its model number is "
               "hidden, e.g. by a hypervisor); restarting with OPENBLAS_CORETYPE=%s\n",
               chosen.c_str(), better.c_str(), better.c_str());
  ::setenv("OPENBLAS_CORETYPE", better.c_str(), /*overwrite=*/1);
  std::fflush(nullptr);
  ::execv("/proc/self/exe", argv);
  std::fprintf(stderr, "shmps-train: exec /proc/self/exe: %s; going on with the %s kernels\n", std::strerror(errno),
               chosen.c_str());
  ::unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    shmps::train::Options options;
    if (std::optional<int> rc = shmps::train::parse_options(argc, argv, options)) return *rc;
    use_the_cpus_blas_kernels(argv);  // after --help and bad options, before the first thread or child
    shmps::train::Trainer trainer(std::move(options));
    return trainer.run();
  } catch (const std::exception& e) {
    std::cerr << "shmps-train: " << e.what() << "\n";
    return 1;
  }
}
