#include "own_server.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <thread>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"
#include "stop_signals.hpp"

namespace shmps::train {
namespace {

using Clock = std::chrono::steady_clock;

// The server does not outlive a crashed trainer. libgomp's threads spin
// after every parallel apply by default, taking the CPUs the workers need
// (docs/benchmarks.md); it reads the policy at load, so it is set for the
// child, before exec.
Child spawn_server(const std::vector<std::string>& argv) {
  ChildProcess::SpawnOptions options;
  options.die_with_parent = true;
  options.env_defaults = {{"OMP_WAIT_POLICY", "passive"}};
  auto child = ChildProcess::spawn(argv, options);
  if (!child.ok()) throw std::runtime_error(child.status().message());
  return Child(std::move(child).value());
}

std::string tensor_arg(const ParamTensor& t) {
  std::string s = t.name + ":";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? "x" : "") + std::to_string(t.shape[i]);
  return s;
}

// Where the temp files go: $TMPDIR, else /tmp.
std::string temp_dir() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

// The temp files of a job: "shmps-train-<kind>-<pid>-<start time>-XXXXXX"
// (kind "init": the initial weights file, "ckpt": the checkpoint folder),
// named by the shmps-train process that made them, so that a later job can
// tell those of a job that died without its cleanup (SIGKILL) from a live
// one's.
constexpr const char* kTempKinds[] = {"init", "ckpt"};

std::string temp_template(const char* kind) {
  return temp_dir() + "/shmps-train-" + kind + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(shm::process_start_time(::getpid())) + "-XXXXXX";
}

// Parses "<pid>-<start time>-<suffix>"; false for any other shape.
bool parse_owner(const std::string& rest, pid_t* pid, uint64_t* start_time) {
  const size_t dash1 = rest.find('-');
  const size_t dash2 = dash1 == std::string::npos ? std::string::npos : rest.find('-', dash1 + 1);
  if (dash2 == std::string::npos || dash1 == 0 || dash2 == dash1 + 1 || dash2 + 1 == rest.size()) return false;
  uint64_t p = 0;
  auto r1 = std::from_chars(rest.data(), rest.data() + dash1, p);
  auto r2 = std::from_chars(rest.data() + dash1 + 1, rest.data() + dash2, *start_time);
  if (r1.ec != std::errc() || r1.ptr != rest.data() + dash1 || r2.ec != std::errc() || r2.ptr != rest.data() + dash2 ||
      p == 0 || p > static_cast<uint64_t>(std::numeric_limits<pid_t>::max()))
    return false;
  *pid = static_cast<pid_t>(p);
  return true;
}

// Removes the temp files (temp_template()) of jobs that are gone: only
// this user's, only a regular file ("init") or a real folder ("ckpt"),
// and only when the process they name is gone or another one has its pid
// (its start time differs). A name with start time 0 (the process's was
// unreadable) names no process that can be told apart: kept.
void sweep_stale_temp_files() {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(temp_dir(), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    for (const char* kind : kTempKinds) {
      const std::string prefix = std::string("shmps-train-") + kind + "-";
      pid_t pid = 0;
      uint64_t start_time = 0;
      if (file.rfind(prefix, 0) != 0 || !parse_owner(file.substr(prefix.size()), &pid, &start_time) || start_time == 0)
        continue;
      struct stat st {};
      const std::string path = it->path().string();
      if (::lstat(path.c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
      const bool folder = std::string_view(kind) == "ckpt";
      if (folder ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) continue;
      if (shm::process_state(pid, start_time) != shm::ProcessState::kGone) continue;
      std::error_code rm;
      if (folder)
        std::filesystem::remove_all(path, rm);
      else
        std::filesystem::remove(path, rm);
      if (!rm)
        std::cerr << "shmps-train: removed " << path << ", left by shmps-train pid " << pid << ", which is gone\n";
    }
  }
}

// Writes the flat parameters as raw little-endian fp32 to a new temp file.
Result<std::string> write_init_file(const std::vector<float>& params) {
  static_assert(std::endian::native == std::endian::little, "the init file is little-endian fp32");
  std::string path = temp_template("init");
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

}  // namespace

OwnServer::~OwnServer() {
  stop();
  if (!init_file_.empty()) ::unlink(init_file_.c_str());
  if (!checkpoint_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(checkpoint_dir_, ec);
  }
}

int OwnServer::start(const Options& o, const MlpShape& shape) {
  sweep_stale_temp_files();
  std::vector<float> init(mlp_parameter_count(shape));
  he_init(shape, init, o.seed);
  Result<std::string> path = write_init_file(init);
  if (!path.ok()) {
    std::cerr << "shmps-train: " << path.status().message() << "\n";
    return kExitFailure;
  }
  init_file_ = *path;
  const std::string bin = !o.server_bin.empty()      ? o.server_bin
                          : !server_binary().empty() ? server_binary()
                                                     : "shmps-server";
  if (::access(bin.c_str(), X_OK) != 0) {
    std::cerr << "shmps-train: cannot run the server " << bin << ": " << std::strerror(errno)
              << " (build shmps-server or pass --server-bin)\n";
    return kExitFailure;
  }
  // The workers compute on the CPU into host shm buffers: the host backend
  // serves them in place ("auto" would pick a GPU where one is present and
  // copy every gradient to it and back).
  std::vector<std::string> argv{bin, "--name", o.name, "--backend", "host"};
  for (const ParamTensor& t : mlp_tensors(shape)) {
    argv.push_back("--tensor");
    argv.push_back(tensor_arg(t));
  }
  argv.insert(argv.end(), {"--optimizer", o.optimizer, "--lr", format_double(o.lr)});
  if (o.optimizer == "sgd") {
    argv.insert(argv.end(), {"--momentum", format_double(o.momentum)});
    if (o.nesterov) argv.push_back("--nesterov");
  }
  if (o.weight_decay >= 0.0) argv.insert(argv.end(), {"--weight-decay", format_double(o.weight_decay)});
  argv.insert(argv.end(), {"--max-staleness", std::to_string(o.max_staleness), "--max-workers",
                           std::to_string(o.workers + 2), "--init-file", init_file_});
  // A job's child, not a service (--parent-pid): the server leaves SIGINT
  // (a terminal's Ctrl-C reaches the whole process group) to this process,
  // which stops it in order; it ignores a NOTIFY_SOCKET in the environment
  // (this job's launcher's unit's), and stops once this process is gone.
  argv.insert(argv.end(), {"--parent-pid", std::to_string(::getpid())});
  if (o.checkpoint_every != 0) {
    // A server that dies mid-run is restarted and resumes from its last
    // checkpoint (what systemd's Restart=on-failure does for a service).
    std::string dir = temp_template("ckpt");
    if (::mkdtemp(dir.data()) == nullptr) {
      std::cerr << "shmps-train: " << dir << ": mkdtemp: " << std::strerror(errno) << "\n";
      return kExitFailure;
    }
    checkpoint_dir_ = dir;
    argv.insert(argv.end(), {"--checkpoint-dir", checkpoint_dir_, "--checkpoint-every",
                             std::to_string(o.checkpoint_every), "--checkpoint-keep", "2"});
  }
  argv_ = argv;
  name_ = o.name;
  spawn();
  return 0;
}

void OwnServer::spawn() {
  child_ = spawn_server(argv_);
  // Read while the child lives (it cannot be reaped before our waitpid):
  // its segment's header names this start time.
  child_start_time_ = shm::process_start_time(child_.pid());
}

bool OwnServer::restart() {
  if (checkpoint_dir_.empty() || restarts_ >= kMaxRestarts) return false;
  ++restarts_;
  std::cerr << "shmps-train: shmps-server exited with status " << child_.status()
            << "; restarting it from its last checkpoint (restart " << restarts_ << ")\n";
  spawn();
  return true;
}

bool OwnServer::stop() {
  if (child_.running()) {
    child_.signal(SIGTERM);
    // A stopped server (SIGSTOP, a terminal's Ctrl-Z) handles the SIGTERM
    // only once it runs again.
    child_.signal(SIGCONT);
    if (!child_.wait_for(std::chrono::seconds(10))) {
      std::cerr << "shmps-train: shmps-server did not stop within 10 s of SIGTERM; killing it\n";
      child_.kill_and_reap();
    }
  }
  // A server killed (by us after the wait, by anyone before) leaves its
  // segment; the next start under the name would clear it, but none comes.
  if (child_.pid() > 0) shm::Segment::remove_if_left_by(name_, child_.pid(), child_start_time_);
  return child_.status() == 0;
}

void OwnServer::release_init_file() {
  if (init_file_.empty() || !checkpoint_dir_.empty()) return;
  ::unlink(init_file_.c_str());
  init_file_.clear();
}

namespace {

// Whether process `pid` is `ancestor` or one of its descendants (the
// server behind a --server-bin wrapper that forks).
bool descends_from(pid_t pid, pid_t ancestor) {
  for (int depth = 0; depth < 32 && pid > 1; ++depth) {
    if (pid == ancestor) return true;
    pid = shm::parent_pid(pid);
  }
  return false;
}

}  // namespace

Result<std::unique_ptr<Worker>> connect_with_retry(const std::string& name, OwnServer* server,
                                                   std::chrono::milliseconds patience) {
  const auto deadline = Clock::now() + patience;
  WorkerOptions options;
  options.name = name;
  options.reconnect = true;
  // A stop signal ends every wait of this worker, a reconnect to a dead
  // server's successor included (up to its 10 s timeout otherwise); so
  // does the exit of the server this run started, which only the thread
  // waiting here would restart (poll() reaps it; the caller's next poll()
  // sees it too).
  options.interrupted = [server] { return stop_signal() != 0 || (server != nullptr && server->poll()); };
  while (true) {
    if (stop_signal() != 0) return Status(ErrorCode::kInterrupted, "stopped by a signal");
    Result<std::unique_ptr<Worker>> w = Worker::connect(options);
    if (w.ok() && server != nullptr && !descends_from((*w)->server_pid(), server->pid())) {
      const pid_t other = (*w)->server_pid();
      w = Status(ErrorCode::kInvalidArgument,
                 "another shmps-server (pid " + std::to_string(other) + ") serves '" + name +
                     "', not the one shmps-train started: choose another --name, or --connect " + name + " to use it");
      // Ours exits at once (it refuses a live server's name); the other
      // job's server is not attached to again meanwhile.
      while (!server->poll() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return w;
    }
    const ErrorCode code = w.status().code();
    if (code == ErrorCode::kInterrupted && stop_signal() == 0 && server != nullptr) {
      return Status(ErrorCode::kServerNotRunning, "shmps-server exited with status " +
                                                      std::to_string(server->status()) +
                                                      " before it was ready (see its message above)");
    }
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

std::optional<uint64_t> ServerCounters::checkpoint_failures(uint64_t generation) {
  if (segment_ == nullptr || segment_->layout().generation != generation) {
    segment_.reset();
    Result<std::unique_ptr<shm::Segment>> opened = shm::Segment::open(name_, /*read_only=*/true);
    if (!opened.ok() || (*opened)->layout().generation != generation) return std::nullopt;
    segment_ = std::move(*opened);
  }
  return mapped_checkpoint_failures();
}

std::optional<uint64_t> ServerCounters::mapped_checkpoint_failures() const {
  if (segment_ == nullptr) return std::nullopt;
  // relaxed: a statistic, as the server stores it.
  return segment_->stats().checkpoint_failures.load(std::memory_order_relaxed);
}

Status check_tensors(const Worker& w, const MlpShape& shape) {
  const std::vector<ParamTensor> want = mlp_tensors(shape);
  const std::vector<TensorInfo>& have = w.tensors();
  bool same = have.size() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) {
    same = have[i].name == want[i].name && have[i].shape == want[i].shape && have[i].element_offset == want[i].offset &&
           have[i].dtype == Dtype::kF32;
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

}  // namespace shmps::train
