// A child process of shmps-train (a worker or the shmps-server), as the
// parent sees it: shmps::ChildProcess, plus the exit status it polls for,
// kept once the child is reaped. Owned and used by the parent's one thread.
#pragma once

#include <signal.h>

#include <chrono>
#include <utility>

#include "shmps/server_process.hpp"

namespace shmps::train {

class Child {
 public:
  Child() = default;
  explicit Child(ChildProcess process) : pid_(process.pid()), process_(std::move(process)) {}

  // The child's pid, kept after it is reaped.
  pid_t pid() const { return pid_; }
  bool running() const { return process_.running(); }
  void signal(int signo) const { process_.signal(signo); }
  // Reaps the child if it has exited; true once it has.
  bool poll() { return !process_.running() || process_.try_wait(&status_); }
  // Waits up to `timeout`; true once exited (status() -1 when another
  // wait reaped it, its code lost).
  bool wait_for(std::chrono::milliseconds timeout) {
    if (!process_.running()) return true;
    const int code = process_.wait(timeout);
    if (code < 0 && process_.running()) return false;
    status_ = code;
    return true;
  }
  // SIGKILLs and reaps a child still running (the destructor does too).
  void kill_and_reap() {
    if (!process_.running()) return;
    process_.kill_and_reap();
    status_ = 128 + SIGKILL;
  }
  // Exit code, or 128 + signal; valid once poll() returned true.
  int status() const { return status_; }

 private:
  pid_t pid_ = -1;
  ChildProcess process_;
  int status_ = -1;
};

}  // namespace shmps::train
