// Fixtures for multi-process tests: unique segment names, real child
// processes (fork/exec) that are killed and reaped by their destructor, and
// a shmps-server child that is stopped and whose segment is removed at scope
// exit. Not thread-safe; use from a test's main thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace shmps::test {

// "<tag>_<pid>_<n>": unique per test process and call, valid as --name.
std::string unique_name(const std::string& tag);

// A fresh folder under the temp directory (named by unique_name(tag)),
// removed with its contents at scope exit.
struct TempDir {
  explicit TempDir(const std::string& tag);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path path;
};

// Path of a built program: $SHMPS_BUILD_DIR/bin/<name> (set by CTest), else
// the folder of the running test executable.
std::string program_path(const std::string& name);

// A child process. The destructor SIGKILLs and reaps it if still running.
class Process {
 public:
  Process() = default;
  // fork + execv(argv[0], argv). Throws std::runtime_error if fork fails.
  static Process spawn(const std::vector<std::string>& argv);
  // fork; the child runs fn() and _exit()s with its return value (an
  // exception escaping fn exits 99).
  static Process fork_fn(const std::function<int()>& fn);

  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  ~Process();

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  void signal(int signo) const;
  // SIGSTOP, then waits until the kernel reports the child stopped ('T' in
  // /proc/<pid>/stat): SIGSTOP alone is asynchronous. resume(): SIGCONT.
  void pause() const;
  void resume() const;
  // Waits up to `timeout` for exit. Returns the exit code, 128 + signal when
  // killed by a signal, or -1 on timeout (the child keeps running).
  int wait(std::chrono::milliseconds timeout);
  // SIGKILL + reap.
  void kill_and_reap();

 private:
  pid_t pid_ = -1;
};

// shmps-server --name <name> <extra args...> as a child. Waits until the
// segment /dev/shm/shmps.<name> is published by this child (throws after
// 10 s or if the child exits). The destructor
// sends SIGTERM, waits up to 10 s (then SIGKILL), and unlinks the segment.
class ServerProcess {
 public:
  ServerProcess(const std::string& name, const std::vector<std::string>& extra_args);
  ~ServerProcess();
  const std::string& name() const { return name_; }
  Process& process() { return process_; }
  // SIGTERM and wait; returns the exit code (see Process::wait).
  int stop(std::chrono::milliseconds timeout = std::chrono::seconds(10));

 private:
  std::string name_;
  Process process_;
};

// What run_captured() saw: the exit code (as Process::wait: 128 + signal
// when killed, -1 when it ran past the timeout and was killed) and
// everything the program wrote to stdout and stderr.
struct Captured {
  int exit_code = -1;
  std::string output;
};
// Runs argv[0] (fork + execv) with stdout and stderr captured, waiting up to
// `timeout`. `in_child` runs in the child before exec (e.g. umask, setuid);
// a false return ends the child with exit code 126 before exec.
Captured run_captured(const std::vector<std::string>& argv,
                      std::chrono::milliseconds timeout = std::chrono::seconds(10),
                      const std::function<bool()>& in_child = {});

// Polls cond every millisecond until it holds or timeout passes.
bool eventually(const std::function<bool()>& cond,
                std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace shmps::test
