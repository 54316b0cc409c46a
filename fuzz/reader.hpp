// The fuzz targets' reader of their input: front to back, zeros past the
// end (so that a short input reads as the honest or empty choice), and
// length-prefixed streams within it. Header-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shmps::fuzz {

struct Reader {
  const uint8_t* p = nullptr;
  size_t n = 0;
  bool done() const { return n == 0; }
  uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  void bytes(void* out, size_t k) {
    const size_t take = k < n ? k : n;
    if (take != 0) std::memcpy(out, p, take);
    std::memset(static_cast<uint8_t*>(out) + take, 0, k - take);
    p += take;
    n -= take;
  }
  template <class T>
  T value() {
    T v;
    bytes(&v, sizeof v);
    return v;
  }
  // The next stream: a u16 length, then that many bytes (fewer at the end).
  Reader section() {
    const auto len = value<uint16_t>();
    Reader s{p, len < n ? len : n};
    p += s.n;
    n -= s.n;
    return s;
  }
};

}  // namespace shmps::fuzz
