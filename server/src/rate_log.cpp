#include "rate_log.hpp"

#include <cstdio>

#include "shmps/server/log.hpp"

namespace shmps::server {

std::string fixed1(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

LogLevel RejectionLog::level(ErrorCode code) {
  return code == ErrorCode::kStale || code == ErrorCode::kInitRefused ? LogLevel::kInfo : LogLevel::kWarn;
}

void RejectionLog::write(ErrorCode code, Cause& c, std::string line) {
  if (c.unreported > 0)
    line += " (+" + std::to_string(c.unreported) + " more '" + std::string(error_code_name(code)) +
            "' since the last report)";
  log::write(level(code), line);
  c.unreported = 0;
}

void RejectionLog::flush(uint64_t now, bool all) {
  for (uint32_t cause = 0; cause < shm::kRejectCauses; ++cause) {
    Cause& c = causes_[cause];
    if (c.unreported == 0 || (!all && now - c.last_ns < kWindowNs)) continue;
    const auto code = static_cast<ErrorCode>(cause);
    log::write(level(code), std::to_string(c.unreported) + " more '" + std::string(error_code_name(code)) +
                                "' rejections in the last " + fixed1(static_cast<double>(now - c.last_ns) / 1e9) +
                                " s");
    c.unreported = 0;
    c.last_ns = now;
  }
}

void WorkerLineLog::write(LogLevel level, const std::string& line, uint64_t now) {
  if (!log::enabled(level)) return;
  flush(now);
  if (lines_ >= kLinesPerSecond) {
    ++suppressed_;
    return;
  }
  ++lines_;
  log::write(level, line);
}

void WorkerLineLog::flush(uint64_t now, bool all) {
  if (!all && now - window_start_ < RejectionLog::kWindowNs) return;
  if (suppressed_ > 0)
    log::warn(std::to_string(suppressed_) + " more worker attach/detach/death/eviction lines in the last " +
              fixed1(static_cast<double>(now - window_start_) / 1e9) + " s not logged (more than " +
              std::to_string(kLinesPerSecond) + " per second)");
  window_start_ = now;
  lines_ = 0;
  suppressed_ = 0;
}

}  // namespace shmps::server
