#include "child.hpp"

#include <signal.h>
#include <sys/wait.h>

#include <thread>
#include <utility>

namespace shmps::train {

Child::Child(Child&& o) noexcept : pid_(std::exchange(o.pid_, -1)), status_(o.status_) {}

Child& Child::operator=(Child&& o) noexcept {
  std::swap(pid_, o.pid_);
  status_ = o.status_;
  return *this;
}

void Child::signal(int signo) const {
  if (pid_ > 0) ::kill(pid_, signo);
}

bool Child::poll() {
  if (pid_ <= 0) return true;
  int st = 0;
  const pid_t r = ::waitpid(pid_, &st, WNOHANG);
  if (r != pid_) return false;
  pid_ = -1;
  status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return true;
}

bool Child::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!poll()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void Child::kill_and_reap() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int st = 0;
  ::waitpid(pid_, &st, 0);
  pid_ = -1;
  status_ = 128 + SIGKILL;
}

}  // namespace shmps::train
