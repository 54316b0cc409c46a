#include "service.hpp"

#include <systemd/sd-daemon.h>

#include <cstdlib>
#include <cstring>

#include "shmps/server/log.hpp"

namespace shmps::server {

ServiceNotifier ServiceNotifier::from_environment() {
  ServiceNotifier n;
  const char* socket = std::getenv("NOTIFY_SOCKET");
  n.enabled_ = socket != nullptr && socket[0] != '\0';
  if (!n.enabled_) return n;
  uint64_t usec = 0;
  if (sd_watchdog_enabled(/*unset_environment=*/0, &usec) > 0) n.watchdog_ns_ = usec * 1000;
  return n;
}

void ServiceNotifier::send(const std::string& message) {
  if (!enabled_) return;
  // unset_environment=0: a reload or a later message needs $NOTIFY_SOCKET again.
  const int r = sd_notify(0, message.c_str());
  if (r <= 0 && !warned_) {
    warned_ = true;
    log::warn("sd_notify to $NOTIFY_SOCKET failed (" + std::string(r < 0 ? std::strerror(-r) : "not sent") +
              "); systemd may consider the service dead");
  }
}

void ServiceNotifier::ready(std::string_view status) { send("READY=1\nSTATUS=" + std::string(status)); }
void ServiceNotifier::status(std::string_view status) { send("STATUS=" + std::string(status)); }
void ServiceNotifier::watchdog() { send("WATCHDOG=1"); }
void ServiceNotifier::reloading(uint64_t monotonic_ns) {
  send("RELOADING=1\nMONOTONIC_USEC=" + std::to_string(monotonic_ns / 1000));
}
void ServiceNotifier::stopping(std::string_view status) { send("STOPPING=1\nSTATUS=" + std::string(status)); }
void ServiceNotifier::extend_timeout(std::chrono::microseconds allowance) {
  send("EXTEND_TIMEOUT_USEC=" + std::to_string(allowance.count()));
}

std::chrono::microseconds checkpoint_io_allowance(uint64_t total_elements, uint64_t files) {
  constexpr uint64_t kBytesPerSecond = 20'000'000;
  const uint64_t bytes = total_elements * sizeof(float) * 7;  // at most 2^40 elements: no overflow
  const std::chrono::microseconds one =
      std::chrono::seconds(30) + std::chrono::microseconds(bytes / (kBytesPerSecond / 1'000'000));
  constexpr auto kMost = std::chrono::microseconds::max();
  if (files != 0 && static_cast<uint64_t>(one.count()) > static_cast<uint64_t>(kMost.count()) / files) return kMost;
  return one * static_cast<int64_t>(files);
}

}  // namespace shmps::server
