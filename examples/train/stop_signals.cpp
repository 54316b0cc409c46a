#include "stop_signals.hpp"

#include <signal.h>

#include <atomic>
#include <iterator>

namespace shmps::train {
namespace {

// SIGPIPE: stdout's reader went (`shmps-train | head`); dying of it at
// once would leave the temp files, the server and its segment behind.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "written by a signal handler");
// Which of kStopSignals catch_stop_signals() caught (written before any
// handler runs or any worker is forked).
bool g_caught[std::size(kStopSignals)] = {};

void on_stop_signal(int signo) {
  g_signal.store(signo, std::memory_order_relaxed);  // relaxed: a flag the main thread polls
  // A second one ends the process at once; but each later write to the
  // closed pipe raises SIGPIPE again, which is no one asking twice.
  if (signo != SIGPIPE) ::signal(signo, SIG_DFL);
}

}  // namespace

void catch_stop_signals() {
  for (size_t k = 0; k < std::size(kStopSignals); ++k) {
    struct sigaction old {};
    if (::sigaction(kStopSignals[k], nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction stop {};
    stop.sa_handler = on_stop_signal;
    sigemptyset(&stop.sa_mask);
    g_caught[k] = ::sigaction(kStopSignals[k], &stop, nullptr) == 0;
  }
}

void restore_stop_signals() {
  for (size_t k = 0; k < std::size(kStopSignals); ++k)
    if (g_caught[k]) ::signal(kStopSignals[k], SIG_DFL);
}

int stop_signal() { return g_signal.load(std::memory_order_relaxed); }  // relaxed: a flag

void die_of_stop_signal() {
  const int signo = stop_signal();
  if (signo == 0) return;
  ::signal(signo, SIG_DFL);
  ::raise(signo);
}

}  // namespace shmps::train
