// Learning-rate schedules as torch.optim.lr_scheduler defines them, driven
// by the number of updates applied (the server's version) instead of calls
// of scheduler.step(): the lr of the update that makes version k + 1 is the
// lr that torch's optimizer holds after k calls of scheduler.step(), from
// the scheduler's closed form (equal to its chained form to within a few
// units in the last place of a double; both are rounded to float for the
// update).
//
//   constant                 lr                                  (no scheduler)
//   step:SIZE:GAMMA          lr * GAMMA^floor(k / SIZE)          StepLR(step_size, gamma)
//   exponential:GAMMA        lr * GAMMA^k                        ExponentialLR(gamma)
//   cosine:T_MAX[:ETA_MIN]   ETA_MIN + (lr - ETA_MIN) *          CosineAnnealingLR(T_max, eta_min)
//                              (1 + cos(pi * k / T_MAX)) / 2     (past T_MAX it rises again, as torch's)
//   linear:START:END:ITERS   lr * (START + (END - START) *       LinearLR(start_factor, end_factor,
//                              min(k, ITERS) / ITERS)              total_iters)
//
// Phases joined by commas run one after another, as SequentialLR runs its
// schedulers: each phase but the last lasts its length (a linear phase
// ITERS updates, a cosine phase T_MAX), and a phase counts k from 0 where
// it begins. "linear:0.01:1:500,cosine:9500" is a 500-update warm-up, then
// cosine annealing: SequentialLR([LinearLR(opt, 0.01, 1, 500),
// CosineAnnealingLR(opt, 9500)], milestones=[500]).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shmps/status.hpp"

namespace shmps::kernels {

enum class LrPhaseKind : uint32_t { kConstant, kStep, kExponential, kCosine, kLinear };

struct LrPhase {
  LrPhaseKind kind = LrPhaseKind::kConstant;
  uint64_t length = 0;        // step: SIZE; cosine: T_MAX; linear: ITERS
  double gamma = 1.0;         // step, exponential
  double eta_min = 0.0;       // cosine
  double start_factor = 1.0;  // linear
  double end_factor = 1.0;    // linear
};

inline constexpr size_t kMaxLrPhases = 4;

struct LrSchedule {
  std::vector<LrPhase> phases{LrPhase{}};  // 1..kMaxLrPhases; never empty
  bool constant() const noexcept { return phases.size() == 1 && phases[0].kind == LrPhaseKind::kConstant; }
};

// Parses the text above. Errors: kInvalidArgument naming the phase and
// what is wrong with it, e.g. "--lr-schedule: cosine:0: T_MAX must be at
// least 1". The checks are torch's (0 < START <= 1, 0 <= END <= 1),
// and every number finite in fp32 (at most 3.4028235e+38: the lr is
// fp32), GAMMA > 0, ETA_MIN >= 0, lengths >= 1, at most
// kMaxLrPhases phases, each but the last a linear or cosine one.
Result<LrSchedule> parse_lr_schedule(std::string_view text);

// The schedule as parse_lr_schedule() reads it back (numbers in their
// shortest exact form).
std::string lr_schedule_text(const LrSchedule& schedule);

// The lr of the update after `updates` updates, from `lr` (the configured
// one).
double scheduled_lr(const LrSchedule& schedule, double lr, uint64_t updates) noexcept;

}  // namespace shmps::kernels
