// The harness the CUDA kernel tests share: tensor shapes (lengths and
// alignments), deterministic random inputs, and drivers that run steps on a
// backend (the GPU, or the kernel bodies emulated on the host) and compare it
// with apply_cpu / all_finite_cpu, dumping the inputs on mismatch.
// Single-threaded test code.
#pragma once

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel_test_util.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/kernels/update.hpp"

namespace shmps::kernels::test {

// n elements. The weights start weight_offset floats past a 256-byte
// boundary, every state array state_offset floats past one, the gradient
// grad_offset_elements elements plus grad_offset_bytes bytes past one.
// Together they reach every access plan of the kernels: 16-byte vectors
// with and without a scalar head (offsets that the same element offset
// aligns), element loads (gradient or state not co-aligned with the
// weights), byte loads (gradient at an odd byte offset), odd tails.
struct Shape {
  const char* what;
  uint64_t n;
  uint64_t weight_offset;
  uint64_t state_offset;
  uint64_t grad_offset_elements;
  uint64_t grad_offset_bytes;
};

inline std::vector<Shape> apply_shapes(bool large) {
  std::vector<Shape> shapes = {
      {"1 element", 1, 0, 0, 0, 0},
      {"7 elements", 7, 0, 0, 0, 0},
      {"1000 elements", 1000, 0, 0, 0, 0},
      {"1003, all arrays 1 element off", 1003, 1, 1, 1, 0},
      {"4101, all arrays 2 elements off", 4101, 2, 2, 2, 0},
      {"4099, all arrays 3 elements off", 4099, 3, 3, 3, 0},
      {"4099, gradient 1 element off", 4099, 0, 0, 1, 0},
      {"2053, state 1 element off", 2053, 0, 1, 0, 0},
      {"5000, gradient 1 byte off", 5000, 0, 0, 0, 1},
      {"777, weights 1 element off, gradient 3 bytes off", 777, 1, 1, 0, 3},
      {"65537 elements", 65537, 0, 0, 0, 0},
  };
  if (large) shapes.push_back({"10000019 elements", 10'000'019, 0, 0, 0, 0});
  return shapes;
}

inline const char* dtype_name(GradDtype dtype) {
  switch (dtype) {
    case GradDtype::kF32:
      return "f32";
    case GradDtype::kF16:
      return "f16";
    case GradDtype::kBF16:
      return "bf16";
  }
  return "?";
}

inline std::string describe_config(const OptimizerConfig& c) {
  char text[256];
  std::snprintf(text, sizeof text,
                "%s lr=%.9g momentum=%.9g dampening=%.9g nesterov=%d weight_decay=%.9g beta1=%.9g "
                "beta2=%.9g eps=%.9g amsgrad=%d",
                optimizer_kind_name(c.kind), static_cast<double>(c.lr), static_cast<double>(c.momentum),
                static_cast<double>(c.dampening), c.nesterov ? 1 : 0, static_cast<double>(c.weight_decay),
                static_cast<double>(c.beta1), static_cast<double>(c.beta2), static_cast<double>(c.eps),
                c.amsgrad ? 1 : 0);
  return text;
}

// splitmix64: fast and deterministic, so 10M-element inputs cost
// milliseconds and every run sees the same numbers.
inline uint64_t next_random(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Weights of both signs, magnitudes 2^-4 .. 2^2.
inline std::vector<float> random_weights(uint64_t n, uint64_t seed) {
  std::vector<float> w(n);
  uint64_t state = seed;
  for (float& x : w) {
    const uint64_t r = next_random(state);
    const uint32_t bits = static_cast<uint32_t>(r >> 63) << 31 | (123u + static_cast<uint32_t>(r % 6)) << 23 |
                          static_cast<uint32_t>(r >> 20 & 0x7FFFFFu);
    x = float_from_bits(bits);
  }
  return w;
}

// n gradient elements of `dtype` as raw little-endian bytes: finite, both
// signs, magnitudes 2^-10 .. 2^6, every 97th zero, for f16 every 17th a
// subnormal (the conversion's other path).
inline std::vector<unsigned char> random_grad(GradDtype dtype, uint64_t n, uint64_t seed) {
  const size_t size = dtype_size(dtype);
  std::vector<unsigned char> bytes(n * size);
  uint64_t state = seed;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t r = next_random(state);
    const uint32_t sign = static_cast<uint32_t>(r >> 63);
    const uint32_t scale = static_cast<uint32_t>(r % 17);  // 2^-10 .. 2^6
    if (dtype == GradDtype::kF32) {
      const uint32_t bits =
          i % 97 == 0 ? 0u : sign << 31 | (117u + scale) << 23 | static_cast<uint32_t>(r >> 20 & 0x7FFFFFu);
      std::memcpy(&bytes[i * 4], &bits, 4);
    } else {
      uint16_t bits;
      if (dtype == GradDtype::kF16) {
        const uint32_t exponent = i % 17 == 0 ? 0u : 5u + scale;
        bits = static_cast<uint16_t>(sign << 15 | exponent << 10 | static_cast<uint32_t>(r >> 20 & 0x3FFu));
      } else {
        bits = static_cast<uint16_t>(sign << 15 | (117u + scale) << 7 | static_cast<uint32_t>(r >> 20 & 0x7Fu));
      }
      if (i % 97 == 0) bits = 0;
      std::memcpy(&bytes[i * 2], &bits, 2);
    }
  }
  return bytes;
}

// Element i of raw gradient bytes, widened to fp32 (for the dumps).
inline float grad_value(GradDtype dtype, const unsigned char* bytes, uint64_t i) {
  if (dtype == GradDtype::kF32) {
    float value;
    std::memcpy(&value, bytes + i * 4, 4);
    return value;
  }
  uint16_t bits;
  std::memcpy(&bits, bytes + i * 2, 2);
  return dtype == GradDtype::kF16 ? f16_to_float(bits) : bf16_to_float(bits);
}

// Bitwise equal, or both NaN (a NaN's payload may differ between CPU and GPU).
inline bool same_value(float expected, float actual) {
  return same_bits(expected, actual) || (std::isnan(expected) && std::isnan(actual));
}

// Compares n values; reports the first 8 mismatches with index, inputs,
// expected and actual, and the total. Returns the number of mismatches.
template <class Inputs>
uint64_t compare_bits(const std::string& what, const float* expected, const float* actual, uint64_t n,
                      Inputs&& inputs) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    if (same_value(expected[i], actual[i])) continue;
    if (++bad <= 8) {
      char line[256];
      std::snprintf(line, sizeof line, "%s: index %llu expected %.9g actual %.9g (diff %.3g)", what.c_str(),
                    static_cast<unsigned long long>(i), static_cast<double>(expected[i]),
                    static_cast<double>(actual[i]), static_cast<double>(actual[i]) - static_cast<double>(expected[i]));
      BOOST_ERROR(std::string(line) + "; inputs " + inputs(i));
    }
  }
  if (bad > 8) BOOST_ERROR(what + ": " + std::to_string(bad) + " of " + std::to_string(n) + " differ");
  return bad;
}

// Runs `steps` optimizer steps on `backend` and on apply_cpu from the same
// inputs and requires bitwise equal weights and state after every step.
// Backend: unsigned char* alloc(bytes) (zeroed, 256-byte aligned, owned by
// the backend), upload(dst, src, bytes), download(dst, src, bytes),
// apply(config, tensor, grad, dtype, step) (synchronous; fails the test on
// error).
template <class Backend>
void run_against_cpu(Backend& backend, const OptimizerConfig& config, GradDtype dtype, const Shape& shape, int steps,
                     uint64_t seed) {
  const uint64_t n = shape.n;
  const size_t size = dtype_size(dtype);
  const size_t states = state_arrays(config);
  Tensor ref(config, random_weights(n, seed));
  TensorState device;
  device.n = n;
  device.weights =
      reinterpret_cast<float*>(backend.alloc((n + shape.weight_offset) * sizeof(float))) + shape.weight_offset;
  backend.upload(device.weights, ref.weights.data(), n * sizeof(float));
  for (size_t s = 0; s < states; ++s) {
    device.state[s] =
        reinterpret_cast<float*>(backend.alloc((n + shape.state_offset) * sizeof(float))) + shape.state_offset;
  }
  const uint64_t grad_offset = shape.grad_offset_elements * size + shape.grad_offset_bytes;
  unsigned char* grad = backend.alloc(n * size + grad_offset) + grad_offset;
  std::vector<float> actual(n);
  for (int step = 1; step <= steps; ++step) {
    const std::vector<unsigned char> g = random_grad(dtype, n, seed * 1000 + static_cast<uint64_t>(step));
    backend.upload(grad, g.data(), g.size());
    const Tensor before = ref;
    apply_cpu(config, ref.view(), g.data(), dtype, static_cast<uint64_t>(step));
    backend.apply(config, device, grad, dtype, static_cast<uint64_t>(step));
    const auto inputs = [&](uint64_t i) {
      std::string text = "w=" + num(before.weights[i]) + " g=" + num(grad_value(dtype, g.data(), i));
      for (size_t s = 0; s < states; ++s) text += " state" + std::to_string(s) + "=" + num(before.state[s][i]);
      return text;
    };
    const std::string after = " after step " + std::to_string(step);
    uint64_t bad = 0;
    backend.download(actual.data(), device.weights, n * sizeof(float));
    bad += compare_bits("weights" + after, ref.weights.data(), actual.data(), n, inputs);
    for (size_t s = 0; s < states; ++s) {
      backend.download(actual.data(), device.state[s], n * sizeof(float));
      bad += compare_bits("state " + std::to_string(s) + after, ref.state[s].data(), actual.data(), n, inputs);
    }
    if (bad != 0) return;  // later steps only repeat the damage
  }
}

// all_finite on `backend` against all_finite_cpu: a finite gradient with
// the extreme finite values (largest, smallest subnormal, -0) is finite;
// NaN (quiet, signalling, negative), +Inf or -Inf at the first, second,
// middle, last but one or last element is found. Backend: alloc, upload as
// above; bool all_finite(grad, dtype, n).
template <class Backend>
void run_finite_checks(Backend& backend, GradDtype dtype, const Shape& shape) {
  const uint64_t n = shape.n;
  const size_t size = dtype_size(dtype);
  std::vector<unsigned char> g = random_grad(dtype, n, 77);
  const auto put = [&](uint64_t i, uint32_t bits) { std::memcpy(&g[i * size], &bits, size); };  // little-endian
  const bool f32 = dtype == GradDtype::kF32;
  const bool f16 = dtype == GradDtype::kF16;
  const uint32_t largest = f32 ? 0x7F7FFFFFu : f16 ? 0x7BFFu : 0x7F7Fu;
  const uint32_t negative_zero = f32 ? 0x80000000u : 0x8000u;
  put(n / 3, largest);
  put(n / 4, 1u);  // the smallest subnormal
  put(n - 1 - n / 5, negative_zero);
  const uint64_t grad_offset = shape.grad_offset_elements * size + shape.grad_offset_bytes;
  unsigned char* grad = backend.alloc(n * size + grad_offset) + grad_offset;
  backend.upload(grad, g.data(), g.size());
  BOOST_REQUIRE(all_finite_cpu(g.data(), dtype, n));
  BOOST_TEST(backend.all_finite(grad, dtype, n), "finite gradient reported non-finite");
  const uint32_t nonfinite[] = {
      f32   ? 0x7FC00000u
      : f16 ? 0x7E00u
            : 0x7FC0u,  // quiet NaN
      f32   ? 0x7F800001u
      : f16 ? 0x7C01u
            : 0x7F81u,  // signalling NaN
      f32   ? 0xFFC00000u
      : f16 ? 0xFE00u
            : 0xFFC0u,  // negative NaN
      f32   ? 0x7F800000u
      : f16 ? 0x7C00u
            : 0x7F80u,  // +Inf
      f32   ? 0xFF800000u
      : f16 ? 0xFC00u
            : 0xFF80u,  // -Inf
  };
  const uint64_t positions[] = {0, 1, n / 2, n - 2, n - 1};
  for (const uint64_t i : positions) {
    if (i >= n) continue;
    for (const uint32_t bits : nonfinite) {
      uint32_t saved = 0;
      std::memcpy(&saved, &g[i * size], size);
      put(i, bits);
      backend.upload(grad + i * size, &g[i * size], size);
      BOOST_TEST(!all_finite_cpu(g.data(), dtype, n));
      BOOST_TEST(!backend.all_finite(grad, dtype, n),
                 "bits 0x" << std::hex << bits << std::dec << " at index " << i << " of " << n << " not found");
      put(i, saved);
      backend.upload(grad + i * size, &g[i * size], size);
    }
  }
}

}  // namespace shmps::kernels::test
