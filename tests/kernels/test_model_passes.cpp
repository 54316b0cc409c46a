// The model passes (model_passes.hpp) against the obvious scalar loops,
// bit for bit (this file is compiled without FMA contraction, as the
// kernels are), at lengths around the vector widths and from unaligned
// starts, so that the vector body, its remainder and the scalar path all
// run.
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "kernel_test_util.hpp"
#include "shmps/kernels/model_passes.hpp"

namespace shmps::kernels::test {
namespace {

constexpr uint64_t kLengths[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 4096, 4099, 100003};

// n values (at an offset of `skew` floats into the vector, so the start
// is unaligned when skew is odd) around zero, of the sizes a model's
// weights and deltas have.
struct Arrays {
  Arrays(uint64_t length, uint64_t offset, uint32_t seed) : skew(offset), n(length) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.05f);
    for (auto* v : {&a, &b, &c, &d}) {
      v->resize(length + offset);
      for (float& x : *v) x = normal(rng);
    }
  }
  float* at(std::vector<float>& v) { return v.data() + skew; }
  uint64_t skew, n;
  std::vector<float> a, b, c, d;
};

void check_equal(const std::vector<float>& expected, const std::vector<float>& actual, const char* what) {
  BOOST_TEST_REQUIRE(expected.size() == actual.size());
  uint64_t differ = 0;
  for (size_t i = 0; i < expected.size(); ++i) differ += same_bits(expected[i], actual[i]) ? 0 : 1;
  BOOST_TEST(differ == 0u, what << ": " << differ << " of " << expected.size() << " elements differ");
}

template <class F>
void for_each_shape(F&& f) {
  uint32_t seed = 1;
  for (uint64_t n : kLengths)
    for (uint64_t skew : {0, 1}) {
      BOOST_TEST_CONTEXT("n " << n << ", skew " << skew) { f(Arrays(n, skew, seed++)); }
    }
}

}  // namespace

BOOST_AUTO_TEST_CASE(add_adds_elementwise) {
  for_each_shape([](Arrays x) {
    std::vector<float> expected = x.a;
    for (uint64_t i = 0; i < x.n; ++i) expected[x.skew + i] += x.b[x.skew + i];
    add_cpu(x.at(x.a), x.at(x.b), x.n);
    check_equal(expected, x.a, "add_cpu");
  });
}

BOOST_AUTO_TEST_CASE(weighted_difference_matches_the_scalar_loop) {
  for (float weight : {1.0f, 3.0f, 0.0f}) {
    for_each_shape([weight](Arrays x) {
      std::vector<float> expected = x.c;
      for (uint64_t i = 0; i < x.n; ++i) expected[x.skew + i] = weight * (x.a[x.skew + i] - x.b[x.skew + i]);
      weighted_difference_cpu(x.at(x.c), x.at(x.a), x.at(x.b), weight, x.n);
      check_equal(expected, x.c, "weighted_difference_cpu");
    });
  }
}

BOOST_AUTO_TEST_CASE(average_step_updates_the_anchor_and_the_correction) {
  for (float divisor : {1.0f, 3.0f, 7.0f}) {
    for_each_shape([divisor](Arrays x) {
      std::vector<float> anchor = x.a, correction = x.c;  // correction enters as the snapshot
      for (uint64_t i = x.skew; i < x.skew + x.n; ++i) {
        anchor[i] = anchor[i] + x.b[i] / divisor;
        correction[i] = anchor[i] - correction[i];
      }
      average_step_cpu(x.at(x.a), x.at(x.b), divisor, x.at(x.c), x.n);
      check_equal(anchor, x.a, "average_step_cpu anchor");
      check_equal(correction, x.c, "average_step_cpu correction");
    });
  }
}

BOOST_AUTO_TEST_CASE(nesterov_step_is_pytorch_sgd_on_the_negated_mean) {
  const float lr = 0.7f, mu = 0.9f, divisor = 3.0f;
  for (bool started : {false, true}) {
    for_each_shape([&](Arrays x) {
      // a: anchor, d: momentum buffer, b: the sum of deltas, c: snapshot -> correction
      std::vector<float> anchor = x.a, buf = x.d, correction = x.c;
      for (uint64_t i = x.skew; i < x.skew + x.n; ++i) {
        const float g = -(x.b[i] / divisor);
        buf[i] = started ? buf[i] * mu + g : g;
        const float step = g + buf[i] * mu;
        anchor[i] = anchor[i] - step * lr;
        correction[i] = anchor[i] - correction[i];
      }
      nesterov_step_cpu(x.at(x.a), x.at(x.d), x.at(x.b), divisor, NesterovStep{lr, mu, started}, x.at(x.c), x.n);
      check_equal(anchor, x.a, "nesterov_step_cpu anchor");
      check_equal(buf, x.d, "nesterov_step_cpu momentum");
      check_equal(correction, x.c, "nesterov_step_cpu correction");
    });
  }
}

}  // namespace shmps::kernels::test
