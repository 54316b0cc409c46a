// shmps::ErrorCode, Status and Result<T>: the error vocabulary of every shmps
// module and of the wire protocol (a completion carries an ErrorCode).
// Plain values; safe to copy between threads. No Boost or CUDA types here:
// this header is part of worker_lib's public API.
#pragma once

#include <cstdint>
#include <exception>
#include <iosfwd>
#include <string>
#include <string_view>
#include <utility>

namespace shmps {

// Crosses process boundaries: values are explicit and never reused.
// When adding a code, append it and extend error_code_name().
enum class ErrorCode : uint32_t {
  kOk = 0,
  kStale = 1,              // push: staleness > max_staleness; nothing applied
  kBadLength = 2,          // push/pull: byte length does not match the tensor(s)
  kBadDtype = 3,           // push: gradient dtype unknown or unsupported
  kNonFinite = 4,          // push, init: NaN or Inf in the gradient or weights (unless allowed)
  kUnknownWorker = 5,      // request names a worker id that is not attached
  kUnknownBuffer = 6,      // request names a buffer id that is not registered
  kUnknownTensor = 7,      // request names a tensor id outside the tensor table
  kBadRange = 8,           // offset + length outside the registered buffer
  kBadRequest = 9,         // garbage descriptor: unknown opcode, flags, lease; a push version ahead of the server
  kBusy = 10,              // ring full for longer than the call's timeout
  kTimeout = 11,           // no completion within the call's timeout; a pull held by --staleness-policy wait that long
  kServerNotRunning = 12,  // no segment of that name, or its server is dead
  kServerRestarted = 13,   // the worker's session ended: the server restarted, or evicted it (reconnect)
  kLayoutMismatch = 14,    // segment of another layout version / foreign file
  kPermission = 15,        // EACCES/EPERM on a segment or buffer object
  kNoCapacity = 16,        // max workers / buffers reached, or shm too small
  kInvalidArgument = 17,   // caller-side argument error (bad option, name, ...)
  kIo = 18,                // a system call failed; message has errno text
  kShuttingDown = 19,      // server is stopping and takes no new requests
  kCuda = 20,              // a CUDA runtime call failed; message names it
  kInternal = 21,          // a broken invariant inside shmps (a bug)
  kInitRefused = 22,       // init: the weights were already initialised, or a push already applied
  kInterrupted = 23,       // a wait ended by WorkerOptions::interrupted; a held pull its worker cancelled
};
inline constexpr ErrorCode kLastErrorCode = ErrorCode::kInterrupted;

// Short stable name, e.g. "stale"; "unknown" for values outside the enum.
std::string_view error_code_name(ErrorCode code) noexcept;

// The text a message about a failed system call carries for its errno:
// "No such file or directory (errno 2)" (strerror, then the number, which
// stays searchable whatever the locale).
std::string errno_text(int err);
// A 64-bit value a message names as bits (a magic, a generation, a hash):
// "0x0123456789abcdef".
std::string hex64(uint64_t v);
// Prints error_code_name(code) (for logs and test diagnostics).
std::ostream& operator<<(std::ostream& os, ErrorCode code);

// A code plus a human-readable message. ok() iff code == kOk.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const noexcept { return code_ == ErrorCode::kOk; }
  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "stale: staleness 3 > max_staleness 1"
  std::string to_string() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

// Thrown by Result<T>::value() (and *, ->) on a Result that holds an
// error, as std::expected::value() throws bad_expected_access: code that
// skips the ok() check fails with the error's own message instead of
// reading an empty value. what() is status().to_string().
class BadResultAccess : public std::exception {
 public:
  explicit BadResultAccess(Status status);
  const Status& status() const noexcept { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

namespace detail {
[[noreturn]] void throw_bad_result_access(const Status& status);
}  // namespace detail

// A value or a non-ok Status. T must be default-constructible and movable.
// Check ok() before using the value: value(), operator* and operator->
// throw BadResultAccess when it holds an error.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}          // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  Result(ErrorCode code, std::string message) : status_(code, std::move(message)) {}

  bool ok() const noexcept { return status_.ok(); }
  const Status& status() const noexcept { return status_; }
  T& value() & {
    check();
    return value_;
  }
  const T& value() const& {
    check();
    return value_;
  }
  T&& value() && {
    check();
    return std::move(value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  void check() const {
    if (!status_.ok()) [[unlikely]]
      detail::throw_bad_result_access(status_);
  }

  T value_{};
  Status status_;
};

}  // namespace shmps
