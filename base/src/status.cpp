#include "shmps/status.hpp"

#include <cstdio>
#include <cstring>
#include <ostream>

namespace shmps {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kStale:
      return "stale";
    case ErrorCode::kBadLength:
      return "bad_length";
    case ErrorCode::kBadDtype:
      return "bad_dtype";
    case ErrorCode::kNonFinite:
      return "non_finite";
    case ErrorCode::kUnknownWorker:
      return "unknown_worker";
    case ErrorCode::kUnknownBuffer:
      return "unknown_buffer";
    case ErrorCode::kUnknownTensor:
      return "unknown_tensor";
    case ErrorCode::kBadRange:
      return "bad_range";
    case ErrorCode::kBadRequest:
      return "bad_request";
    case ErrorCode::kBusy:
      return "busy";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kServerNotRunning:
      return "server_not_running";
    case ErrorCode::kServerRestarted:
      return "server_restarted";
    case ErrorCode::kLayoutMismatch:
      return "layout_mismatch";
    case ErrorCode::kPermission:
      return "permission";
    case ErrorCode::kNoCapacity:
      return "no_capacity";
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kIo:
      return "io";
    case ErrorCode::kShuttingDown:
      return "shutting_down";
    case ErrorCode::kCuda:
      return "cuda";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kInitRefused:
      return "init_refused";
    case ErrorCode::kInterrupted:
      return "interrupted";
  }
  return "unknown";
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::ostream& operator<<(std::ostream& os, ErrorCode code) { return os << error_code_name(code); }

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s(error_code_name(code_));
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

BadResultAccess::BadResultAccess(Status status) : status_(std::move(status)), what_(status_.to_string()) {}

namespace detail {
void throw_bad_result_access(const Status& status) { throw BadResultAccess(status); }
}  // namespace detail

}  // namespace shmps
