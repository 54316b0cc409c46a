// A child process of shmps-train (a worker or the shmps-server) that the
// parent polls, waits for and, in the end, kills and reaps. Owned and used
// by the parent's one thread.
#pragma once

#include <sys/types.h>

#include <chrono>

namespace shmps::train {

class Child {
 public:
  Child() = default;
  explicit Child(pid_t pid) : pid_(pid) {}
  Child(Child&& o) noexcept;
  Child& operator=(Child&& o) noexcept;
  // SIGKILLs and reaps a child still running.
  ~Child() { kill_and_reap(); }

  bool running() const { return pid_ > 0; }
  void signal(int signo) const;
  // Reaps the child if it has exited; true once it has.
  bool poll();
  // Waits up to `timeout`; true once exited.
  bool wait_for(std::chrono::milliseconds timeout);
  void kill_and_reap();
  // Exit code, or 128 + signal; valid once poll() returned true.
  int status() const { return status_; }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
};

}  // namespace shmps::train
