#include "test_support.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

namespace shmps::test {

std::string unique_name(const std::string& tag) {
  static std::atomic<int> counter{0};
  return tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
}

TempDir::TempDir(const std::string& tag) : path(std::filesystem::temp_directory_path() / unique_name(tag)) {
  std::filesystem::create_directories(path);
}

TempDir::~TempDir() {
  std::error_code ec;  // a destructor must not throw
  std::filesystem::remove_all(path, ec);
}

std::string program_path(const std::string& name) {
  if (const char* dir = std::getenv("SHMPS_BUILD_DIR")) return std::string(dir) + "/bin/" + name;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / name).string();
}

Process Process::spawn(const std::vector<std::string>& argv) {
  auto child = ChildProcess::spawn(argv);
  if (!child.ok()) throw std::runtime_error(child.status().to_string());
  return Process(std::move(child).value());
}

Process Process::fork_fn(const std::function<int()>& fn) {
  auto child = ChildProcess::fork_run(fn);
  if (!child.ok()) throw std::runtime_error(child.status().to_string());
  return Process(std::move(child).value());
}

Captured run_captured(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                      const std::function<bool()>& in_child) {
  char path[] = "/tmp/shmps_captured_XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  ::unlink(path);  // the descriptor keeps the file until both ends close it
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  Process p;
  p = Process::fork_fn([&] {
    if (::dup2(fd, STDOUT_FILENO) < 0 || ::dup2(fd, STDERR_FILENO) < 0) return 125;
    if (in_child && !in_child()) return 126;
    ::execv(args[0], args.data());
    return 127;
  });
  Captured out;
  out.exit_code = p.wait(timeout);
  if (out.exit_code < 0) p.kill_and_reap();
  char buf[4096];
  ssize_t n = 0;
  off_t at = 0;
  while ((n = ::pread(fd, buf, sizeof buf, at)) > 0) {
    out.output.append(buf, static_cast<size_t>(n));
    at += n;
  }
  ::close(fd);
  return out;
}

std::vector<pid_t> child_pids(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream children(task.path() / "children");
    for (pid_t child; children >> child;) out.push_back(child);
  }
  return out;
}

char process_state(pid_t pid) {
  const std::string text = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : '\0';
}

bool process_ended(pid_t pid) {
  const char state = process_state(pid);
  return state == '\0' || state == 'Z';
}

bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

ServerProcess::ServerProcess(const std::string& name, const std::vector<std::string>& extra_args,
                             const std::string& log_path) {
  shmps::ServerProcess::Options o;
  o.binary = program_path("shmps-server");
  o.name = name;
  o.args = extra_args;
  o.spawn.log_path = log_path;
  o.start_timeout = std::chrono::seconds(10);
  auto server = shmps::ServerProcess::start(o);
  if (!server.ok()) throw std::runtime_error(server.status().to_string());
  server_ = std::move(server).value();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<bool> stop_signals_blocked(const std::string& name) {
  std::vector<bool> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm"), status(task.path() / "status");
    std::string comm_name, line;
    if (!std::getline(comm, comm_name) || comm_name != name) continue;
    uint64_t blocked = 0;
    bool read = false;
    while (std::getline(status, line))
      if (line.rfind("SigBlk:", 0) == 0) {
        blocked = std::stoull(line.substr(7), nullptr, 16);
        read = true;
      }
    if (!read) continue;  // a thread that just ended
    const auto bit = [](int signo) { return uint64_t{1} << (signo - 1); };
    const uint64_t want = bit(SIGINT) | bit(SIGTERM) | bit(SIGHUP);
    out.push_back((blocked & want) == want);
  }
  return out;
}

StderrTo::StderrTo(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("open " + path + ": " + std::strerror(errno));
  saved_ = ::dup(STDERR_FILENO);
  if (saved_ < 0 || ::dup2(fd, STDERR_FILENO) < 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    if (saved_ >= 0) ::close(saved_);
    throw std::runtime_error("redirecting stderr to " + path + ": " + why);
  }
  ::close(fd);
}

StderrTo::~StderrTo() {
  ::dup2(saved_, STDERR_FILENO);
  ::close(saved_);
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace shmps::test
