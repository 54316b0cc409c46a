// apply_cpu against PyTorch's own numbers (reference_values.inc, made by
// gen_reference.py), f16/bf16 gradients against their fp32 values, the
// OpenMP split against the serial loop, and gradient alignment.
#define BOOST_TEST_MODULE shmps_kernels
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernel_test_util.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/kernels/update.hpp"

namespace shmps::kernels {
#include "reference_values.inc"
}  // namespace shmps::kernels

namespace shmps::kernels::test {
namespace {

const RefCase& find_case(const std::string& name) {
  for (const RefCase& c : kRefCases) {
    if (name == c.name) return c;
  }
  BOOST_FAIL("no reference case " + name);
  return kRefCases[0];
}

std::string describe(const OptimizerConfig& c) {
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

// Runs kRefSteps steps of the case on fp32 gradients and compares the
// weights after every step and the state after the last with PyTorch's.
void check_reference(const std::string& name) {
  const RefCase& ref = find_case(name);
  BOOST_TEST_CONTEXT("case " << name << ": " << describe(ref.config)) {
    BOOST_REQUIRE(validate(ref.config).ok());
    BOOST_REQUIRE_EQUAL(state_arrays(ref.config), static_cast<size_t>(ref.state_arrays));
    Tensor t(ref.config, std::vector<float>(kRefInitialWeights, kRefInitialWeights + kRefElements));
    for (int step = 0; step < kRefSteps; ++step) {
      const std::vector<float> before = t.weights;
      std::vector<float> state_before[3];
      for (int s = 0; s < 3; ++s) state_before[s] = t.state[s];
      apply_cpu(ref.config, t.view(), kRefGrads[step], GradDtype::kF32, static_cast<uint64_t>(step) + 1);
      const auto inputs = [&](uint64_t i) {
        std::string text = "w=" + num(before[i]) + " g=" + num(kRefGrads[step][i]);
        for (int s = 0; s < ref.state_arrays; ++s) {
          text += " state" + std::to_string(s) + "=" + num(state_before[s][i]);
        }
        return text;
      };
      check_arrays("weights after step " + std::to_string(step + 1), ref.weights[step], t.weights.data(), kRefElements,
                   false, inputs);
      if (step + 1 == kRefSteps) {
        for (int s = 0; s < ref.state_arrays; ++s) {
          check_arrays("state " + std::to_string(s) + " after the last step", ref.state[s], t.state[s].data(),
                       kRefElements, false, inputs);
        }
      }
    }
  }
}

// `n` finite f16 (or bf16) bit patterns of moderate magnitude (1e-3..1e2),
// both signs, from a fixed seed; every 17th is a subnormal/zero for f16.
std::vector<uint16_t> random_half_bits(GradDtype dtype, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> bits(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t sign = rng() & 1u;
    if (dtype == GradDtype::kF16) {
      const uint32_t exponent = i % 17 == 0 ? 0u : 5u + rng() % 17u;  // 2^-10 .. 2^6
      bits[i] = static_cast<uint16_t>(sign << 15 | exponent << 10 | (rng() & 0x3FFu));
    } else {
      const uint32_t exponent = 117u + rng() % 17u;  // 2^-10 .. 2^6
      bits[i] = static_cast<uint16_t>(sign << 15 | exponent << 7 | (rng() & 0x7Fu));
    }
  }
  return bits;
}

std::vector<float> widen(GradDtype dtype, const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    out[i] = dtype == GradDtype::kF16 ? f16_to_float(bits[i]) : bf16_to_float(bits[i]);
  }
  return out;
}

std::vector<float> random_weights(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(n);
  for (float& x : w) x = normal(rng);
  return w;
}

// Every reference case, 3 steps, with half gradients vs the same values as
// fp32: the conversion is exact, so results must be bitwise equal.
void check_half_matches_f32(GradDtype dtype) {
  constexpr size_t kN = 1000;  // not a multiple of any vector width
  for (const RefCase& ref : kRefCases) {
    BOOST_TEST_CONTEXT("case " << ref.name << ": " << describe(ref.config)) {
      Tensor half(ref.config, random_weights(kN, 5));
      Tensor full(ref.config, random_weights(kN, 5));
      for (uint64_t step = 1; step <= 3; ++step) {
        const std::vector<uint16_t> bits = random_half_bits(dtype, kN, static_cast<uint32_t>(step));
        const std::vector<float> values = widen(dtype, bits);
        apply_cpu(ref.config, half.view(), bits.data(), dtype, step);
        apply_cpu(ref.config, full.view(), values.data(), GradDtype::kF32, step);
        check_arrays("weights after step " + std::to_string(step), full.weights.data(), half.weights.data(), kN, true,
                     [&](uint64_t i) { return "g bits " + std::to_string(bits[i]); });
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(optimizers)

BOOST_AUTO_TEST_CASE(sgd_matches_pytorch) { check_reference("sgd"); }
BOOST_AUTO_TEST_CASE(sgd_weight_decay_matches_pytorch) { check_reference("sgd_weight_decay"); }
BOOST_AUTO_TEST_CASE(sgd_momentum_matches_pytorch) { check_reference("sgd_momentum"); }
BOOST_AUTO_TEST_CASE(sgd_momentum_weight_decay_matches_pytorch) { check_reference("sgd_momentum_weight_decay"); }
BOOST_AUTO_TEST_CASE(sgd_momentum_dampening_matches_pytorch) { check_reference("sgd_momentum_dampening"); }
BOOST_AUTO_TEST_CASE(sgd_momentum_dampening_weight_decay_matches_pytorch) {
  check_reference("sgd_momentum_dampening_weight_decay");
}
BOOST_AUTO_TEST_CASE(sgd_nesterov_matches_pytorch) { check_reference("sgd_nesterov"); }
BOOST_AUTO_TEST_CASE(sgd_nesterov_weight_decay_matches_pytorch) { check_reference("sgd_nesterov_weight_decay"); }
BOOST_AUTO_TEST_CASE(adam_matches_pytorch) { check_reference("adam"); }
BOOST_AUTO_TEST_CASE(adam_weight_decay_matches_pytorch) { check_reference("adam_weight_decay"); }
BOOST_AUTO_TEST_CASE(adam_amsgrad_matches_pytorch) { check_reference("adam_amsgrad"); }
BOOST_AUTO_TEST_CASE(adam_amsgrad_weight_decay_matches_pytorch) { check_reference("adam_amsgrad_weight_decay"); }
BOOST_AUTO_TEST_CASE(adam_small_beta1_matches_pytorch) { check_reference("adam_small_beta1"); }
BOOST_AUTO_TEST_CASE(adamw_matches_pytorch) { check_reference("adamw"); }
BOOST_AUTO_TEST_CASE(adamw_amsgrad_matches_pytorch) { check_reference("adamw_amsgrad"); }
BOOST_AUTO_TEST_CASE(adamw_no_weight_decay_matches_pytorch) { check_reference("adamw_no_weight_decay"); }

BOOST_AUTO_TEST_CASE(every_reference_case_has_a_test) {
  // Each case above names one table entry; a new entry needs a new test.
  BOOST_TEST(sizeof kRefCases / sizeof kRefCases[0] == 16u);
}

// PyTorch's first momentum step stores buf = g, ignoring dampening.
BOOST_AUTO_TEST_CASE(sgd_first_step_ignores_dampening) {
  OptimizerConfig config;
  config.lr = 0.5f;
  config.momentum = 0.9f;
  config.dampening = 0.5f;
  Tensor t(config, {1.0f, 2.0f});
  const float grad[2] = {0.25f, -4.0f};
  apply_cpu(config, t.view(), grad, GradDtype::kF32, 1);
  BOOST_TEST(t.state[0][0] == 0.25f);
  BOOST_TEST(t.state[0][1] == -4.0f);
  BOOST_TEST(t.weights[0] == 1.0f - 0.5f * 0.25f);
  BOOST_TEST(t.weights[1] == 2.0f + 0.5f * 4.0f);
  // Second step: buf = 0.9 buf + (1 - 0.5) g.
  apply_cpu(config, t.view(), grad, GradDtype::kF32, 2);
  BOOST_TEST(t.state[0][0] == 0.25f * 0.9f + 0.5f * 0.25f);
}

// Adam's first step moves every weight by lr against the gradient's sign
// (m/sqrt(v) = g/|g| after bias correction) when |g| >> eps.
BOOST_AUTO_TEST_CASE(adam_first_step_moves_by_lr) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kAdam;
  config.lr = 0.01f;
  const std::vector<float> initial = random_weights(64, 1);
  Tensor t(config, initial);
  const std::vector<float> grad = random_weights(64, 2);
  apply_cpu(config, t.view(), grad.data(), GradDtype::kF32, 1);
  for (size_t i = 0; i < initial.size(); ++i) {
    const float expected = initial[i] - (grad[i] > 0 ? 0.01f : -0.01f);
    BOOST_TEST(std::fabs(t.weights[i] - expected) <= 1e-6f,
               "index " << i << " expected " << expected << " actual " << t.weights[i]);
  }
}

BOOST_AUTO_TEST_CASE(f16_gradients_match_f32_values) { check_half_matches_f32(GradDtype::kF16); }
BOOST_AUTO_TEST_CASE(bf16_gradients_match_f32_values) { check_half_matches_f32(GradDtype::kBF16); }

// The gradient may sit at any byte offset in the segment.
BOOST_AUTO_TEST_CASE(unaligned_gradients_give_the_same_result) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kAdamW;
  config.weight_decay = 0.01f;
  config.amsgrad = true;
  constexpr size_t kN = 257;
  const std::vector<float> grad = random_weights(kN, 9);
  Tensor aligned(config, random_weights(kN, 3));
  apply_cpu(config, aligned.view(), grad.data(), GradDtype::kF32, 1);
  for (size_t offset = 1; offset < 4; ++offset) {
    std::vector<unsigned char> bytes(kN * sizeof(float) + 8);
    std::memcpy(bytes.data() + offset, grad.data(), kN * sizeof(float));
    Tensor shifted(config, random_weights(kN, 3));
    apply_cpu(config, shifted.view(), bytes.data() + offset, GradDtype::kF32, 1);
    check_arrays("offset " + std::to_string(offset), aligned.weights.data(), shifted.weights.data(), kN, true,
                 [&](uint64_t i) { return "g=" + num(grad[i]); });
  }
}

BOOST_AUTO_TEST_CASE(empty_tensor_is_a_no_op) {
  OptimizerConfig config;
  TensorState empty;
  apply_cpu(config, empty, nullptr, GradDtype::kF32, 1);
  BOOST_TEST(all_finite_cpu(nullptr, GradDtype::kF32, 0));
}

// lr 0, as a cosine or linear schedule reaches at its end (torch allows
// it): no weight moves (nor AdamW's decay, 1 - 0 * wd), and the state
// advances as for any step.
BOOST_AUTO_TEST_CASE(a_zero_lr_moves_no_weight_and_still_steps_the_state) {
  OptimizerConfig sgd;
  sgd.momentum = 0.9f;
  sgd.weight_decay = 0.1f;
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.weight_decay = 0.1f;
  OptimizerConfig adamw;
  adamw.kind = OptimizerKind::kAdamW;
  for (OptimizerConfig config : {sgd, adam, adamw}) {
    config.lr = 0.0f;
    BOOST_TEST_CONTEXT(describe(config)) {
      BOOST_REQUIRE(validate_update(config).ok());
      const std::vector<float> initial = {1.0f, -2.0f, 0.5f};
      Tensor t(config, initial);
      const float grad[] = {0.25f, 0.5f, -1.0f};
      apply_cpu(config, t.view(), grad, GradDtype::kF32, 1);
      BOOST_TEST(t.weights == initial, boost::test_tools::per_element());
      BOOST_TEST(t.state[0][2] != 0.0f);  // the momentum buffer or Adam's first moment
    }
  }
}

// 3M elements take the OpenMP path (when built with it); the same update
// done in pieces below the parallel threshold runs serially on this thread.
// Elementwise math: results must be bitwise equal.
BOOST_AUTO_TEST_CASE(large_tensor_split_matches_serial) {
  // One thread (no OpenMP, OMP_NUM_THREADS=1) splits nothing: both sides
  // would run the serial loop.
  if (set_cpu_threads(2) < 2) {
    BOOST_TEST_MESSAGE("skipped: updates run on one thread here (built without OpenMP, or OMP_NUM_THREADS=1)");
    set_cpu_threads(0);
    return;
  }
  constexpr size_t kN = 3'000'007;
  constexpr size_t kPiece = 100'003;  // < the 1M-element threshold, odd, so pieces end mid-vector
  OptimizerConfig sgd;
  sgd.momentum = 0.9f;
  sgd.nesterov = true;
  sgd.weight_decay = 1e-4f;
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.amsgrad = true;
  adam.weight_decay = 1e-2f;
  OptimizerConfig adamw;
  adamw.kind = OptimizerKind::kAdamW;
  adamw.weight_decay = 1e-2f;
  const std::vector<float> initial = random_weights(kN, 11);
  const std::vector<uint16_t> half = random_half_bits(GradDtype::kBF16, kN, 12);
  for (const OptimizerConfig& config : {sgd, adam, adamw}) {
    BOOST_TEST_CONTEXT(describe(config)) {
      Tensor whole(config, initial);
      Tensor pieces(config, initial);
      for (uint64_t step = 1; step <= 2; ++step) {
        const std::vector<float> grad = random_weights(kN, static_cast<uint32_t>(100 + step));
        const void* g = step == 1 ? static_cast<const void*>(grad.data()) : half.data();
        const GradDtype dtype = step == 1 ? GradDtype::kF32 : GradDtype::kBF16;
        apply_cpu(config, whole.view(), g, dtype, step);
        for (size_t begin = 0; begin < kN; begin += kPiece) {
          TensorState piece = pieces.view();
          piece.weights += begin;
          for (float*& s : piece.state) {
            if (s != nullptr) s += begin;
          }
          piece.n = std::min(kPiece, kN - begin);
          apply_cpu(config, piece, static_cast<const unsigned char*>(g) + begin * dtype_size(dtype), dtype, step);
        }
        check_arrays("weights after step " + std::to_string(step), pieces.weights.data(), whole.weights.data(), kN,
                     true, [&](uint64_t i) { return "w0=" + num(initial[i]); });
        for (size_t s = 0; s < state_arrays(config); ++s) {
          check_arrays("state " + std::to_string(s), pieces.state[s].data(), whole.state[s].data(), kN, true,
                       [&](uint64_t i) { return "w0=" + num(initial[i]); });
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace shmps::kernels::test
