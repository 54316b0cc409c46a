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

// A deadline that reads the clock only when first asked. A wait that ends
// within its spin never needs it, and a steady_clock read costs 20-30 ns on
// the development VM, a tenth of a request's round trip (docs/benchmarks.md,
// "Profile"). Deadline(timeout) counts from its first time() call, one spin
// after the wait began: about 50 us on an idle CPU, longer when the spin's
// yields (wait_until) hand the CPU to other processes, each for up to a
// scheduler slice (milliseconds); Deadline::at(t) is fixed.
// Not thread-safe: one waiter's object.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Deadline(std::chrono::nanoseconds timeout) noexcept : timeout_(timeout) {}
  static Deadline at(Clock::time_point t) noexcept {
    Deadline d(std::chrono::nanoseconds{0});
    d.at_ = t;
    d.fixed_ = true;
    return d;
  }
  Clock::time_point time() noexcept {
    if (!fixed_) {
      at_ = Clock::now() + timeout_;
      fixed_ = true;
    }
    return at_;
  }
  // Whether time() has fixed it (or at() made it fixed): a wait has used
  // some of it. False: all of the timeout is left.
  bool started() const noexcept { return fixed_; }

 private:
  std::chrono::nanoseconds timeout_;
  Clock::time_point at_{};
  bool fixed_ = false;
};

// Waits until ready() is true: spins `spin_iterations` polls, then sleeps
// on w in slices of at most `slice`, calling abort() between slices (a true
// return ends the wait with kAborted, e.g. the peer died). Gives up with
// kTimeout at `deadline` (read only once the spin is over).
// A poll waits with a pause instruction, every 64th with a sched_yield()
// instead (~0.5 us when nothing else is runnable), so that a spinner on the
// CPU its peer needs gives that CPU up: 4 workers spinning on 2 vCPUs
// starved the server, and a worker on the server's CPU made a 1 MiB push
// take 93 us instead of 41 (with the server's idle loop yielding too:
// docs/design.md, "Sleeping"). The yields can stretch the spin, and so the
// first abort() check, by a scheduler slice each on a busy CPU.
WaitResult wait_until(WaitWord& w, const std::function<bool()>& ready, const std::function<bool()>& abort,
                      Deadline& deadline, uint32_t spin_iterations = 2000,
                      std::chrono::nanoseconds slice = std::chrono::milliseconds(20));
inline WaitResult wait_until(WaitWord& w, const std::function<bool()>& ready, const std::function<bool()>& abort,
                             std::chrono::steady_clock::time_point deadline, uint32_t spin_iterations = 2000,
                             std::chrono::nanoseconds slice = std::chrono::milliseconds(20)) {
  Deadline d = Deadline::at(deadline);
  return wait_until(w, ready, abort, d, spin_iterations, slice);
}

// Gives this CPU to another runnable process, if any (sched_yield(): ~0.5 us
// on the development VM when there is none). For spin loops whose peer may
// be waiting for this very CPU: wait_until() calls it every 64th poll, the
// server's idle loop after each empty watch (docs/design.md, "Sleeping").
void yield_cpu() noexcept;

// A CPU relax hint for spin loops.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace shmps::shm
