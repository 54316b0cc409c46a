// --fed-store, the place where the hosts of a Gloo federation meet: its
// form, parsed alike by the configuration's check (--check-config, a
// reload) and by the Gloo plugin that opens it. Header only: the plugin
// links no server code.
#pragma once

#include <charconv>
#include <string>
#include <string_view>

#include "shmps/status.hpp"

namespace shmps::server {

struct FedStoreSpec {
  bool redis = false;
  std::string dir;            // file:DIR
  std::string host;           // redis:HOST[:PORT][/JOB]
  int port = 6379;            //
  std::string job = "shmps";  // the prefix of the job's keys in a shared Redis
};

// "file:DIR" or "redis:HOST[:PORT][/JOB]"; anything else is refused with
// the forms in the message. Only the form: whether DIR can be made or
// HOST answers is found when the server opens the store.
inline Result<FedStoreSpec> parse_fed_store(const std::string& spec) {
  const auto refuse = [&spec] {
    return Status{ErrorCode::kInvalidArgument,
                  "--fed-store must be file:DIR or redis:HOST[:PORT][/JOB], got '" + spec + "'"};
  };
  FedStoreSpec out;
  const std::string_view s = spec;
  if (s.starts_with("file:")) {
    out.dir = spec.substr(5);
    if (out.dir.empty()) return refuse();
    return out;
  }
  if (!s.starts_with("redis:")) return refuse();
  std::string_view rest = s.substr(6);
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    out.job = std::string(rest.substr(slash + 1));
    rest = rest.substr(0, slash);
    if (out.job.empty()) return refuse();
  }
  // The port after the last colon (a host may be an IPv6 address in
  // brackets).
  if (const size_t colon = rest.rfind(':'); colon != std::string_view::npos && rest.back() != ']') {
    const std::string_view digits = rest.substr(colon + 1);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), out.port);
    if (digits.empty() || ec != std::errc{} || end != digits.data() + digits.size() || out.port <= 0 ||
        out.port > 65535)
      return refuse();
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) return refuse();
  out.host = std::string(rest);
  out.redis = true;
  return out;
}

}  // namespace shmps::server
