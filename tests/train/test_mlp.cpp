// The MLP: the flat parameter layout, He initialisation, the forward loss
// against a double-precision reference, the backward pass against central
// finite differences of that reference, and that SGD with it learns.
#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "mlp.hpp"

using namespace shmps::train;

namespace {

// Mean cross-entropy in double, straight from the definition. `mask`, when
// given, receives the ReLU pattern (1 = active) so callers can tell when a
// perturbation crossed a kink.
double reference_loss(const MlpShape& s, const std::vector<double>& p, const std::vector<float>& x,
                      const std::vector<uint8_t>& y, size_t batch, std::vector<uint8_t>* mask = nullptr) {
  const size_t w1 = 0;
  const size_t b1 = s.hidden * s.inputs;
  const size_t w2 = b1 + s.hidden;
  const size_t b2 = w2 + s.classes * s.hidden;
  if (mask != nullptr) mask->assign(batch * s.hidden, 0);
  std::vector<double> h(s.hidden);
  std::vector<double> z(s.classes);
  double loss = 0.0;
  for (size_t n = 0; n < batch; ++n) {
    for (size_t j = 0; j < s.hidden; ++j) {
      double a = p[b1 + j];
      for (size_t k = 0; k < s.inputs; ++k) a += p[w1 + j * s.inputs + k] * x[n * s.inputs + k];
      h[j] = a > 0 ? a : 0;
      if (mask != nullptr) (*mask)[n * s.hidden + j] = a > 0 ? 1 : 0;
    }
    double zmax = -1e300;
    for (size_t c = 0; c < s.classes; ++c) {
      double a = p[b2 + c];
      for (size_t j = 0; j < s.hidden; ++j) a += p[w2 + c * s.hidden + j] * h[j];
      z[c] = a;
      zmax = std::max(zmax, a);
    }
    double sum = 0.0;
    for (double zc : z) sum += std::exp(zc - zmax);
    loss += std::log(sum) + zmax - z[y[n]];
  }
  return loss / static_cast<double>(batch);
}

struct Problem {
  MlpShape shape;
  size_t batch;
  std::vector<float> params;
  std::vector<float> x;
  std::vector<uint8_t> y;
};

Problem make_problem(const MlpShape& shape, size_t batch, uint64_t seed) {
  Problem pr{shape, batch, std::vector<float>(mlp_parameter_count(shape)), {}, {}};
  he_init(shape, pr.params, seed);
  std::mt19937_64 rng(seed + 100);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  std::normal_distribution<float> small(0.0f, 0.1f);
  // Non-zero biases so their gradients are exercised away from 0.
  for (const ParamTensor& t : mlp_tensors(shape)) {
    if (t.shape.size() == 1) {
      for (size_t i = 0; i < t.count; ++i) pr.params[t.offset + i] = small(rng);
    }
  }
  pr.x.resize(batch * shape.inputs);
  for (float& v : pr.x) v = pixel(rng);
  pr.y.resize(batch);
  for (size_t i = 0; i < batch; ++i) pr.y[i] = static_cast<uint8_t>(rng() % shape.classes);
  return pr;
}

// Central differences of the double reference at the given parameter
// indices against Mlp::loss_and_gradient. Tolerance:
// |analytic - numeric| <= 1e-4 + 1e-3 |numeric| (the analytic gradient is
// fp32; the numeric one double with h = 1e-5 and O(h^2) error).
void check_gradient(const Problem& pr, const std::vector<size_t>& indices) {
  Mlp mlp(pr.shape, pr.batch);
  std::vector<float> grad(mlp.parameter_count(), std::nanf(""));
  const double loss = mlp.loss_and_gradient(pr.params.data(), pr.x.data(), pr.y.data(), pr.batch, grad.data());
  for (float g : grad) BOOST_REQUIRE(std::isfinite(g));  // every entry written

  std::vector<double> p(pr.params.begin(), pr.params.end());
  std::vector<uint8_t> mask;
  std::vector<uint8_t> mask_moved;
  const double ref = reference_loss(pr.shape, p, pr.x, pr.y, pr.batch, &mask);
  BOOST_TEST(loss == ref, boost::test_tools::tolerance(1e-5));

  const double h = 1e-5;
  size_t checked = 0;
  size_t kinks = 0;
  for (size_t i : indices) {
    const double saved = p[i];
    p[i] = saved + h;
    const double up = reference_loss(pr.shape, p, pr.x, pr.y, pr.batch, &mask_moved);
    bool kink = mask_moved != mask;
    p[i] = saved - h;
    const double down = reference_loss(pr.shape, p, pr.x, pr.y, pr.batch, &mask_moved);
    kink = kink || mask_moved != mask;
    p[i] = saved;
    if (kink) {  // the loss is not differentiable there
      ++kinks;
      continue;
    }
    const double numeric = (up - down) / (2 * h);
    const double analytic = grad[i];
    BOOST_TEST_CONTEXT("parameter " << i << ": analytic " << analytic << ", numeric " << numeric) {
      BOOST_TEST(std::abs(analytic - numeric) <= 1e-4 + 1e-3 * std::abs(numeric));
    }
    ++checked;
  }
  BOOST_TEST(kinks * 20 <= indices.size());  // nearly all were checked
  BOOST_TEST_MESSAGE("checked " << checked << " parameters, skipped " << kinks << " at ReLU kinks");
}

}  // namespace

BOOST_AUTO_TEST_SUITE(mlp)

BOOST_AUTO_TEST_CASE(flat_layout_matches_pytorch_linear) {
  const MlpShape s;
  const std::vector<ParamTensor> t = mlp_tensors(s);
  BOOST_REQUIRE_EQUAL(t.size(), 4u);
  BOOST_TEST(t[0].name == "fc1.weight");
  BOOST_TEST(t[0].shape == (std::vector<uint64_t>{256, 784}), boost::test_tools::per_element());
  BOOST_TEST(t[0].offset == 0u);
  BOOST_TEST(t[1].name == "fc1.bias");
  BOOST_TEST(t[1].shape == (std::vector<uint64_t>{256}), boost::test_tools::per_element());
  BOOST_TEST(t[1].offset == 200704u);
  BOOST_TEST(t[2].name == "fc2.weight");
  BOOST_TEST(t[2].shape == (std::vector<uint64_t>{10, 256}), boost::test_tools::per_element());
  BOOST_TEST(t[2].offset == 200960u);
  BOOST_TEST(t[3].name == "fc2.bias");
  BOOST_TEST(t[3].offset == 203520u);
  BOOST_TEST(t[3].count == 10u);
  BOOST_TEST(mlp_parameter_count(s) == 203530u);
}

BOOST_AUTO_TEST_CASE(he_init_is_seeded_with_the_right_scale) {
  const MlpShape s;
  std::vector<float> a(mlp_parameter_count(s));
  std::vector<float> b(a.size());
  std::vector<float> c(a.size());
  he_init(s, a, 7);
  he_init(s, b, 7);
  he_init(s, c, 8);
  BOOST_TEST(a == b);
  BOOST_TEST(a != c);
  for (const ParamTensor& t : mlp_tensors(s)) {
    BOOST_TEST_CONTEXT(t.name) {
      double sum = 0;
      double sq = 0;
      for (size_t i = 0; i < t.count; ++i) {
        sum += a[t.offset + i];
        sq += static_cast<double>(a[t.offset + i]) * a[t.offset + i];
      }
      const double mean = sum / static_cast<double>(t.count);
      const double stddev = std::sqrt(sq / static_cast<double>(t.count) - mean * mean);
      if (t.shape.size() == 1) {
        BOOST_TEST(sq == 0.0);  // biases start at 0
      } else {
        const double want = std::sqrt(2.0 / static_cast<double>(t.shape[1]));
        BOOST_TEST(stddev == want, boost::test_tools::tolerance(0.05));
        BOOST_TEST(std::abs(mean) < 0.1 * want);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(gradient_of_small_net_matches_finite_differences) {
  // Every parameter of a 12-7-4 net on a batch of 5.
  const Problem pr = make_problem(MlpShape{12, 7, 4}, 5, 3);
  std::vector<size_t> all(pr.params.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  check_gradient(pr, all);
}

BOOST_AUTO_TEST_CASE(gradient_of_full_net_matches_finite_differences) {
  // The 784-256-10 net on a batch of 3: a sample of fc1.weight, all of
  // fc1.bias, fc2.weight and fc2.bias.
  const Problem pr = make_problem(MlpShape{}, 3, 5);
  std::vector<size_t> idx;
  std::mt19937_64 rng(11);
  const std::vector<ParamTensor> t = mlp_tensors(pr.shape);
  for (int i = 0; i < 200; ++i) idx.push_back(rng() % t[0].count);
  for (size_t k = 1; k < t.size(); ++k) {
    for (size_t i = 0; i < t[k].count; i += (k == 2 ? 7 : 1)) idx.push_back(t[k].offset + i);
  }
  check_gradient(pr, idx);
}

BOOST_AUTO_TEST_CASE(gradient_is_a_mean_over_the_batch) {
  // Duplicating every example leaves loss and gradient unchanged.
  const Problem pr = make_problem(MlpShape{20, 8, 3}, 4, 9);
  Problem twice = pr;
  twice.batch = 8;
  twice.x.insert(twice.x.end(), pr.x.begin(), pr.x.end());
  twice.y.insert(twice.y.end(), pr.y.begin(), pr.y.end());
  Mlp mlp(pr.shape, 8);
  std::vector<float> g1(mlp.parameter_count());
  std::vector<float> g2(mlp.parameter_count());
  const double l1 = mlp.loss_and_gradient(pr.params.data(), pr.x.data(), pr.y.data(), 4, g1.data());
  const double l2 = mlp.loss_and_gradient(pr.params.data(), twice.x.data(), twice.y.data(), 8, g2.data());
  BOOST_TEST(l1 == l2, boost::test_tools::tolerance(1e-6));
  for (size_t i = 0; i < g1.size(); ++i) BOOST_TEST(g1[i] == g2[i], boost::test_tools::tolerance(1e-4f));
}

BOOST_AUTO_TEST_CASE(sgd_learns_a_separable_problem) {
  // Class c lights up inputs [4c, 4c+4): plain SGD must reach 100 %.
  const MlpShape s{16, 12, 4};
  const size_t n = 64;
  std::vector<float> x(n * s.inputs);
  std::vector<uint8_t> y(n);
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> noise(0.0f, 0.3f);
  for (size_t i = 0; i < n; ++i) {
    y[i] = static_cast<uint8_t>(i % s.classes);
    for (size_t k = 0; k < s.inputs; ++k) x[i * s.inputs + k] = noise(rng) + (k / 4 == y[i] ? 1.0f : 0.0f);
  }
  std::vector<float> p(mlp_parameter_count(s));
  he_init(s, p, 2);
  Mlp mlp(s, 16);
  const EvalResult before = mlp.evaluate(p.data(), x.data(), y.data(), n);
  std::vector<float> g(p.size());
  for (int step = 0; step < 200; ++step) {
    const size_t start = static_cast<size_t>(step % 4) * 16;
    mlp.loss_and_gradient(p.data(), x.data() + start * s.inputs, y.data() + start, 16, g.data());
    for (size_t i = 0; i < p.size(); ++i) p[i] -= 0.1f * g[i];
  }
  const EvalResult after = mlp.evaluate(p.data(), x.data(), y.data(), n);
  BOOST_TEST(after.count == n);
  BOOST_TEST(after.loss < before.loss / 10);
  BOOST_TEST(after.accuracy == 1.0);
}

BOOST_AUTO_TEST_CASE(evaluate_handles_a_partial_last_chunk) {
  const Problem pr = make_problem(MlpShape{10, 6, 3}, 7, 4);
  Mlp chunked(pr.shape, 3);  // chunks of 3, 3, 1
  Mlp whole(pr.shape, 7);
  const EvalResult a = chunked.evaluate(pr.params.data(), pr.x.data(), pr.y.data(), 7);
  const EvalResult b = whole.evaluate(pr.params.data(), pr.x.data(), pr.y.data(), 7);
  BOOST_TEST(a.loss == b.loss, boost::test_tools::tolerance(1e-6));
  BOOST_TEST(a.accuracy == b.accuracy);
  std::vector<double> p(pr.params.begin(), pr.params.end());
  BOOST_TEST(a.loss == reference_loss(pr.shape, p, pr.x, pr.y, 7), boost::test_tools::tolerance(1e-5));
}

// shmps-train re-executes itself with OPENBLAS_CORETYPE when OpenBLAS took
// the CPU for an older one (mlp.hpp): only Intel cores without AVX2 are
// upgraded, only to what the CPU runs.
BOOST_AUTO_TEST_CASE(blas_coretype_upgrades_only_a_fallback_core) {
  using shmps::train::better_blas_coretype;
  using shmps::train::CpuFeatures;
  const CpuFeatures none{}, avx2{true, false}, avx512{true, true};
  BOOST_TEST(better_blas_coretype("Prescott", avx512) == "SkylakeX");
  BOOST_TEST(better_blas_coretype("Prescott", avx2) == "Haswell");
  BOOST_TEST(better_blas_coretype("Nehalem", avx2) == "Haswell");
  BOOST_TEST(better_blas_coretype("Sandybridge", avx512) == "SkylakeX");
  BOOST_TEST(better_blas_coretype("Prescott", none) == "");
  for (const char* kept : {"Haswell", "SkylakeX", "CooperLake", "SapphireRapids", "Zen", "Bulldozer", "", "prescott"})
    BOOST_TEST(better_blas_coretype(kept, avx512) == "", kept);
  // This machine's: a name, and one the rule keeps or upgrades consistently.
  const std::string chosen = shmps::train::blas_corename();
  BOOST_TEST(!chosen.empty());
  const std::string better = better_blas_coretype(chosen, shmps::train::cpu_features());
  BOOST_TEST((better.empty() || better == "Haswell" || better == "SkylakeX"));
}

BOOST_AUTO_TEST_SUITE_END()
