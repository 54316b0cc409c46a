// Fixtures for multi-process tests: unique segment names, real child
// processes (fork/exec) that are killed and reaped by their destructor, and
// a shmps-server child that is stopped and whose segment is removed at scope
// exit. Not thread-safe; use from a test's main thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shmps/server_process.hpp"

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

// A child process (shmps::ChildProcess) whose factories throw
// std::runtime_error when fork fails, as a test wants. The destructor
// SIGKILLs and reaps it if still running.
class Process : public ChildProcess {
 public:
  Process() = default;
  // fork + execv(argv[0], argv).
  static Process spawn(const std::vector<std::string>& argv);
  // fork; the child runs fn() and _exit()s with its return value (an
  // exception escaping fn exits 99).
  static Process fork_fn(const std::function<int()>& fn);

 private:
  explicit Process(ChildProcess child) : ChildProcess(std::move(child)) {}
};

// shmps-server --name <name> <extra args...> as a child
// (shmps::ServerProcess), from $SHMPS_BUILD_DIR/bin: returns once the
// segment is published by this child; throws std::runtime_error when it
// exits first or does not publish within 10 s. The destructor sends
// SIGTERM, waits up to 10 s (then SIGKILL), and unlinks the segment it
// left (not a successor's under the same name). With `log_path`, its
// stdout and stderr are appended there.
class ServerProcess {
 public:
  ServerProcess(const std::string& name, const std::vector<std::string>& extra_args, const std::string& log_path = "");
  const std::string& name() const { return server_->name(); }
  ChildProcess& process() { return server_->process(); }
  // SIGTERM and wait; returns the exit code (see ChildProcess::wait).
  int stop(std::chrono::milliseconds timeout = std::chrono::seconds(10)) { return server_->stop(timeout); }

 private:
  std::unique_ptr<shmps::ServerProcess> server_;
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

// The whole file's bytes; empty when it cannot be read.
std::string read_file(const std::string& path);

// This process's threads named `name` (/proc/self/task/TID/comm): for
// each, whether SIGINT, SIGTERM and SIGHUP are all blocked in it
// (/proc/self/task/TID/status, SigBlk).
std::vector<bool> stop_signals_blocked(const std::string& name);

// While it lives, what this process writes to stderr (an in-process
// server's log) goes to `path`, created or truncated. Throws
// std::runtime_error when the file cannot be opened.
class StderrTo {
 public:
  explicit StderrTo(const std::string& path);
  ~StderrTo();
  StderrTo(const StderrTo&) = delete;
  StderrTo& operator=(const StderrTo&) = delete;

 private:
  int saved_ = -1;
};
// `s` in single quotes for /bin/sh, its own single quotes escaped.
std::string shell_quote(const std::string& s);

// The state letter of process `pid` after its command in /proc/<pid>/stat
// ('T': stopped, 'Z': a zombie), or '\0' when there is no such process.
char process_state(pid_t pid);
// Whether process `pid` has ended: gone, or a zombie (exited; reaping it
// is its parent's, or init's for an orphan).
bool process_ended(pid_t pid);

// The children of process `pid`, of all its threads
// (/proc/<pid>/task/*/children: a child is listed under the thread that
// forked it, e.g. ChildProcess's fork thread for die_with_parent).
std::vector<pid_t> child_pids(pid_t pid);

// Polls cond every millisecond until it holds or timeout passes.
bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace shmps::test
