// validate(), the optimizer names, state_arrays() and dtype_size().
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "shmps/kernels/optimizer.hpp"

namespace shmps::kernels::test {
namespace {

OptimizerConfig make(OptimizerKind kind) {
  OptimizerConfig c;
  c.kind = kind;
  return c;
}

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

// Applies `mutate` to a valid config of `kind`; validate() must fail with a
// message that starts with `option`.
void expect_rejected(OptimizerKind kind, const std::string& option, const std::function<void(OptimizerConfig&)>& mutate,
                     const std::string& what) {
  OptimizerConfig c = make(kind);
  mutate(c);
  const Status status = validate(c);
  const std::string message = status.message();
  BOOST_TEST((status.code() == ErrorCode::kInvalidArgument));
  BOOST_TEST(starts_with(message, option + " "), optimizer_kind_name(kind) << " with " << what << ": got \"" << message
                                                                           << "\", wanted it to name " << option);
}

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

BOOST_AUTO_TEST_SUITE(options)

BOOST_AUTO_TEST_CASE(validate_accepts_pytorch_defaults) {
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    BOOST_TEST(validate(make(kind)).ok(), optimizer_kind_name(kind));
  }
  OptimizerConfig sgd;
  sgd.momentum = 0.9f;
  sgd.nesterov = true;
  sgd.weight_decay = 1e-4f;
  BOOST_TEST(validate(sgd).ok());
  OptimizerConfig adam = make(OptimizerKind::kAdam);
  adam.beta1 = 0.0f;
  adam.beta2 = 0.0f;
  adam.amsgrad = true;
  BOOST_TEST(validate(adam).ok());
  // Options a kind does not use are ignored.
  OptimizerConfig ignored = make(OptimizerKind::kAdamW);
  ignored.momentum = -1.0f;
  ignored.nesterov = true;
  BOOST_TEST(validate(ignored).ok());
  OptimizerConfig ignored_sgd;
  ignored_sgd.beta2 = 2.0f;
  ignored_sgd.eps = 0.0f;
  BOOST_TEST(validate(ignored_sgd).ok());
}

BOOST_AUTO_TEST_CASE(validate_rejects_each_bad_sgd_option) {
  const auto sgd = OptimizerKind::kSgd;
  for (const float lr : {0.0f, -0.1f, kNan, kInf}) {
    expect_rejected(
        sgd, "--lr", [lr](OptimizerConfig& c) { c.lr = lr; }, "lr " + std::to_string(lr));
  }
  for (const float m : {-0.5f, kNan, kInf}) {
    expect_rejected(
        sgd, "--momentum", [m](OptimizerConfig& c) { c.momentum = m; }, "momentum " + std::to_string(m));
  }
  for (const float d : {-0.1f, kNan}) {
    expect_rejected(
        sgd, "--dampening", [d](OptimizerConfig& c) { c.dampening = d; }, "dampening " + std::to_string(d));
  }
  for (const float wd : {-1e-4f, kNan, -kInf}) {
    expect_rejected(
        sgd, "--weight-decay", [wd](OptimizerConfig& c) { c.weight_decay = wd; }, "weight_decay " + std::to_string(wd));
  }
  expect_rejected(
      sgd, "--nesterov", [](OptimizerConfig& c) { c.nesterov = true; }, "nesterov without momentum");
  expect_rejected(
      sgd, "--nesterov",
      [](OptimizerConfig& c) {
        c.nesterov = true;
        c.momentum = 0.9f;
        c.dampening = 0.1f;
      },
      "nesterov with dampening");
}

BOOST_AUTO_TEST_CASE(validate_rejects_each_bad_adam_option) {
  for (const OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    for (const float lr : {0.0f, -1e-3f, kNan}) {
      expect_rejected(
          kind, "--lr", [lr](OptimizerConfig& c) { c.lr = lr; }, "lr " + std::to_string(lr));
    }
    for (const float b : {-0.1f, 1.0f, 1.5f, kNan}) {
      expect_rejected(
          kind, "--beta1", [b](OptimizerConfig& c) { c.beta1 = b; }, "beta1 " + std::to_string(b));
      expect_rejected(
          kind, "--beta2", [b](OptimizerConfig& c) { c.beta2 = b; }, "beta2 " + std::to_string(b));
    }
    for (const float eps : {0.0f, -1e-8f, kInf}) {
      expect_rejected(
          kind, "--eps", [eps](OptimizerConfig& c) { c.eps = eps; }, "eps " + std::to_string(eps));
    }
    for (const float wd : {-0.01f, kNan}) {
      expect_rejected(
          kind, "--weight-decay", [wd](OptimizerConfig& c) { c.weight_decay = wd; },
          "weight_decay " + std::to_string(wd));
    }
  }
}

// Adam's fp32 scalars: lr / (1 - beta1) (the step size of step 1) and
// 1 - lr * weight_decay past the float range would write NaN and Inf into
// the weights (torch raises converting them).
BOOST_AUTO_TEST_CASE(validate_rejects_an_adam_lr_whose_step_size_passes_the_float_range) {
  for (const OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    OptimizerConfig c = make(kind);
    c.lr = 1e38f;  // 1e39 at beta1 0.9
    c.weight_decay = 0.0f;
    BOOST_TEST(validate(c).message() == "--lr 1e+38 gives the step size lr / (1 - beta1) past the float range",
               optimizer_kind_name(kind));
    c.beta1 = 0.0f;  // a step size of lr itself
    BOOST_TEST(validate(c).ok(), optimizer_kind_name(kind));
    c.weight_decay = 10.0f;  // AdamW's decay factor 1 - 1e39; Adam's decay is an L2 term, no such factor
    if (kind == OptimizerKind::kAdamW)
      BOOST_TEST(validate(c).message() == "--lr 1e+38 times --weight-decay 10 is past the float range");
    else
      BOOST_TEST(validate(c).ok());
  }
  OptimizerConfig sgd;  // no derived scalar past lr
  sgd.lr = 3e38f;
  sgd.weight_decay = 10.0f;
  BOOST_TEST(validate(sgd).ok());
}

// An update's config (a schedule's lr) may have lr 0, as torch's cosine
// and linear schedules reach; the other rules stay.
BOOST_AUTO_TEST_CASE(validate_update_takes_lr_zero_and_nothing_else_validate_refuses) {
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    OptimizerConfig c = make(kind);
    c.lr = 0.0f;
    BOOST_TEST(!validate(c).ok());
    BOOST_TEST(validate_update(c).ok(), optimizer_kind_name(kind));
    for (const float lr : {-1e-3f, kNan, kInf}) {
      c.lr = lr;
      BOOST_TEST(starts_with(validate_update(c).message(), "--lr "), optimizer_kind_name(kind) << " lr " << lr);
    }
  }
  OptimizerConfig adam = make(OptimizerKind::kAdam);
  adam.lr = 1e38f;
  BOOST_TEST(!validate_update(adam).ok());
}

BOOST_AUTO_TEST_CASE(validate_message_gives_the_value) {
  OptimizerConfig c = make(OptimizerKind::kAdam);
  c.beta2 = 1.0f;
  BOOST_TEST(validate(c).message() == "--beta2 must be in [0, 1), got 1");
  c = make(OptimizerKind::kSgd);
  c.lr = 0.0f;
  BOOST_TEST(validate(c).message() == "--lr must be > 0, got 0");
  c.lr = 0.1f;
  c.momentum = -0.5f;
  BOOST_TEST(validate(c).message() == "--momentum must be >= 0, got -0.5");
}

BOOST_AUTO_TEST_CASE(validate_rejects_unknown_kind) {
  OptimizerConfig c;
  c.kind = static_cast<OptimizerKind>(7);
  BOOST_TEST(starts_with(validate(c).message(), "--optimizer "));
}

BOOST_AUTO_TEST_CASE(kind_names_round_trip) {
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    OptimizerKind parsed = OptimizerKind::kSgd;
    BOOST_TEST(parse_optimizer_kind(optimizer_kind_name(kind), &parsed));
    BOOST_TEST(static_cast<uint32_t>(parsed) == static_cast<uint32_t>(kind));
  }
  BOOST_TEST(std::string(optimizer_kind_name(OptimizerKind::kAdamW)) == "adamw");
  OptimizerKind untouched = OptimizerKind::kAdam;
  for (const char* text : {"", "SGD", "adam ", "adamax", "rmsprop"}) {
    BOOST_TEST(!parse_optimizer_kind(text, &untouched), text);
  }
  BOOST_TEST(static_cast<uint32_t>(untouched) == static_cast<uint32_t>(OptimizerKind::kAdam));
  BOOST_TEST(std::string(optimizer_kind_name(static_cast<OptimizerKind>(0))) == "unknown");
}

BOOST_AUTO_TEST_CASE(state_arrays_per_optimizer) {
  OptimizerConfig c;
  BOOST_TEST(state_arrays(c) == 0u);
  c.momentum = 0.9f;
  BOOST_TEST(state_arrays(c) == 1u);
  c = make(OptimizerKind::kAdam);
  BOOST_TEST(state_arrays(c) == 2u);
  c.amsgrad = true;
  BOOST_TEST(state_arrays(c) == 3u);
  c = make(OptimizerKind::kAdamW);
  BOOST_TEST(state_arrays(c) == 2u);
  c.amsgrad = true;
  BOOST_TEST(state_arrays(c) == 3u);
}

BOOST_AUTO_TEST_CASE(dtype_sizes) {
  BOOST_TEST(dtype_size(GradDtype::kF32) == 4u);
  BOOST_TEST(dtype_size(GradDtype::kF16) == 2u);
  BOOST_TEST(dtype_size(GradDtype::kBF16) == 2u);
  BOOST_TEST(dtype_size(static_cast<GradDtype>(0)) == 0u);
  BOOST_TEST(dtype_size(static_cast<GradDtype>(4)) == 0u);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace shmps::kernels::test
