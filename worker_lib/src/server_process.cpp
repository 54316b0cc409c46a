#include "shmps/server_process.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "shmps/shm/proc.hpp"
#include "shmps/shm/segment.hpp"

namespace shmps {
namespace {

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// In the child right after fork(): dies with the parent when asked (and
// already if the parent died before prctl).
void follow_parent(bool die_with_parent, pid_t parent, int signo) {
  if (!die_with_parent) return;
  ::prctl(PR_SET_PDEATHSIG, signo);
  if (::getppid() != parent) ::_exit(98);
}

// fork() after flushing stdio (the child's copy of unwritten output would
// be written twice); the child dies with the parent when asked. -1: fork
// failed; 0: in the child.
pid_t fork_child(bool die_with_parent, int signo) {
  const pid_t parent = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) follow_parent(die_with_parent, parent, signo);
  return pid;
}

// Whether the kernel reports pid stopped ('T' after the command in /proc/<pid>/stat).
bool stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T';
}

}  // namespace

Result<ChildProcess> ChildProcess::spawn(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) return Status{ErrorCode::kInvalidArgument, "spawn: no program"};
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork_child(options.die_with_parent, SIGTERM);
  if (pid < 0) return Status{ErrorCode::kIo, "fork: " + errno_text(errno)};
  if (pid == 0) {
    for (const auto& [key, value] : options.env_defaults) ::setenv(key.c_str(), value.c_str(), /*overwrite=*/0);
    if (!options.log_path.empty()) {
      const int fd = ::open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
    }
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  return ChildProcess(pid);
}

Result<ChildProcess> ChildProcess::fork_run(const std::function<int()>& fn, bool die_with_parent) {
  const pid_t pid = fork_child(die_with_parent, SIGKILL);
  if (pid < 0) return Status{ErrorCode::kIo, "fork: " + errno_text(errno)};
  if (pid == 0) {
    int rc = 99;
    try {
      rc = fn();
    } catch (...) {
      rc = 99;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(rc);
  }
  return ChildProcess(pid);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    kill_and_reap();
    pid_ = other.pid_;
    other.pid_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() { kill_and_reap(); }

void ChildProcess::signal(int signo) const noexcept {
  if (pid_ > 0) ::kill(pid_, signo);
}

void ChildProcess::pause() const {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGSTOP);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!stopped(pid_) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void ChildProcess::resume() const noexcept { signal(SIGCONT); }

int ChildProcess::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int code = 0;
    if (try_wait(&code)) return code;
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int ChildProcess::wait() {
  if (pid_ <= 0) return -1;
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0)
    if (errno != EINTR) return -1;
  pid_ = -1;
  return exit_code(status);
}

bool ChildProcess::try_wait(int* code) {
  if (pid_ <= 0) return false;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return false;
  pid_ = -1;
  *code = exit_code(status);
  return true;
}

void ChildProcess::kill_and_reap() noexcept {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

std::string server_binary() {
  std::error_code ec;
  const auto beside = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "shmps-server";
  if (!ec && ::access(beside.c_str(), X_OK) == 0) return beside.string();
  if (const char* path = std::getenv("PATH")) {
    std::string dirs = path;
    size_t start = 0;
    while (start <= dirs.size()) {
      const size_t end = std::min(dirs.find(':', start), dirs.size());
      const std::string candidate =
          (end > start ? dirs.substr(start, end - start) : std::string(".")) + "/shmps-server";
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      start = end + 1;
    }
  }
  return "";
}

Result<std::unique_ptr<ServerProcess>> ServerProcess::start(const Options& options) {
  const std::string binary = options.binary.empty() ? server_binary() : options.binary;
  if (binary.empty()) return Status{ErrorCode::kInvalidArgument, "no shmps-server beside this program or on PATH"};
  if (options.name.empty()) return Status{ErrorCode::kInvalidArgument, "a server needs a --name"};
  std::vector<std::string> argv{binary, "--name", options.name};
  argv.insert(argv.end(), options.args.begin(), options.args.end());
  auto child = ChildProcess::spawn(argv, options.spawn);
  if (!child.ok()) return child.status();
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->name_ = options.name;
  server->child_ = std::move(child).value();
  // Read while the child cannot be reaped yet (only this object waits for
  // it): the header of the segment it publishes names this start time.
  server->server_pid_ = server->child_.pid();
  server->server_start_time_ = shm::process_start_time(server->server_pid_);
  const std::string log = options.spawn.log_path.empty() ? std::string() : " (log: " + options.spawn.log_path + ")";
  const auto deadline = std::chrono::steady_clock::now() + options.start_timeout;
  while (true) {
    int code = 0;
    if (server->child_.try_wait(&code))
      return Status{ErrorCode::kServerNotRunning,
                    binary + " --name " + options.name + " exited with " + std::to_string(code) + log};
    // Published by this child: its pid in a header whose version is set
    // (the segment is validated as a worker would).
    if (auto seg = shm::Segment::open(options.name, /*read_only=*/true);
        seg.ok() && (*seg)->layout().server_pid == static_cast<uint32_t>(server->child_.pid()))
      return server;
    if (std::chrono::steady_clock::now() >= deadline) {
      server->child_.kill_and_reap();
      server->remove_segment_left();
      return Status{ErrorCode::kServerNotRunning, "server '" + options.name + "' did not publish its segment within " +
                                                      std::to_string(options.start_timeout.count()) + " ms" + log};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int ServerProcess::stop(std::chrono::milliseconds timeout) {
  if (!child_.running()) return -1;
  child_.signal(SIGTERM);
  const int code = child_.wait(timeout);
  if (code >= 0) return code;
  child_.kill_and_reap();
  return 128 + SIGKILL;
}

void ServerProcess::remove_segment_left() const {
  shm::Segment::remove_if_left_by(name_, server_pid_, server_start_time_);
}

ServerProcess::~ServerProcess() {
  stop();
  remove_segment_left();
}

}  // namespace shmps
