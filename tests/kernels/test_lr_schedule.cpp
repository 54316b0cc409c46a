// The lr schedules against torch.optim.lr_scheduler's numbers: the lr an
// SGD optimizer of lr 0.1 held before each of its steps, the scheduler
// stepped after each (Debian's torch 1.13, its chained forms), and the
// parser's refusals.
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "shmps/kernels/lr_schedule.hpp"

namespace shmps::kernels::test {
namespace {

struct TorchRun {
  const char* schedule;
  std::vector<double> lr;  // before step k
};

// StepLR(opt, 3, 0.5); ExponentialLR(opt, 0.9); CosineAnnealingLR(opt, 5,
// 0.001); LinearLR(opt, 0.1, 0.9, 4); SequentialLR(opt, [LinearLR(opt,
// 0.25, 1.0, 3), CosineAnnealingLR(opt, 4, 0.01)], [3]).
const TorchRun kTorch[] = {
    {"step:3:0.5", {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025}},
    {"exponential:0.9",
     {0.1, 0.09000000000000001, 0.08100000000000002, 0.07290000000000002, 0.06561000000000002, 0.05904900000000002}},
    {"cosine:5:0.001",
     {0.1, 0.0905463412215599, 0.06579634122155989, 0.035203658778440096, 0.010453658778440105, 0.001,
      0.010453658778440102, 0.03520365877844012, 0.06579634122155993, 0.09054634122155995, 0.10000000000000005,
      0.09054634122155998, 0.06579634122155995}},
    {"linear:0.1:0.9:4",
     {0.010000000000000002, 0.030000000000000006, 0.05, 0.06999999999999999, 0.08999999999999998, 0.08999999999999998,
      0.08999999999999998}},
    {"linear:0.25:1:3,cosine:4:0.01",
     {0.025, 0.05, 0.07500000000000001, 0.1, 0.08681980515339464, 0.05500000000000001, 0.023180194846605363, 0.01,
      0.023180194846605363, 0.05500000000000002, 0.08681980515339469, 0.10000000000000006, 0.0868198051533947}},
};

std::string refusal(const std::string& text) {
  const Result<LrSchedule> s = parse_lr_schedule(text);
  BOOST_TEST(!s.ok(), text << " was accepted");
  if (s.ok()) return "";
  BOOST_TEST((s.status().code() == ErrorCode::kInvalidArgument));
  return s.status().message();
}

}  // namespace

BOOST_AUTO_TEST_SUITE(lr_schedule)

// The closed forms equal torch's chained ones to a few units in the last
// place of a double (far below the float the update rounds the lr to).
BOOST_AUTO_TEST_CASE(each_schedule_gives_torchs_lr_at_every_step) {
  for (const TorchRun& run : kTorch) {
    BOOST_TEST_CONTEXT(run.schedule) {
      const Result<LrSchedule> s = parse_lr_schedule(run.schedule);
      BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
      for (size_t k = 0; k < run.lr.size(); ++k) {
        const double lr = scheduled_lr(*s, 0.1, k);
        BOOST_TEST(std::abs(lr - run.lr[k]) <= 1e-14 * run.lr[k], "step " << k << ": " << lr << " vs " << run.lr[k]);
        BOOST_TEST(static_cast<float>(lr) == static_cast<float>(run.lr[k]), "step " << k);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(constant_is_the_default_and_reads_back) {
  const LrSchedule none;
  BOOST_TEST(none.constant());
  BOOST_TEST(lr_schedule_text(none) == "constant");
  BOOST_TEST(scheduled_lr(none, 0.25, 123456789) == 0.25);
  for (const char* text : {"constant", "step:3:0.5", "exponential:0.9", "cosine:5:0.001", "cosine:7:0",
                           "linear:0.1:0.9:4", "linear:0.25:1:3,cosine:4:0.01,step:10:0.1"}) {
    const Result<LrSchedule> s = parse_lr_schedule(text);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    BOOST_TEST(lr_schedule_text(*s) == text);
  }
  BOOST_TEST(lr_schedule_text(*parse_lr_schedule("cosine:7")) == "cosine:7:0");
  BOOST_TEST(!parse_lr_schedule("cosine:7")->constant());
}

// Far past any job: no overflow, no NaN.
BOOST_AUTO_TEST_CASE(huge_update_counts_stay_finite) {
  for (const char* text : {"step:1:0.5", "exponential:0.9", "cosine:3", "linear:0.5:1:2", "linear:0.5:1:2,cosine:2"}) {
    const double lr = scheduled_lr(*parse_lr_schedule(text), 0.1, ~uint64_t{0});
    BOOST_TEST((std::isfinite(lr) && lr >= 0.0), text << ": " << lr);
  }
}

BOOST_AUTO_TEST_CASE(bad_schedules_are_refused_naming_the_phase_and_the_rule) {
  const auto has = [](const std::string& message, const std::string& part) {
    BOOST_TEST(message.find(part) != std::string::npos, message);
    BOOST_TEST(message.rfind("--lr-schedule: ", 0) == 0u, message);
  };
  has(refusal(""), "expected constant, step:SIZE:GAMMA");
  has(refusal("cosine"), "'cosine': expected cosine:T_MAX[:ETA_MIN]");
  has(refusal("cosine:0"), "T_MAX at least 1");
  has(refusal("cosine:10:-1"), "ETA_MIN >= 0");
  has(refusal("cosine:10:nan"), "cosine:T_MAX[:ETA_MIN] (an integer, a number)");
  has(refusal("cosine:-3"), "(an integer, a number)");
  has(refusal("step:0:0.5"), "SIZE at least 1");
  has(refusal("step:2:0"), "GAMMA > 0");
  has(refusal("step:2:0.5:1"), "expected step:SIZE:GAMMA");
  has(refusal("exponential:inf"), "exponential:GAMMA (a number)");
  has(refusal("linear:0:1:5"), "0 < START <= 1");
  has(refusal("linear:0.5:1.5:5"), "0 <= END <= 1");
  has(refusal("linear:0.5:1:0"), "ITERS at least 1");
  has(refusal("warmup:5"), "'warmup:5': expected constant, step:SIZE:GAMMA, exponential:GAMMA");
  has(refusal("step:2:0.5,cosine:4"), "'step:2:0.5' has no length to end at");
  has(refusal("constant,cosine:4"), "'constant' has no length to end at");
  has(refusal("cosine:4,"), "'': expected constant");
  has(refusal("cosine:1,cosine:1,cosine:1,cosine:1,cosine:1"), "5 phases, at most 4");
  // Finite as a double, past fp32 (the lr's type): the lr would be Inf.
  has(refusal("cosine:10:1e300"), "'cosine:10:1e300': 1e300 is past the fp32 range (at most 3.4028235e+38)");
  has(refusal("step:2:1e39"), "'step:2:1e39': 1e39 is past the fp32 range");
  has(refusal("linear:0.5:1:5,exponential:3.5e38"), "'exponential:3.5e38': 3.5e38 is past the fp32 range");
  BOOST_TEST(parse_lr_schedule("cosine:10:3e38").ok());
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace shmps::kernels::test
