// libFuzzer target: any bytes as a control segment image (a mapping of, or
// a file copied from, /dev/shm/shmps.<name>). shm::validate_segment() must
// never fault or read past the image; an image it accepts must then be safe
// to decode the way shmps-inspect does (snapshot, JSON, text), since
// inspect trusts validate_segment's verdict for the geometry. A worker
// validates a copy of the header and tensor table alone: so does this
// target, which must give the same verdict without reading past it.
// Single-threaded, as libFuzzer calls it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "inspect_model.hpp"
#include "shmps/shm/segment.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An exact-size copy on a 64-byte boundary (as a mapping is): ASan
  // reports any read past `size`.
  void* image = nullptr;
  if (::posix_memalign(&image, 64, size == 0 ? 1 : size) != 0) return 0;
  if (size != 0) std::memcpy(image, data, size);
  // While the first byte of SegmentHeader::reserved5 (offset 576) is 0 (as
  // in every valid seed), the layout version is set to this build's: seeds
  // stay valid across a version bump, and setting that byte non-zero lets
  // the fuzzer try other versions.
  constexpr size_t kVersionAt = offsetof(shmps::shm::SegmentHeader, layout_version);
  constexpr size_t kSwitchAt = offsetof(shmps::shm::SegmentHeader, reserved5);
  if (size > kSwitchAt && static_cast<const uint8_t*>(image)[kSwitchAt] == 0)
    std::memcpy(static_cast<char*>(image) + kVersionAt, &shmps::shm::kLayoutVersion, sizeof shmps::shm::kLayoutVersion);
  const shmps::Status valid = shmps::shm::validate_segment(image, size);
  // What an opener validates (copy_and_validate()): a copy of the header
  // and the tensor table alone (zeros past the object's end), with the
  // object's size. The same verdict, and ASan reports any read past the
  // table, which such a copy does not hold.
  if (size >= sizeof(shmps::shm::SegmentHeader)) {
    uint32_t count = 0;
    std::memcpy(&count, static_cast<const char*>(image) + offsetof(shmps::shm::SegmentHeader, tensor_count),
                sizeof count);
    if (count <= shmps::shm::kMaxTensorsLimit) {
      const size_t held = sizeof(shmps::shm::SegmentHeader) + size_t{count} * sizeof(shmps::shm::TensorDesc);
      void* copy = nullptr;
      if (::posix_memalign(&copy, 64, held) != 0) std::abort();
      std::memset(copy, 0, held);
      std::memcpy(copy, image, std::min(held, size));
      if (shmps::shm::validate_segment(copy, size).ok() != valid.ok()) __builtin_trap();
      std::free(copy);
    }
  }
  if (valid.ok()) {
    auto snap = shmps::inspect::take_snapshot(image, size, "fuzz");
    // take_snapshot() runs validate_segment() first: the same verdict.
    if (!snap.ok()) __builtin_trap();
    const std::string json = shmps::inspect::to_json(*snap).dump();
    const std::string text = shmps::inspect::render_text(*snap);
    if (json.empty() || text.empty()) __builtin_trap();
  }
  std::free(image);
  return 0;
}
