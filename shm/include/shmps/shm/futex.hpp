// Spin-then-sleep waiting on a WaitWord in shared memory (Linux futex,
// process-shared). Safe between threads and processes.
//
// Protocol (both ends are seq_cst so neither side can miss the other):
//   notifier: publish data (release store) ; notify(w)
//             notify = seq.fetch_add(1) ; if waiters.load() > 0: FUTEX_WAKE
//   waiter:   waiters.fetch_add(1) ; s = seq.load() ; if ready(): done
//             else FUTEX_WAIT(seq, s, slice) ; waiters.fetch_sub(1)
// If the waiter's ready() misses the data, the notifier's seq bump is ordered
// after the waiter's seq load, so FUTEX_WAIT returns at once or is woken.
// A waiter always wakes after at most `slice` to re-check liveness, so a
// dead notifier never hangs it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "shmps/shm/layout.hpp"

namespace shmps::shm {

// Wakes every waiter of w. Call after publishing (the seq_cst RMW orders it).
void notify(WaitWord& w) noexcept;

// One bounded sleep on w: returns when notified, when `slice` passes, or
// spuriously. The caller loops over its condition. Nanosecond resolution.
void wait_once(WaitWord& w, uint32_t observed_seq, std::chrono::nanoseconds slice) noexcept;

enum class WaitResult { kReady, kTimeout, kAborted };

// Waits until ready() is true: spins `spin_iterations` polls (with a pause
// instruction), then sleeps on w in slices of at most `slice`, calling
// abort() between slices (a true return ends the wait with kAborted, e.g.
// the peer died). Gives up with kTimeout at `deadline`.
WaitResult wait_until(WaitWord& w, const std::function<bool()>& ready,
                      const std::function<bool()>& abort,
                      std::chrono::steady_clock::time_point deadline,
                      uint32_t spin_iterations = 2000,
                      std::chrono::nanoseconds slice = std::chrono::milliseconds(20));

// A CPU relax hint for spin loops.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace shmps::shm
