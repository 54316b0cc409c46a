#include "shmps/shm/futex.hpp"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace shmps::shm {
namespace {

// The word lives in a MAP_SHARED mapping used by several processes, so the
// non-private futex operations are required.
long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

// Spin polls per yield_cpu() in wait_until() (see the header). A power
// of two. 64 polls are about 1.5 us: a 4 KiB round trip (~0.35 us) is
// answered before the first yield.
constexpr uint32_t kYieldEvery = 64;

}  // namespace

void yield_cpu() noexcept { ::sched_yield(); }

void notify(WaitWord& w) noexcept {
  // SYNC(wait_word): pairs with the waiter's seq load in wait_until().
  w.seq.fetch_add(1, std::memory_order_seq_cst);
  // seq_cst: must not be ordered before the seq bump (Dekker with waiters).
  if (w.waiters.load(std::memory_order_seq_cst) != 0) futex(&w.seq, FUTEX_WAKE, INT_MAX, nullptr);
}

void wait_once(WaitWord& w, uint32_t observed_seq, std::chrono::nanoseconds slice) noexcept {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000000000);
  futex(&w.seq, FUTEX_WAIT, observed_seq, &ts);
}

WaitResult wait_until(WaitWord& w, const std::function<bool()>& ready, const std::function<bool()>& abort,
                      Deadline& deadline, uint32_t spin_iterations, std::chrono::nanoseconds slice) {
  for (uint32_t i = 0; i < spin_iterations; ++i) {
    if (ready()) return WaitResult::kReady;
    if ((i & (kYieldEvery - 1)) == kYieldEvery - 1)
      yield_cpu();
    else
      cpu_relax();
  }
  while (true) {
    // seq_cst on both: see the protocol in the header.
    w.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seq = w.seq.load(std::memory_order_seq_cst);  // SYNC(wait_word)
    if (ready()) {
      w.waiters.fetch_sub(1, std::memory_order_relaxed);  // relaxed: only a hint to notifiers
      return WaitResult::kReady;
    }
    const auto now = std::chrono::steady_clock::now();
    const auto until = deadline.time();
    if (now >= until) {
      w.waiters.fetch_sub(1, std::memory_order_relaxed);  // relaxed: only a hint
      return WaitResult::kTimeout;
    }
    wait_once(w, seq, std::min<std::chrono::nanoseconds>(slice, until - now));
    w.waiters.fetch_sub(1, std::memory_order_relaxed);  // relaxed: only a hint
    if (ready()) return WaitResult::kReady;
    if (abort && abort()) return WaitResult::kAborted;
  }
}

}  // namespace shmps::shm
