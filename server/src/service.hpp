// The daemon's half of systemd's notification protocol (sd_notify(3)):
// READY=1, STATUS=, WATCHDOG=1, RELOADING=1, STOPPING=1 and
// EXTEND_TIMEOUT_USEC= datagrams to
// $NOTIFY_SOCKET. Without $NOTIFY_SOCKET every call is a no-op and costs
// nothing, so the server behaves the same outside systemd.
// Thread safety: one ServiceNotifier is used by one thread (the server's
// consumer thread). Each send is a few system calls: call it every few
// seconds, never per request.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace shmps::server {

// How long reading or writing `files` checkpoints of a model of
// `total_elements` parameters may take: per file 30 s, plus its bytes (at
// most seven fp32 arrays: the weights, three of optimizer state (Adam with
// amsgrad), the federation's anchor, outer momentum and restore base) at
// 20 MB/s, a slow disk's rate.
// Saturates at microseconds::max() rather than wrap. Bounded, so that a
// hung file system still ends in the service manager's SIGKILL.
std::chrono::microseconds checkpoint_io_allowance(uint64_t total_elements, uint64_t files = 1);

class ServiceNotifier {
 public:
  ServiceNotifier() = default;  // disabled: every call is a no-op

  // Enabled when $NOTIFY_SOCKET is set. The watchdog interval comes from
  // sd_watchdog_enabled(): $WATCHDOG_USEC, only if $WATCHDOG_PID is unset
  // or names this process.
  static ServiceNotifier from_environment();

  bool enabled() const noexcept { return enabled_; }
  // WatchdogSec= in nanoseconds; 0 when systemd expects no keep-alives.
  // Callers ping at half of it.
  uint64_t watchdog_ns() const noexcept { return watchdog_ns_; }

  // "READY=1" plus "STATUS=<status>": the service is up (after start or
  // after a reload).
  void ready(std::string_view status);
  void status(std::string_view status);
  // "WATCHDOG=1": the consumer loop is alive.
  void watchdog();
  // "RELOADING=1" (+ MONOTONIC_USEC, which systemd >= 253 wants): a reload
  // began; ready() ends it.
  void reloading(uint64_t monotonic_ns);
  // "STOPPING=1" plus "STATUS=<status>": shutdown began.
  void stopping(std::string_view status);
  // "EXTEND_TIMEOUT_USEC=<allowance>": the start or stop under way may
  // outlast TimeoutStartSec=/TimeoutStopSec= (a large checkpoint to read or
  // write) by up to `allowance`. Never shortens the unit's own timeout.
  void extend_timeout(std::chrono::microseconds allowance);

 private:
  void send(const std::string& message);
  bool enabled_ = false;
  bool warned_ = false;  // a failed send was logged once
  uint64_t watchdog_ns_ = 0;
};

}  // namespace shmps::server
