// How a program that owns child processes and shared-memory objects (the
// training job, the benchmarks) stops on a signal: the signal only sets a
// flag; the program polls it, ends its work through its cleanup (children
// killed, servers stopped, objects removed), then dies of the signal
// itself, so that a shell sees a process killed by it (bash ends a loop on
// a child killed by SIGINT, not on one that exited 130). A signal the
// program was started with ignored (nohup, `cmd &` without job control)
// stays ignored. A second signal takes its default action at once, but
// SIGPIPE, which every write to a closed pipe raises again. Header-only
// and not installed: one program's process-wide state.
#pragma once

#include <signal.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <initializer_list>

namespace shmps::stop_signals {

namespace detail {
inline constexpr size_t kMax = 8;
inline std::atomic<int> g_caught{0};
static_assert(std::atomic<int>::is_always_lock_free, "written by a signal handler");
// The signals catch() installed its handler for (written before any
// handler runs or any child is forked).
inline int g_signals[kMax] = {};
inline size_t g_count = 0;

inline void on_signal(int signo) {
  g_caught.store(signo, std::memory_order_relaxed);  // relaxed: a flag the main thread polls
  if (signo != SIGPIPE) ::signal(signo, SIG_DFL);
}
}  // namespace detail

// Catches each of `signals` (at most 8) that is not ignored now. Call once,
// first thing, before any thread or child is started.
inline void catch_signals(std::initializer_list<int> signals) {
  for (const int signo : signals) {
    if (detail::g_count == detail::kMax) break;
    struct sigaction old {};
    if (::sigaction(signo, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction stop {};
    stop.sa_handler = detail::on_signal;
    sigemptyset(&stop.sa_mask);
    if (::sigaction(signo, &stop, nullptr) == 0) detail::g_signals[detail::g_count++] = signo;
  }
}

// In a forked child: the default action again for each signal caught (one
// that was ignored stays ignored).
inline void restore_defaults() {
  for (size_t k = 0; k < detail::g_count; ++k) ::signal(detail::g_signals[k], SIG_DFL);
}

// The signal caught, or 0.
inline int caught() noexcept { return detail::g_caught.load(std::memory_order_relaxed); }  // relaxed: a flag

// After the cleanup: dies of the signal caught, its output flushed
// (returns when none was caught).
inline void die_of_caught() {
  const int signo = caught();
  if (signo == 0) return;
  std::fflush(nullptr);
  ::signal(signo, SIG_DFL);
  ::raise(signo);
}

}  // namespace shmps::stop_signals
