#include "shmps/kernels/lr_schedule.hpp"

#include <algorithm>
#include <cfloat>
#include <charconv>
#include <cmath>
#include <numbers>

namespace shmps::kernels {
namespace {

// The least magnitude fp32 rounds to infinity: FLT_MAX + half its ulp.
// Below it a number rounds to at most FLT_MAX (3.4028235e+38, just above
// FLT_MAX as a double, is FLT_MAX in fp32).
constexpr double kFp32Overflow = 0x1.ffffffp+127;

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t at = text.find(sep);
    out.push_back(text.substr(0, at));
    if (at == std::string_view::npos) return out;
    text.remove_prefix(at + 1);
  }
}

bool parse_number(std::string_view text, double* out) {
  const auto r = std::from_chars(text.data(), text.data() + text.size(), *out);
  return r.ec == std::errc() && r.ptr == text.data() + text.size() && std::isfinite(*out);
}

bool parse_count(std::string_view text, uint64_t* out) {
  const auto r = std::from_chars(text.data(), text.data() + text.size(), *out);
  return r.ec == std::errc() && r.ptr == text.data() + text.size();
}

std::string number_text(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string phase_text(const LrPhase& p) {
  switch (p.kind) {
    case LrPhaseKind::kConstant:
      return "constant";
    case LrPhaseKind::kStep:
      return "step:" + std::to_string(p.length) + ":" + number_text(p.gamma);
    case LrPhaseKind::kExponential:
      return "exponential:" + number_text(p.gamma);
    case LrPhaseKind::kCosine:
      return "cosine:" + std::to_string(p.length) + ":" + number_text(p.eta_min);
    case LrPhaseKind::kLinear:
      return "linear:" + number_text(p.start_factor) + ":" + number_text(p.end_factor) + ":" + std::to_string(p.length);
  }
  return "?";
}

// One phase's text: its LrPhase, or what is wrong with it.
Result<LrPhase> parse_phase(std::string_view text) {
  const std::vector<std::string_view> f = split(text, ':');
  const std::string_view kind = f[0];
  const size_t args = f.size() - 1;
  const auto usage = [&](const char* form) {
    return Status{ErrorCode::kInvalidArgument, "'" + std::string(text) + "': expected " + form};
  };
  // A factor or an lr the fp32 lr cannot hold: every update's lr would be
  // Inf, and every push refused.
  const auto past_fp32 = [&](std::string_view number) {
    return Status{ErrorCode::kInvalidArgument, "'" + std::string(text) + "': " + std::string(number) +
                                                   " is past the fp32 range (at most 3.4028235e+38)"};
  };
  LrPhase p;
  if (kind == "constant") {
    if (args != 0) return usage("constant");
  } else if (kind == "step") {
    p.kind = LrPhaseKind::kStep;
    if (args != 2 || !parse_count(f[1], &p.length) || !parse_number(f[2], &p.gamma))
      return usage("step:SIZE:GAMMA (an integer, a number)");
    if (p.length < 1) return usage("step:SIZE:GAMMA with SIZE at least 1");
    if (p.gamma <= 0) return usage("step:SIZE:GAMMA with GAMMA > 0");
    if (p.gamma >= kFp32Overflow) return past_fp32(f[2]);
  } else if (kind == "exponential") {
    p.kind = LrPhaseKind::kExponential;
    if (args != 1 || !parse_number(f[1], &p.gamma)) return usage("exponential:GAMMA (a number)");
    if (p.gamma <= 0) return usage("exponential:GAMMA with GAMMA > 0");
    if (p.gamma >= kFp32Overflow) return past_fp32(f[1]);
  } else if (kind == "cosine") {
    p.kind = LrPhaseKind::kCosine;
    if ((args != 1 && args != 2) || !parse_count(f[1], &p.length) || (args == 2 && !parse_number(f[2], &p.eta_min)))
      return usage("cosine:T_MAX[:ETA_MIN] (an integer, a number)");
    if (p.length < 1) return usage("cosine:T_MAX with T_MAX at least 1");
    if (p.eta_min < 0) return usage("cosine:T_MAX:ETA_MIN with ETA_MIN >= 0");
    if (p.eta_min >= kFp32Overflow) return past_fp32(f[2]);
  } else if (kind == "linear") {
    p.kind = LrPhaseKind::kLinear;
    if (args != 3 || !parse_number(f[1], &p.start_factor) || !parse_number(f[2], &p.end_factor) ||
        !parse_count(f[3], &p.length))
      return usage("linear:START:END:ITERS (two numbers, an integer)");
    // torch.optim.lr_scheduler.LinearLR's own checks.
    if (p.start_factor <= 0 || p.start_factor > 1) return usage("linear:START:END:ITERS with 0 < START <= 1");
    if (p.end_factor < 0 || p.end_factor > 1) return usage("linear:START:END:ITERS with 0 <= END <= 1");
    if (p.length < 1) return usage("linear:START:END:ITERS with ITERS at least 1");
  } else {
    return usage("constant, step:SIZE:GAMMA, exponential:GAMMA, cosine:T_MAX[:ETA_MIN] or linear:START:END:ITERS");
  }
  return p;
}

double phase_lr(const LrPhase& p, double lr, uint64_t k) noexcept {
  switch (p.kind) {
    case LrPhaseKind::kConstant:
      return lr;
    case LrPhaseKind::kStep:
      return lr * std::pow(p.gamma, static_cast<double>(k / p.length));
    case LrPhaseKind::kExponential:
      return lr * std::pow(p.gamma, static_cast<double>(k));
    case LrPhaseKind::kCosine:
      return p.eta_min +
             (lr - p.eta_min) *
                 (1.0 + std::cos(std::numbers::pi * static_cast<double>(k) / static_cast<double>(p.length))) / 2.0;
    case LrPhaseKind::kLinear:
      return lr * (p.start_factor + (p.end_factor - p.start_factor) * static_cast<double>(std::min(k, p.length)) /
                                        static_cast<double>(p.length));
  }
  return lr;
}

}  // namespace

Result<LrSchedule> parse_lr_schedule(std::string_view text) {
  const auto fail = [](const std::string& why) { return Status{ErrorCode::kInvalidArgument, "--lr-schedule: " + why}; };
  LrSchedule s;
  s.phases.clear();
  const std::vector<std::string_view> phases = split(text, ',');
  if (phases.size() > kMaxLrPhases)
    return fail(std::to_string(phases.size()) + " phases, at most " + std::to_string(kMaxLrPhases));
  for (size_t i = 0; i < phases.size(); ++i) {
    Result<LrPhase> p = parse_phase(phases[i]);
    if (!p.ok()) return fail(p.status().message());
    if (i + 1 < phases.size() && p->kind != LrPhaseKind::kLinear && p->kind != LrPhaseKind::kCosine)
      return fail("'" + std::string(phases[i]) +
                  "' has no length to end at: only a linear or cosine phase may come before another");
    s.phases.push_back(*p);
  }
  return s;
}

std::string lr_schedule_text(const LrSchedule& schedule) {
  std::string out;
  for (const LrPhase& p : schedule.phases) out += (out.empty() ? "" : ",") + phase_text(p);
  return out;
}

double scheduled_lr(const LrSchedule& schedule, double lr, uint64_t updates) noexcept {
  uint64_t k = updates;
  for (size_t i = 0; i + 1 < schedule.phases.size(); ++i) {
    if (k < schedule.phases[i].length) return phase_lr(schedule.phases[i], lr, k);
    k -= schedule.phases[i].length;
  }
  return phase_lr(schedule.phases.back(), lr, k);
}

}  // namespace shmps::kernels
