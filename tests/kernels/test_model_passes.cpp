// The model passes (model_passes.hpp) against the obvious scalar loops,
// bit for bit (this file is compiled without FMA contraction, as the
// kernels are), at lengths around the vector widths and from unaligned
// starts, so that the vector body, its remainder and the scalar path all
// run.
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
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
      // a: anchor, b: the sum of deltas -> the new anchor, c: snapshot -> correction
      std::vector<float> anchor = x.b, correction = x.c;
      for (uint64_t i = x.skew; i < x.skew + x.n; ++i) {
        anchor[i] = x.a[i] + x.b[i] / divisor;
        correction[i] = anchor[i] - correction[i];
      }
      const std::vector<float> old_anchor = x.a;
      BOOST_TEST(average_step_cpu(x.at(x.a), x.at(x.b), divisor, x.at(x.c), x.n));
      check_equal(anchor, x.b, "average_step_cpu anchor");
      check_equal(old_anchor, x.a, "average_step_cpu's anchor argument");
      check_equal(correction, x.c, "average_step_cpu correction");
    });
  }
}

BOOST_AUTO_TEST_CASE(nesterov_step_is_pytorch_sgd_on_the_negated_mean) {
  const float lr = 0.7f, mu = 0.9f, divisor = 3.0f;
  for (bool started : {false, true}) {
    for_each_shape([&](Arrays x) {
      // a: anchor, d: momentum buffer, b: the sum of deltas -> the new
      // anchor, c: snapshot -> correction; the new momentum into next_buf
      std::vector<float> anchor = x.b, buf = x.d, correction = x.c;
      for (uint64_t i = x.skew; i < x.skew + x.n; ++i) {
        const float g = -(x.b[i] / divisor);
        buf[i] = started ? buf[i] * mu + g : g;
        const float step = g + buf[i] * mu;
        anchor[i] = x.a[i] - step * lr;
        correction[i] = anchor[i] - correction[i];
      }
      const std::vector<float> old_anchor = x.a, old_buf = x.d;
      std::vector<float> next_buf = x.d;  // before the start: untouched, as buf
      BOOST_TEST(nesterov_step_cpu(x.at(x.a), x.at(x.d), x.at(x.b), divisor, NesterovStep{lr, mu, started},
                                   x.at(next_buf), x.at(x.c), x.n));
      check_equal(anchor, x.b, "nesterov_step_cpu anchor");
      check_equal(buf, next_buf, "nesterov_step_cpu momentum");
      check_equal(old_anchor, x.a, "nesterov_step_cpu's anchor argument");
      check_equal(old_buf, x.d, "nesterov_step_cpu's momentum argument");
      check_equal(correction, x.c, "nesterov_step_cpu correction");
    });
  }
}

// The steps say whether every value they wrote is finite: NaN or Inf in
// the sum, or finite values whose step overflows (in the anchor, the
// correction, or the momentum), at the first element, inside a vector
// body and at the last.
BOOST_AUTO_TEST_CASE(outer_steps_report_values_that_are_not_finite) {
  constexpr uint64_t kN = 33;
  const float big = 3e38f, inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const uint64_t at : {uint64_t{0}, uint64_t{17}, kN - 1}) {
    // sum, anchor, snapshot at `at`; the average step's divisor is 1.
    for (const auto& [sum, anchor, snapshot, what] :
         {std::tuple{nan, 0.0f, 0.0f, "NaN in the sum"}, std::tuple{inf, 0.0f, 0.0f, "Inf in the sum"},
          std::tuple{big, big, 0.0f, "an anchor past the float range"},
          std::tuple{big, 0.0f, -big, "a correction past the float range"}}) {
      BOOST_TEST_CONTEXT(what << " at " << at) {
        std::vector<float> a(kN, 0.5f), s(kN, 0.25f), c(kN, 1.0f), buf(kN, 0.0f), next(kN, 0.0f);
        BOOST_TEST(average_step_cpu(a.data(), s.data(), 1.0f, c.data(), kN));
        std::fill(s.begin(), s.end(), 0.25f);
        std::fill(c.begin(), c.end(), 1.0f);
        s[at] = sum, a[at] = anchor, c[at] = snapshot;
        BOOST_TEST(!average_step_cpu(a.data(), s.data(), 1.0f, c.data(), kN));
        // Nesterov, lr 1 and momentum 0: a' = a + sum / divisor, as above.
        std::fill(s.begin(), s.end(), 0.25f);
        std::fill(c.begin(), c.end(), 1.0f);
        s[at] = sum, c[at] = snapshot;
        BOOST_TEST(!nesterov_step_cpu(a.data(), buf.data(), s.data(), 1.0f, NesterovStep{1.0f, 0.0f, false},
                                      next.data(), c.data(), kN));
      }
    }
    // The momentum alone past the float range: b = buf * 0.9 + g.
    std::vector<float> a(kN, 0.0f), s(kN, 0.0f), c(kN, 0.0f), buf(kN, 0.0f), next(kN, 0.0f);
    buf[at] = big;
    s[at] = -big;  // g = big: b = 0.9 big + big overflows
    BOOST_TEST(!nesterov_step_cpu(a.data(), buf.data(), s.data(), 1.0f, NesterovStep{0.0f, 0.9f, true}, next.data(),
                                  c.data(), kN),
               "momentum at " << at);
  }
}

}  // namespace shmps::kernels::test
