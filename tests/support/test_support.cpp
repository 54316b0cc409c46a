#include "test_support.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
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
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  Process p;
  p.pid_ = ::fork();
  if (p.pid_ < 0) throw std::runtime_error("fork failed");
  if (p.pid_ == 0) {
    ::execv(args[0], args.data());
    _exit(127);
  }
  return p;
}

Process Process::fork_fn(const std::function<int()>& fn) {
  Process p;
  p.pid_ = ::fork();
  if (p.pid_ < 0) throw std::runtime_error("fork failed");
  if (p.pid_ == 0) {
    int rc = 99;
    try {
      rc = fn();
    } catch (...) {
      rc = 99;
    }
    _exit(rc);
  }
  return p;
}

Process::Process(Process&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }
Process& Process::operator=(Process&& other) noexcept {
  if (this != &other) {
    kill_and_reap();
    pid_ = other.pid_;
    other.pid_ = -1;
  }
  return *this;
}
Process::~Process() { kill_and_reap(); }

void Process::signal(int signo) const {
  if (pid_ > 0) ::kill(pid_, signo);
}

void Process::pause() const {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGSTOP);
  const std::string path = "/proc/" + std::to_string(pid_) + "/stat";
  eventually([&] {
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T';
  });
}

void Process::resume() const { signal(SIGCONT); }

int Process::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Process::kill_and_reap() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
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

bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

ServerProcess::ServerProcess(const std::string& name, const std::vector<std::string>& extra_args)
    : name_(name) {
  std::vector<std::string> argv{program_path("shmps-server"), "--name", name};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  process_ = Process::spawn(argv);
  const std::string path = "/dev/shm/shmps." + name;
  // Ready when the segment at that path is published by THIS child (a
  // stale segment of a killed server may still hold the name).
  const auto published_by_child = [&] {
    std::ifstream in(path, std::ios::binary);
    char head[40] = {};
    if (!in.read(head, sizeof head)) return false;
    uint32_t version = 0, pid = 0;
    std::memcpy(&version, head + 8, 4);   // SegmentHeader::layout_version
    std::memcpy(&pid, head + 32, 4);      // SegmentHeader::server_pid
    return version != 0 && pid == static_cast<uint32_t>(process_.pid());
  };
  if (!eventually([&] { return published_by_child() || process_.wait(std::chrono::milliseconds(0)) >= 0; })) {
    // The destructor does not run for a constructor that throws: a server
    // stuck in its start must not outlive the test, nor its object.
    process_.kill_and_reap();
    ::shm_unlink(("shmps." + name).c_str());
    throw std::runtime_error("shmps-server did not publish " + path + " within 10 s");
  }
  if (!process_.running()) throw std::runtime_error("shmps-server exited at start (see its stderr)");
}

int ServerProcess::stop(std::chrono::milliseconds timeout) {
  process_.signal(SIGTERM);
  return process_.wait(timeout);
}

ServerProcess::~ServerProcess() {
  if (process_.running() && stop() < 0) process_.kill_and_reap();
  ::shm_unlink(("shmps." + name_).c_str());
}

}  // namespace shmps::test
