#include "peer_guard.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace shmps::server {
namespace {

struct Range {
  std::atomic<uintptr_t> begin{0};  // 0: free
  std::atomic<uintptr_t> end{0};
  std::atomic<uint32_t> poisoned{0};
};
Range g_ranges[kGuardedRanges];
struct sigaction g_previous {};

struct OwnSegment {
  std::atomic<uintptr_t> begin{0};  // 0: none
  std::atomic<uintptr_t> end{0};
  std::atomic<int> fd{-1};
  std::atomic<uint64_t> inode{0};  // the object's: a descriptor number reused after close is not it
  std::atomic<uint64_t> regrowths{0};
  // The last fault retried because the object was whole again, when, and
  // how many times in a row at that address.
  std::atomic<uintptr_t> last_retried{0};
  std::atomic<uint64_t> last_retried_ns{0};
  std::atomic<uint32_t> retried_in_a_row{0};
};
OwnSegment g_segment;

// A fault at one address that repeats this many times, each within
// kRetryWindowNs of the one before, while the object is whole has another
// cause than a shrink.
constexpr uint32_t kWholeRetries = 8;
constexpr uint64_t kRetryWindowNs = 1'000'000;

// A fault in the control segment: true when the object was short and is
// whole again (grown back here, or by the process that shrank it), so the
// access can retry.
bool regrow_segment(uintptr_t addr) {
  // SYNC(guard_segment): pairs with guard_segment()'s release of begin.
  const uintptr_t begin = g_segment.begin.load(std::memory_order_acquire);
  if (begin == 0 || addr < begin || addr >= g_segment.end.load(std::memory_order_relaxed))
    return false;                                               // relaxed: ordered by begin
  const int fd = g_segment.fd.load(std::memory_order_relaxed);  // relaxed: ordered by begin
  const auto bytes = static_cast<off_t>(g_segment.end.load(std::memory_order_relaxed) - begin);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_ino != g_segment.inode.load(std::memory_order_relaxed)) return false;
  if (st.st_size >= bytes) {
    // Whole again: the process that shrank it grew it back between the
    // fault and this look (its pages zeros now, as the consumer's check
    // finds), and the access succeeds when retried. A fault of another
    // cause (a page the kernel could not supply) would repeat at the same
    // address: after a few in a row it is not ours.
    // relaxed: a hint across threads that fault at once; a miscount only
    // shifts when the guard gives up.
    struct timespec ts {};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
    const uint64_t now = static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
    const uintptr_t last = g_segment.last_retried.exchange(addr, std::memory_order_relaxed);
    const uint64_t last_ns = g_segment.last_retried_ns.exchange(now, std::memory_order_relaxed);
    const bool again = last == addr && now - last_ns < kRetryWindowNs;
    if (!again) g_segment.retried_in_a_row.store(0, std::memory_order_relaxed);
    return g_segment.retried_in_a_row.fetch_add(1, std::memory_order_relaxed) < kWholeRetries;
  }
  if (::ftruncate(fd, bytes) != 0) return false;
  g_segment.regrowths.fetch_add(1, std::memory_order_relaxed);  // relaxed: a count the consumer polls
  return true;
}

void on_sigbus(int signo, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (regrow_segment(addr)) return;
  for (Range& r : g_ranges) {
    // SYNC(guard_range): pairs with guard_range()'s release of begin (end is set first).
    const uintptr_t begin = r.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= r.end.load(std::memory_order_relaxed))
      continue;  // relaxed: ordered by begin
    const auto page_size = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    void* page = reinterpret_cast<void*>(addr & ~(page_size - 1));
    // A raw syscall on Linux: safe here in practice (as JVMs do).
    if (::mmap(page, page_size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
      r.poisoned.store(1, std::memory_order_relaxed);  // relaxed: read by the consumer after the access returns
      return;
    }
    break;
  }
  // Not ours: what would have happened without the guard.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(signo, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signo);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);
  ::raise(SIGBUS);
}

}  // namespace

void install_peer_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous);
  });
}

GuardId guard_range(const void* begin, size_t bytes) {
  if (bytes == 0) return 0;
  for (uint32_t i = 0; i < kGuardedRanges; ++i) {
    Range& r = g_ranges[i];
    if (r.begin.load(std::memory_order_relaxed) != 0) continue;  // relaxed: only the consumer writes
    r.poisoned.store(0, std::memory_order_relaxed);
    r.end.store(reinterpret_cast<uintptr_t>(begin) + bytes, std::memory_order_relaxed);
    // SYNC(guard_range): the handler that sees begin sees end too.
    r.begin.store(reinterpret_cast<uintptr_t>(begin), std::memory_order_release);
    return i + 1;
  }
  return 0;
}

void release_range(GuardId id) {
  if (id == 0 || id > kGuardedRanges) return;
  g_ranges[id - 1].begin.store(0, std::memory_order_release);  // SYNC(guard_range): the range is free
}

void guard_segment(const void* begin, size_t bytes, int fd) {
  g_segment.begin.store(0, std::memory_order_release);  // SYNC(guard_segment): none while the words change
  struct stat st {};
  if (begin == nullptr || bytes == 0 || fd < 0 || ::fstat(fd, &st) != 0) return;
  g_segment.fd.store(fd, std::memory_order_relaxed);
  g_segment.inode.store(st.st_ino, std::memory_order_relaxed);
  g_segment.end.store(reinterpret_cast<uintptr_t>(begin) + bytes, std::memory_order_relaxed);
  // SYNC(guard_segment): the handler that sees begin sees end and fd too.
  g_segment.begin.store(reinterpret_cast<uintptr_t>(begin), std::memory_order_release);
}

void unguard_segment(const void* begin) {
  uintptr_t expected = reinterpret_cast<uintptr_t>(begin);
  // SYNC(guard_segment): none from here.
  g_segment.begin.compare_exchange_strong(expected, 0, std::memory_order_release, std::memory_order_relaxed);
}

uint64_t segment_regrowths() {
  return g_segment.regrowths.load(std::memory_order_relaxed);  // relaxed: a count; the pages are the kernel's
}

bool range_poisoned(GuardId id) {
  if (id == 0 || id > kGuardedRanges) return false;
  return g_ranges[id - 1].poisoned.load(std::memory_order_relaxed) !=
         0;  // relaxed: set by a handler on this or an OpenMP thread that has returned
}

}  // namespace shmps::server
