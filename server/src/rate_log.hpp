// The server's rate-limited log lines, so that a flood of bad requests or a
// crash loop of workers cannot flood the journal: rejections at most one
// line per cause per second (the rest counted and reported with the next
// line, or by flush()), worker lifecycle lines (attached, detached, died,
// evicted) at most WorkerLineLog::kLinesPerSecond a second. Consumer
// thread only.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "shmps/server/config.hpp"
#include "shmps/server/log.hpp"
#include "shmps/shm/layout.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

// "12.3": one decimal, for log lines.
std::string fixed1(double v);

class RejectionLog {
 public:
  static constexpr uint64_t kWindowNs = 1'000'000'000;

  // Stale pushes and refused inits are routine in asynchronous training
  // (info); anything else is a bug or an attack on the worker side (warn).
  static LogLevel level(ErrorCode code);
  // Writes the line make_line() returns for a rejection of `code`
  // ("rejected push from worker 2 (pid 4711): stale: ..."), unless another
  // of that cause was written less than a second ago: then it is counted
  // and the line never made. `now`: monotonic ns.
  template <typename MakeLine>
  void note(ErrorCode code, uint64_t now, MakeLine&& make_line) {
    if (!log::enabled(level(code))) return;
    Cause& c = causes_[static_cast<uint32_t>(code) % shm::kRejectCauses];
    if (c.last_ns != 0 && now - c.last_ns < kWindowNs) {
      ++c.unreported;
      return;
    }
    write(code, c, make_line());
    c.last_ns = now;
  }
  // Reports the counted rejections whose cause's last line is a second old
  // (with `all`: every one, at shutdown).
  void flush(uint64_t now, bool all = false);

 private:
  struct Cause {
    uint64_t last_ns = 0;     // when the last line for this cause was written
    uint64_t unreported = 0;  // rejections since, not logged one by one
  };
  static void write(ErrorCode code, Cause& c, std::string line);
  std::array<Cause, shm::kRejectCauses> causes_{};
};

class WorkerLineLog {
 public:
  static constexpr uint32_t kLinesPerSecond = 20;

  void write(LogLevel level, const std::string& line, uint64_t now);
  // Starts a new one-second window, reporting what the last one suppressed
  // (with `all`: now, at shutdown).
  void flush(uint64_t now, bool all = false);

 private:
  uint64_t window_start_ = 0;
  uint32_t lines_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace shmps::server
