// What --device names, as text: a GPU's UUID as `nvidia-smi -L` prints it
// ("GPU-" and 32 hex digits in the groups 8-4-4-4-12, lower case), matched
// against the 16 bytes CUDA reports (cudaDeviceProp::uuid) without regard
// to case. Plain C++, no CUDA: the CUDA backend and the option check use
// it, and tests run it on any build. Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace shmps::server {

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" for the UUID's bytes, as
// nvidia-smi -L prints it.
std::string device_uuid_text(const uint8_t (&uuid)[16]);

// Whether `spec` has the form of a UUID spec: "GPU-" in any case and
// something after it (the option check; the backend decides whether such
// a device exists).
bool is_device_uuid_spec(std::string_view spec);

// Whether `spec` names the device of these UUID bytes: equal to
// device_uuid_text(uuid) but for case (nvidia-smi prints "GPU-" in upper
// case and the digits in lower case; a spec typed otherwise names the same
// device).
bool device_uuid_matches(std::string_view spec, const uint8_t (&uuid)[16]);

}  // namespace shmps::server
