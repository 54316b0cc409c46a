// Helpers for the kernel tests: the comparison tolerance, mismatch dumps
// (index, inputs, expected, actual) and a tensor holder with its state
// arrays. Single-threaded test code.
#pragma once

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "shmps/kernels/optimizer.hpp"

namespace shmps::kernels::test {

// fp32 tolerance against PyTorch: |actual - expected| <= kAbsTol + kRelTol * |expected|.
// Not bitwise: PyTorch's CPU kernels fuse multiply-adds (FMA, both its vector
// and scalar paths) and take sqrt from MKL VML (+-1 ulp), while update.hpp
// rounds every operation separately and exactly. Each op may thus differ by
// ~1 ulp (2^-24 relative); over 5 steps of <= 8 ops, with momentum carrying
// errors forward, a few ulp of the values (~1e-6 relative) bounds it.
// kAbsTol covers elements near 0, where an ulp of the update (lr * g ~ 1e-1)
// is larger than an ulp of the result: 1e-7 ~ 1 ulp of 1.
constexpr double kRelTol = 1e-6;
constexpr double kAbsTol = 1e-7;

inline bool close(float expected, float actual) {
  if (std::isnan(expected) || std::isnan(actual)) return std::isnan(expected) && std::isnan(actual);
  const double diff = std::fabs(static_cast<double>(actual) - static_cast<double>(expected));
  return diff <= kAbsTol + kRelTol * std::fabs(static_cast<double>(expected));
}

// Exact text of a float ("%.9g" reads back as the same value).
inline std::string num(float value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(value));
  return text;
}

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Compares two arrays; on mismatch reports each bad index (the first 16)
// with its inputs, so a failure can be reproduced from the log alone.
// `inputs(i)` returns a text describing element i's inputs.
template <class Inputs>
void check_arrays(const std::string& what, const float* expected, const float* actual, uint64_t n, bool bitwise,
                  Inputs&& inputs) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const bool ok = bitwise ? same_bits(expected[i], actual[i]) : close(expected[i], actual[i]);
    if (ok) continue;
    if (++bad <= 16) {
      char line[256];
      std::snprintf(line, sizeof line, "%s: index %llu expected %.9g actual %.9g (diff %.3g)", what.c_str(),
                    static_cast<unsigned long long>(i), static_cast<double>(expected[i]),
                    static_cast<double>(actual[i]), static_cast<double>(actual[i]) - static_cast<double>(expected[i]));
      BOOST_ERROR(std::string(line) + " inputs: " + inputs(i));
    }
  }
  if (bad > 16) BOOST_ERROR(what + ": " + std::to_string(bad) + " mismatches in total");
}

// Weights plus every state array the config needs, zero-initialised like
// PyTorch's lazily created state.
struct Tensor {
  std::vector<float> weights;
  std::vector<float> state[3];

  Tensor(const OptimizerConfig& config, std::vector<float> initial) : weights(std::move(initial)) {
    for (size_t s = 0; s < state_arrays(config); ++s) state[s].assign(weights.size(), 0.0f);
  }
  TensorState view() {
    TensorState t;
    t.weights = weights.data();
    for (int s = 0; s < 3; ++s) t.state[s] = state[s].empty() ? nullptr : state[s].data();
    t.n = weights.size();
    return t;
  }
};

}  // namespace shmps::kernels::test
