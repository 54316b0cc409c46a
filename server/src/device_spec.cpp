#include "device_spec.hpp"

#include <cstdio>

namespace shmps::server {
namespace {

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k)
    if (lower(a[k]) != lower(b[k])) return false;
  return true;
}

}  // namespace

std::string device_uuid_text(const uint8_t (&b)[16]) {
  char out[48];
  std::snprintf(out, sizeof out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return out;
}

bool is_device_uuid_spec(std::string_view spec) {
  return spec.size() > 4 && equal_ignoring_case(spec.substr(0, 4), "GPU-");
}

bool device_uuid_matches(std::string_view spec, const uint8_t (&uuid)[16]) {
  return equal_ignoring_case(spec, device_uuid_text(uuid));
}

}  // namespace shmps::server
