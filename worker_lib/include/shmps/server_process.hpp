// Child processes, and a shmps-server as one, for a job that is one program
// (a test, a benchmark, a training example): shmps::ServerProcess starts
// the binary with its options, returns once a worker can attach, and stops
// it (SIGTERM, then SIGKILL) and removes the segment it left. For real use
// the server runs on its own, under systemd (docs/operations.md).
// Thread safety: an object is used by one thread at a time; its child is
// reaped by that thread.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shmps/status.hpp"

namespace shmps {

// A child process: fork + exec, or fork running a function. Move-only; the
// destructor SIGKILLs and reaps one still running.
// die_with_parent: the child gets a signal (SIGTERM; fork_run: SIGKILL)
// when this process ends (exit, a fatal signal, an exec()), whichever
// thread spawned it and whether or not that thread has returned since.
// PR_SET_PDEATHSIG fires when the forking thread ends: the main thread
// forks such a child itself (it lasts as long as the process), and any
// other thread hands the fork to one thread of this library's that lives
// as long as the process, started by the first such spawn. That child
// takes the caller's signal mask (a spawn()ed program then starts with
// none blocked, below), CPU affinity and thread name, and a
// fork_run() child runs fn() on that thread's copy (a stack of the
// process's default thread stack size). Its parent is this process
// (getppid(), waitpid() from any thread); /proc lists it under that
// thread's task (/proc/<pid>/task/<tid>/children).
// The object holds a pidfd for its child (where the kernel gives one:
// Linux 5.3 and later), through which it signals and waits: once another
// wait of this process reaps the child (SIGCHLD ignored, a waitpid(-1)
// elsewhere), nothing it does reaches a process that took the pid since.
// Such a child counts as exited, its exit code unknown: -1. In a fork()ed
// child of this process, a copy of the object leaves the child alone
// (no signal, no wait; the destructor only closes its descriptor).
class ChildProcess {
 public:
  struct SpawnOptions {
    std::string log_path;          // stdout and stderr appended there; "": inherited
    bool die_with_parent = false;  // SIGTERM when this process ends (above)
    // Added to the child's environment unless set there (e.g.
    // OMP_WAIT_POLICY, which a program reads when it loads).
    std::vector<std::pair<std::string, std::string>> env_defaults;
    // Removed from the child's environment (before env_defaults apply).
    std::vector<std::string> env_unset;
  };
  // fork + execve(argv[0], argv, env): env is this process's environment
  // as spawn() reads it (a thread that sets variables meanwhile races the
  // read, as it races getenv()), with env_unset and env_defaults applied.
  // Everything the child uses is built before the fork: between fork and
  // exec the child makes async-signal-safe calls only, so that a lock
  // another thread held at the fork (malloc's, the environment's) cannot
  // hang it. The program starts with no signal blocked, whatever the
  // calling thread blocks (a sigwait() loop's SIGTERM), and every signal
  // at its default action, whatever this process ignores (SIGTERM,
  // SIGCHLD, SIGPIPE): either would outlive the exec, and a SIGTERM
  // (die_with_parent's too) might never stop it. An ignored SIGHUP,
  // SIGINT or SIGQUIT stays ignored (nohup's, or a shell's for a
  // background job: meant for the whole job). It gets stdin, stdout and
  // stderr only (stdout and stderr the log with log_path): every other
  // descriptor is closed before the exec, close-on-exec or not.
  // Errors: kIo (fork failed); an exec that fails exits the child with 127.
  static Result<ChildProcess> spawn(const std::vector<std::string>& argv, const SpawnOptions& options);
  static Result<ChildProcess> spawn(const std::vector<std::string>& argv) { return spawn(argv, SpawnOptions{}); }
  // fork; the child runs fn() and _exit()s with its value (99 when an
  // exception escapes it), after flushing stdio. The child has only the
  // forking thread: in a multithreaded process, fn must not need a lock
  // another thread may hold at the fork (setenv()'s, a logger's).
  // Errors: kIo.
  static Result<ChildProcess> fork_run(const std::function<int()>& fn, bool die_with_parent = false);

  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();

  pid_t pid() const noexcept { return pid_; }
  // True until the child is reaped (wait(), try_wait(), kill_and_reap()).
  bool running() const noexcept { return pid_ > 0; }
  // Nothing once the child is reaped, by this object or another wait
  // (where the kernel gives no pidfd, a signal after another wait reaped
  // it goes to the pid).
  void signal(int signo) const noexcept;
  // SIGSTOP, then waits (up to 10 s) until the kernel reports the child
  // stopped: SIGSTOP alone is asynchronous. Returns at once for a child
  // that has exited (not reaped yet, or reaped by another wait).
  // resume(): SIGCONT.
  void pause() const;
  void resume() const noexcept;
  // Waits up to `timeout` for the exit: the exit code, 128 + signal when
  // killed by one, -1 on timeout (the child keeps running) or when another
  // wait of this process reaped it (running() false then).
  int wait(std::chrono::milliseconds timeout);
  // Waits for the exit however long it takes: wait()'s codes (-1 when not
  // running, or reaped by another wait).
  int wait();
  // True (and *code set as wait() would: -1 when another wait reaped it)
  // once the child has exited; never blocks.
  bool try_wait(int* code);
  // SIGKILL and reap (nothing when it is not running).
  void kill_and_reap() noexcept;

 private:
  // pidfd_ when pidfd_open() found the child reaped already (ESRCH): it is
  // neither signalled nor waited for by pid.
  static constexpr int kReaped = -2;
  ChildProcess(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd), owner_(::getpid()) {}
  // Whether this process made the child: a fork()ed copy of the object in
  // another process neither signals nor waits for it, and its destructor
  // only closes the pidfd (the child is its parent's: a SIGKILL from the
  // copy would kill a sibling).
  bool ours() const noexcept { return owner_ == ::getpid(); }
  // Reaps the child once it has exited (waiting for that when `block`):
  // true with *code as wait() returns it, and the object empty; false
  // while it runs, or when there is none.
  bool reap(bool block, int* code) noexcept;
  pid_t pid_ = -1;
  // The child's pidfd; -1 where the kernel gives none (signals and waits
  // go by pid), kReaped.
  int pidfd_ = -1;
  pid_t owner_ = -1;  // the process that made the child
};

// The shmps-server beside the running program (/proc/self/exe's folder, as
// in a build tree and after an install), else "shmps-server" on PATH, else "".
std::string server_binary();

class ServerProcess {
 public:
  struct Options {
    std::string binary;             // "": server_binary()
    std::string name;               // --name: the segment /dev/shm/shmps.<name>
    std::vector<std::string> args;  // the rest of its command line
    ChildProcess::SpawnOptions spawn;
    std::chrono::milliseconds start_timeout{30000};
  };
  // Starts the server; returns once the segment at the name is published by
  // this very child, its header naming the child's pid and start time (a
  // stale segment of a killed server may still hold the name, under the
  // same pid in a pid namespace), the point from which a worker can
  // attach. Errors: kInvalidArgument (no binary, no name), kIo (fork),
  // kServerNotRunning (it exited first, or the timeout passed: then it is
  // killed and the segment it left removed; the log path is named). The
  // server does not inherit NOTIFY_SOCKET, WATCHDOG_USEC or WATCHDOG_PID:
  // a service manager's are this process's.
  static Result<std::unique_ptr<ServerProcess>> start(const Options& options);
  // stop(), then removes the segment the server left (one whose header
  // names this child, by pid and start time). Another server's segment at
  // the name stays: a successor started before this object is dropped
  // keeps serving.
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  const std::string& name() const noexcept { return name_; }
  pid_t pid() const noexcept { return child_.pid(); }
  ChildProcess& process() noexcept { return child_; }
  // SIGTERM, and SIGCONT for a paused server (pause()), which handles the
  // SIGTERM then; waits up to `timeout` (SIGKILL after it): the exit code,
  // or 128 + signal. -1 when it was not running, or when another wait of
  // this process reaped it (SIGCHLD ignored): its code is lost.
  int stop(std::chrono::milliseconds timeout = std::chrono::seconds(10));

 private:
  ServerProcess() = default;
  // Segment::remove_if_left_by() for this child: only a segment its header
  // says this child published, once the child is dead.
  void remove_segment_left() const;
  std::string name_;
  ChildProcess child_;
  // The child as the segment's header names it, kept past its reaping.
  pid_t server_pid_ = -1;
  uint64_t server_start_time_ = 0;
};

}  // namespace shmps
