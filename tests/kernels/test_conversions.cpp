// f16/bf16 -> f32 conversions (update.hpp) against a slow decoder and at
// their edge values, and all_finite_cpu at every interesting position.
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel_test_util.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/kernels/update.hpp"

namespace shmps::kernels::test {
namespace {

// IEEE binary16 decoded the slow, obvious way.
float slow_f16(uint16_t h) {
  const int sign = h >> 15;
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
  }
  return sign != 0 ? -magnitude : magnitude;
}

// Equal bits, or both NaN with the same sign.
bool same_value(float expected, float actual) {
  if (std::isnan(expected)) return std::isnan(actual) && std::signbit(expected) == std::signbit(actual);
  return same_bits(expected, actual);
}

std::string hex(uint32_t bits) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%04x", bits);
  return text;
}

// Writes `n` elements of `dtype`, all 1.0, at `offset` bytes into `bytes`.
void fill_ones(std::vector<unsigned char>& bytes, GradDtype dtype, size_t n, size_t offset) {
  const size_t size = dtype_size(dtype);
  bytes.assign(offset + n * size, 0);
  for (size_t i = 0; i < n; ++i) {
    unsigned char* at = bytes.data() + offset + i * size;
    if (dtype == GradDtype::kF32) {
      const float one = 1.0f;
      std::memcpy(at, &one, sizeof one);
    } else {
      const uint16_t one = dtype == GradDtype::kF16 ? 0x3C00 : 0x3F80;
      std::memcpy(at, &one, sizeof one);
    }
  }
}

enum class Bad { kNan, kPosInf, kNegInf };

void put_bad(std::vector<unsigned char>& bytes, GradDtype dtype, size_t index, size_t offset, Bad bad) {
  unsigned char* at = bytes.data() + offset + index * dtype_size(dtype);
  if (dtype == GradDtype::kF32) {
    const float value = bad == Bad::kNan      ? std::numeric_limits<float>::quiet_NaN()
                        : bad == Bad::kPosInf ? std::numeric_limits<float>::infinity()
                                              : -std::numeric_limits<float>::infinity();
    std::memcpy(at, &value, sizeof value);
  } else {
    uint16_t bits;
    if (dtype == GradDtype::kF16) {
      bits = bad == Bad::kNan ? 0x7E00 : bad == Bad::kPosInf ? 0x7C00 : 0xFC00;
    } else {
      bits = bad == Bad::kNan ? 0x7FC0 : bad == Bad::kPosInf ? 0x7F80 : 0xFF80;
    }
    std::memcpy(at, &bits, sizeof bits);
  }
}

const char* dtype_name(GradDtype dtype) {
  return dtype == GradDtype::kF32 ? "f32" : dtype == GradDtype::kF16 ? "f16" : "bf16";
}

// For sizes around vector widths, chunk and block boundaries and (the last,
// 3M) above the parallel threshold, kCpuSplitMinElements: all finite is true; one NaN / +Inf / -Inf at
// the first, a middle, a boundary-straddling and the last position is found.
void check_all_finite(GradDtype dtype) {
  const size_t sizes[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 4095, 4096, 4097, 32769, 300'001, 3'000'007};
  for (const size_t n : sizes) {
    for (const size_t offset : {size_t{0}, size_t{1}}) {
      std::vector<unsigned char> bytes;
      fill_ones(bytes, dtype, n, offset);
      const void* data = bytes.data() + offset;
      BOOST_TEST(all_finite_cpu(data, dtype, n), dtype_name(dtype) << " n=" << n << " offset=" << offset);
      std::vector<size_t> positions = {0, n / 2, n - 1};
      for (const size_t p :
           {size_t{7}, size_t{8}, size_t{15}, size_t{16}, size_t{4095}, size_t{4096}, size_t{32767}, size_t{32768}}) {
        if (p < n) positions.push_back(p);
      }
      for (const size_t p : positions) {
        for (const Bad bad : {Bad::kNan, Bad::kPosInf, Bad::kNegInf}) {
          fill_ones(bytes, dtype, n, offset);
          put_bad(bytes, dtype, p, offset, bad);
          BOOST_TEST(!all_finite_cpu(bytes.data() + offset, dtype, n),
                     dtype_name(dtype) << " n=" << n << " offset=" << offset << " bad value " << static_cast<int>(bad)
                                       << " at index " << p << " not found");
        }
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(conversions)

BOOST_AUTO_TEST_CASE(f16_every_value_matches_slow_decoder) {
  int bad = 0;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float expected = slow_f16(static_cast<uint16_t>(h));
    const float actual = f16_to_float(static_cast<uint16_t>(h));
    if (!same_value(expected, actual) && ++bad <= 16) {
      BOOST_ERROR("f16 " << hex(h) << ": expected " << expected << " actual " << actual);
    }
  }
  BOOST_TEST(bad == 0);
}

BOOST_AUTO_TEST_CASE(f16_edge_values) {
  BOOST_TEST(f16_to_float(0x0000) == 0.0f);
  BOOST_TEST(std::signbit(f16_to_float(0x8000)));  // -0 keeps its sign
  BOOST_TEST(f16_to_float(0x8000) == 0.0f);
  BOOST_TEST(f16_to_float(0x3C00) == 1.0f);
  BOOST_TEST(f16_to_float(0xC000) == -2.0f);
  BOOST_TEST(f16_to_float(0x0001) == 0x1.0p-24f);  // smallest subnormal
  BOOST_TEST(f16_to_float(0x8001) == -0x1.0p-24f);
  BOOST_TEST(f16_to_float(0x03FF) == 0x1.FF8p-15f);  // largest subnormal
  BOOST_TEST(f16_to_float(0x0400) == 0x1.0p-14f);    // smallest normal
  BOOST_TEST(f16_to_float(0x7BFF) == 65504.0f);      // max
  BOOST_TEST(f16_to_float(0xFBFF) == -65504.0f);
  BOOST_TEST(f16_to_float(0x7C00) == std::numeric_limits<float>::infinity());
  BOOST_TEST(f16_to_float(0xFC00) == -std::numeric_limits<float>::infinity());
  BOOST_TEST(std::isnan(f16_to_float(0x7E00)));  // quiet NaN
  BOOST_TEST(std::isnan(f16_to_float(0x7C01)));  // signalling NaN, smallest payload
  BOOST_TEST(std::isnan(f16_to_float(0xFFFF)));
  BOOST_TEST(!f16_bits_finite(0x7C00));
  BOOST_TEST(!f16_bits_finite(0x7E00));
  BOOST_TEST(f16_bits_finite(0x7BFF));
}

BOOST_AUTO_TEST_CASE(bf16_every_value_is_the_top_half_of_f32) {
  int bad = 0;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint32_t bits = h << 16;
    float expected;
    std::memcpy(&expected, &bits, sizeof expected);
    const float actual = bf16_to_float(static_cast<uint16_t>(h));
    if (!same_bits(expected, actual) && ++bad <= 16) {
      BOOST_ERROR("bf16 " << hex(h) << ": expected " << expected << " actual " << actual);
    }
  }
  BOOST_TEST(bad == 0);
}

BOOST_AUTO_TEST_CASE(bf16_edge_values) {
  BOOST_TEST(bf16_to_float(0x3F80) == 1.0f);
  BOOST_TEST(bf16_to_float(0xC000) == -2.0f);
  BOOST_TEST(std::signbit(bf16_to_float(0x8000)));
  BOOST_TEST(bf16_to_float(0x0001) == 0x1.0p-133f);  // smallest subnormal
  BOOST_TEST(bf16_to_float(0x0080) == 0x1.0p-126f);  // smallest normal
  BOOST_TEST(bf16_to_float(0x7F7F) == 0x1.FEp127f);  // max
  BOOST_TEST(bf16_to_float(0x7F80) == std::numeric_limits<float>::infinity());
  BOOST_TEST(bf16_to_float(0xFF80) == -std::numeric_limits<float>::infinity());
  BOOST_TEST(std::isnan(bf16_to_float(0x7FC0)));
  BOOST_TEST(std::isnan(bf16_to_float(0x7F81)));
  BOOST_TEST(!bf16_bits_finite(0x7F80));
  BOOST_TEST(!bf16_bits_finite(0xFFC0));
  BOOST_TEST(bf16_bits_finite(0x7F7F));
}

BOOST_AUTO_TEST_CASE(all_finite_f32) { check_all_finite(GradDtype::kF32); }
BOOST_AUTO_TEST_CASE(all_finite_f16) { check_all_finite(GradDtype::kF16); }
BOOST_AUTO_TEST_CASE(all_finite_bf16) { check_all_finite(GradDtype::kBF16); }

BOOST_AUTO_TEST_CASE(all_finite_accepts_extremes) {
  const float values[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f};
  BOOST_TEST(all_finite_cpu(values, GradDtype::kF32, 5));
  const uint16_t f16[] = {0x7BFF, 0xFBFF, 0x0001, 0x8000};
  BOOST_TEST(all_finite_cpu(f16, GradDtype::kF16, 4));
  const uint16_t bf16[] = {0x7F7F, 0xFF7F, 0x0001, 0x8000};
  BOOST_TEST(all_finite_cpu(bf16, GradDtype::kBF16, 4));
}

// all_finite_cpu keeps the sign bit out of its verdict and reads four
// 32-byte vectors per step (32 fp32 or 64 f16/bf16 elements): negative
// finite values, subnormals and -0 inside the vector body (not only in the
// scalar tail, as above) must pass, and every encoding of Inf and NaN
// (signed, signalling, any payload) must be found at every position of
// the first two steps, in the last step and in the scalar tail.
template <class Bits>
void check_signs_and_nan_encodings(GradDtype dtype, const std::vector<Bits>& finite, const std::vector<Bits>& bad) {
  const size_t step = 128 / sizeof(Bits);
  for (const size_t n : {step, 2 * step, 3 * step + 3, size_t{4096 + 37}}) {
    std::vector<Bits> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = finite[i % finite.size()];
    BOOST_TEST(all_finite_cpu(values.data(), dtype, n), dtype_name(dtype) << " n=" << n);
    std::vector<size_t> positions;
    for (size_t p = 0; p < std::min(n, 2 * step); ++p) positions.push_back(p);
    for (size_t p = n - std::min(n, step + 8); p < n; ++p) positions.push_back(p);
    for (const size_t p : positions) {
      for (const Bits b : bad) {
        std::vector<Bits> copy = values;
        copy[p] = b;
        BOOST_TEST(!all_finite_cpu(copy.data(), dtype, n), dtype_name(dtype)
                                                               << " n=" << n << " bits 0x" << std::hex << b << std::dec
                                                               << " at index " << p << " not found");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(all_finite_f32_signs_and_nan_encodings) {
  // max, lowest, +-denorm_min, +-min normal, -0, 0, -1.5, 3, -65504
  check_signs_and_nan_encodings<uint32_t>(
      GradDtype::kF32,
      {0x7F7FFFFFu, 0xFF7FFFFFu, 0x00000001u, 0x80000001u, 0x00800000u, 0x80800000u, 0x80000000u, 0x00000000u,
       0xBFC00000u, 0x40400000u, 0xC77FE000u},
      {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu});
}

BOOST_AUTO_TEST_CASE(all_finite_f16_signs_and_nan_encodings) {
  // max, lowest, +-smallest subnormal, +-min normal, -0, 0, -1.5, 3
  check_signs_and_nan_encodings<uint16_t>(
      GradDtype::kF16, {0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x8400, 0x8000, 0x0000, 0xBE00, 0x4200},
      {0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7FFF, 0xFFFF});
}

BOOST_AUTO_TEST_CASE(all_finite_bf16_signs_and_nan_encodings) {
  // max, lowest, +-smallest subnormal, +-min normal, -0, 0, -1.5, 3
  check_signs_and_nan_encodings<uint16_t>(
      GradDtype::kBF16, {0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x0080, 0x8080, 0x8000, 0x0000, 0xBFC0, 0x4040},
      {0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF});
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace shmps::kernels::test
