// CPU implementation of the optimizer API (optimizer.hpp): option checks and
// names, and apply_cpu / all_finite_cpu, the reference every other backend
// is tested against. Hot loops are specialised on the options before the
// loop (no option branches inside) so the compiler vectorizes them; large
// tensors are split over all cores when built with SHMPS_OPENMP.
#include "shmps/kernels/optimizer.hpp"

#include "clones.hpp"
#include "dtype_dispatch.hpp"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#if defined(SHMPS_OPENMP)
#include <omp.h>
#endif

#include "shmps/kernels/update.hpp"

namespace shmps::kernels {
namespace {

// Why kCpuSplitMinElements is 1M: with the wait policy the server runs
// under (OMP_WAIT_POLICY=passive) a parallel region wakes its team through
// futexes, and below about 1M elements that costs more than the second
// thread saves; at 4 MiB the two tie, above it the split wins
// (docs/benchmarks.md, "OpenMP: one thread below 1M elements, passive
// waiting").
// Unit of work handed to a thread: 32K elements = 128 KiB per fp32 array.
// A multiple of every vector width, so only the last block has a scalar tail.
[[maybe_unused]] constexpr uint64_t kBlockElements = uint64_t{1} << 15;
// set_cpu_threads() of this thread: 0, every OpenMP thread; 1, this thread alone.
thread_local unsigned t_cpu_threads = 0;
// The team that splits n elements: 1 below kCpuSplitMinElements, else all
// OpenMP would use (its affinity mask, or OMP_NUM_THREADS) unless
// set_cpu_threads() asked for fewer.
int split_threads(uint64_t n) {
#if defined(SHMPS_OPENMP)
  if (n < kCpuSplitMinElements) return 1;
  const int all = omp_get_max_threads();
  return t_cpu_threads == 0 ? all : std::min(all, static_cast<int>(t_cpu_threads));
#else
  (void)n;
  return 1;
#endif
}
// all_finite_cpu checks this many elements between early exits.
constexpr uint64_t kFiniteChunk = 4096;

// ---------------------------------------------------------------------------
// Messages

std::string number_text(float value) {
  char buf[32];
  const auto result = std::to_chars(buf, buf + sizeof buf, value);
  return std::string(buf, result.ptr);
}

// "" when `value` is finite, above `low` (or equal, when low_inclusive) and
// below `high` (exclusive); else the message validate() returns.
std::string check_range(const char* option, float value, float low, bool low_inclusive, float high = INFINITY) {
  if (!std::isfinite(value)) return std::string(option) + " must be a finite number, got " + number_text(value);
  const bool above = low_inclusive ? value >= low : value > low;
  if (above && value < high) return "";
  std::string message = std::string(option) + " must be ";
  if (std::isinf(high)) {
    message += (low_inclusive ? ">= " : "> ") + number_text(low);
  } else {
    message += std::string("in ") + (low_inclusive ? "[" : "(") + number_text(low) + ", " + number_text(high) + ")";
  }
  return message + ", got " + number_text(value);
}

// ---------------------------------------------------------------------------
// Gradient loads. memcpy: grad may have any alignment (it lives in a shared
// segment at an offset the client chose); compilers turn it into one
// (unaligned vector) load.

template <GradDtype kDtype>
inline float load_grad(const unsigned char* grad, uint64_t i) {
  if constexpr (kDtype == GradDtype::kF32) {
    float g;
    std::memcpy(&g, grad + i * sizeof(float), sizeof g);
    return g;
  } else {
    uint16_t h;
    std::memcpy(&h, grad + i * sizeof(uint16_t), sizeof h);
    if constexpr (kDtype == GradDtype::kF16) {
      return f16_to_float(h);
    } else {
      return bf16_to_float(h);
    }
  }
}

template <GradDtype kDtype>
inline uint32_t load_nonfinite(const unsigned char* grad, uint64_t i) {
  if constexpr (kDtype == GradDtype::kF32) {
    uint32_t bits;
    std::memcpy(&bits, grad + i * sizeof bits, sizeof bits);
    return f32_bits_finite(bits) ? 0u : 1u;
  } else {
    uint16_t bits;
    std::memcpy(&bits, grad + i * sizeof bits, sizeof bits);
    if constexpr (kDtype == GradDtype::kF16) {
      return f16_bits_finite(bits) ? 0u : 1u;
    } else {
      return bf16_bits_finite(bits) ? 0u : 1u;
    }
  }
}

// Calls f(std::integral_constant<bool, b>) so that a runtime flag becomes a
// template argument of the loop f instantiates.
template <class F>
auto with_bool(bool b, F&& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}

// ---------------------------------------------------------------------------
// Range loops. Each instantiation is one branch-free loop: the option flags
// are template arguments written into a local copy of the params, so after
// inlining sgd_update/adam_update every `if (p.flag)` folds away.

struct SgdArgs {
  SgdParams params;
  float* weights;
  float* buf;
  const unsigned char* grad;
};

struct AdamArgs {
  AdamParams params;
  float* weights;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  const unsigned char* grad;
};

template <class Args>
using RangeFn = void (*)(const Args&, uint64_t begin, uint64_t end);

template <GradDtype kDtype, bool kWeightDecay, bool kMomentum, bool kFirstStep, bool kNesterov>
SHMPS_KERNEL_CLONES void sgd_range(const SgdArgs& args, uint64_t begin, uint64_t end) {
  SgdParams p = args.params;
  p.use_weight_decay = kWeightDecay;
  p.use_momentum = kMomentum;
  p.nesterov = kNesterov;
  float* __restrict w = args.weights;
  float* __restrict buf = args.buf;
  const unsigned char* __restrict grad = args.grad;
  for (uint64_t i = begin; i < end; ++i) {
    float wi = w[i];
    float bi = 0.0f;
    if constexpr (kMomentum && !kFirstStep) bi = buf[i];
    sgd_update(wi, bi, load_grad<kDtype>(grad, i), p, kFirstStep);
    w[i] = wi;
    if constexpr (kMomentum) buf[i] = bi;
  }
}

enum class Decay { kNone, kL2, kDecoupled };

template <GradDtype kDtype, Decay kDecay, bool kAmsgrad, bool kLerpFromM>
SHMPS_KERNEL_CLONES void adam_range(const AdamArgs& args, uint64_t begin, uint64_t end) {
  AdamParams p = args.params;
  p.lerp_from_m = kLerpFromM;
  p.use_l2 = kDecay == Decay::kL2;
  p.decoupled = kDecay == Decay::kDecoupled;
  p.amsgrad = kAmsgrad;
  float* __restrict w = args.weights;
  float* __restrict m = args.exp_avg;
  float* __restrict v = args.exp_avg_sq;
  float* __restrict vmax = args.max_exp_avg_sq;
  const unsigned char* __restrict grad = args.grad;
  for (uint64_t i = begin; i < end; ++i) {
    float wi = w[i];
    float mi = m[i];
    float vi = v[i];
    float vmaxi = 0.0f;
    if constexpr (kAmsgrad) vmaxi = vmax[i];
    adam_update(wi, mi, vi, vmaxi, load_grad<kDtype>(grad, i), p);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kAmsgrad) vmax[i] = vmaxi;
  }
}

// Runs fn over [0, n): in kBlockElements blocks over split_threads() for
// large n, else on the calling thread. Elementwise math, so the split does
// not change any result.
template <class Args>
void run_split(RangeFn<Args> fn, const Args& args, uint64_t n) {
#if defined(SHMPS_OPENMP)
  const int threads = split_threads(n);
  if (threads > 1) {
    const auto blocks = static_cast<int64_t>((n + kBlockElements - 1) / kBlockElements);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint64_t begin = static_cast<uint64_t>(b) * kBlockElements;
      fn(args, begin, std::min(n, begin + kBlockElements));
    }
    return;
  }
#endif
  fn(args, 0, n);
}

// The loop for one SGD variant; nesterov and the first-step rule only exist
// with momentum, so only the 5 meaningful momentum variants are instantiated.
template <GradDtype kDtype, bool kWeightDecay>
RangeFn<SgdArgs> pick_sgd_range(const SgdParams& p, bool first_step) {
  if (!p.use_momentum) return &sgd_range<kDtype, kWeightDecay, false, false, false>;
  if (first_step) {
    return p.nesterov ? &sgd_range<kDtype, kWeightDecay, true, true, true>
                      : &sgd_range<kDtype, kWeightDecay, true, true, false>;
  }
  return p.nesterov ? &sgd_range<kDtype, kWeightDecay, true, false, true>
                    : &sgd_range<kDtype, kWeightDecay, true, false, false>;
}

void apply_sgd(const OptimizerConfig& config, const TensorState& tensor, const unsigned char* grad, GradDtype dtype,
               uint64_t step) {
  const SgdArgs args{make_sgd_params(config), tensor.weights, tensor.state[0], grad};
  const RangeFn<SgdArgs> fn = detail::visit_dtype(dtype, [&](auto dtype_c) {
    return with_bool(args.params.use_weight_decay, [&](auto wd_c) {
      return pick_sgd_range<decltype(dtype_c)::value, decltype(wd_c)::value>(args.params, step == 1);
    });
  });
  run_split(fn, args, tensor.n);
}

void apply_adam(const OptimizerConfig& config, const TensorState& tensor, const unsigned char* grad, GradDtype dtype,
                uint64_t step) {
  const AdamArgs args{
      make_adam_params(config, step), tensor.weights, tensor.state[0], tensor.state[1], tensor.state[2], grad};
  const AdamParams& p = args.params;
  const RangeFn<AdamArgs> fn = detail::visit_dtype(dtype, [&](auto dtype_c) {
    return with_bool(p.amsgrad, [&](auto amsgrad_c) {
      return with_bool(p.lerp_from_m, [&](auto lerp_c) -> RangeFn<AdamArgs> {
        constexpr GradDtype kDtype = decltype(dtype_c)::value;
        constexpr bool kAmsgrad = decltype(amsgrad_c)::value;
        constexpr bool kLerpFromM = decltype(lerp_c)::value;
        if (p.use_l2) return &adam_range<kDtype, Decay::kL2, kAmsgrad, kLerpFromM>;
        if (p.decoupled) return &adam_range<kDtype, Decay::kDecoupled, kAmsgrad, kLerpFromM>;
        return &adam_range<kDtype, Decay::kNone, kAmsgrad, kLerpFromM>;
      });
    });
  });
  run_split(fn, args, tensor.n);
}

// 1 when any element of [begin, end) is NaN or +-Inf. No early exit inside
// the range, so the loop runs at the load ports' rate.
// An element is NaN or +-Inf when its exponent field is all ones (update.hpp's
// f32/f16/bf16_bits_finite), that is when its bits without the sign are at
// least the exponent mask. The loop keeps the lane-wise unsigned maximum of
// the bits without the sign: an AND (its load folded in) and a max per 32
// bytes (vpmaxud / vpmaxuw with AVX2), four accumulators, and one compare
// at the end. Integer operations only: no floating-point exception flag, no
// subnormal operand, nothing a compiler's fast-math options could fold
// away. Its speed in one process: docs/benchmarks.md, "The kernels in one
// process".
template <GradDtype kDtype>
SHMPS_KERNEL_CLONES uint32_t any_nonfinite(const unsigned char* grad, uint64_t begin, uint64_t end) {
  using Elem = std::conditional_t<kDtype == GradDtype::kF32, uint32_t, uint16_t>;
  constexpr Elem kExponent = static_cast<Elem>(kDtype == GradDtype::kF32   ? 0x7F800000u
                                               : kDtype == GradDtype::kF16 ? 0x7C00u
                                                                           : 0x7F80u);
  constexpr Elem kMagnitude = static_cast<Elem>(std::numeric_limits<Elem>::max() >> 1);  // every bit but the sign
  typedef Elem Bits __attribute__((vector_size(32)));                                    // GCC/clang vector extension
  constexpr uint64_t kLanes = sizeof(Bits) / sizeof(Elem);
  Bits acc0{};
  Bits acc1{};
  Bits acc2{};
  Bits acc3{};
  uint64_t i = begin;
  for (; end - i >= 4 * kLanes; i += 4 * kLanes) {
    const unsigned char* p = grad + i * sizeof(Elem);
    Bits a;
    Bits b;
    Bits c;
    Bits d;
    std::memcpy(&a, p, sizeof a);  // any alignment
    std::memcpy(&b, p + sizeof a, sizeof b);
    std::memcpy(&c, p + 2 * sizeof a, sizeof c);
    std::memcpy(&d, p + 3 * sizeof a, sizeof d);
    a &= kMagnitude;
    b &= kMagnitude;
    c &= kMagnitude;
    d &= kMagnitude;
    acc0 = acc0 > a ? acc0 : a;  // lane-wise unsigned max
    acc1 = acc1 > b ? acc1 : b;
    acc2 = acc2 > c ? acc2 : c;
    acc3 = acc3 > d ? acc3 : d;
  }
  acc0 = acc0 > acc1 ? acc0 : acc1;
  acc2 = acc2 > acc3 ? acc2 : acc3;
  acc0 = acc0 > acc2 ? acc0 : acc2;
  uint32_t bad = 0;
  for (uint64_t lane = 0; lane < kLanes; ++lane) bad |= acc0[lane] >= kExponent ? 1u : 0u;
  for (; i < end; ++i) bad |= load_nonfinite<kDtype>(grad, i);
  return bad;
}

template <GradDtype kDtype>
bool all_finite_typed(const unsigned char* grad, uint64_t n) {
#if defined(SHMPS_OPENMP)
  const int threads = split_threads(n);
  if (threads > 1) {
    const auto blocks = static_cast<int64_t>((n + kBlockElements - 1) / kBlockElements);
    uint32_t bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(threads)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint64_t begin = static_cast<uint64_t>(b) * kBlockElements;
      bad |= any_nonfinite<kDtype>(grad, begin, std::min(n, begin + kBlockElements));
    }
    return bad == 0;
  }
#endif
  // Serial: stop at the first chunk holding a non-finite value.
  for (uint64_t begin = 0; begin < n; begin += kFiniteChunk) {
    if (any_nonfinite<kDtype>(grad, begin, std::min(n, begin + kFiniteChunk)) != 0) return false;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------

size_t dtype_size(GradDtype dtype) noexcept {
  switch (dtype) {
    case GradDtype::kF32:
      return 4;
    case GradDtype::kF16:
    case GradDtype::kBF16:
      return 2;
  }
  return 0;
}

namespace {
// `lr_zero_ok`: an update's lr (a schedule may reach 0), not the
// configured one.
std::string validation_error(const OptimizerConfig& config, bool lr_zero_ok) {
  std::string error;
  const auto first = [&error](std::string message) {
    if (error.empty()) error = std::move(message);
  };
  switch (config.kind) {
    case OptimizerKind::kSgd:
      first(check_range("--lr", config.lr, 0.0f, lr_zero_ok));
      first(check_range("--momentum", config.momentum, 0.0f, true));
      first(check_range("--dampening", config.dampening, 0.0f, true));
      first(check_range("--weight-decay", config.weight_decay, 0.0f, true));
      if (error.empty() && config.nesterov && (config.momentum <= 0.0f || config.dampening != 0.0f)) {
        error = "--nesterov requires --momentum > 0 and --dampening 0, got momentum " + number_text(config.momentum) +
                " and dampening " + number_text(config.dampening);
      }
      return error;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      first(check_range("--lr", config.lr, 0.0f, lr_zero_ok));
      first(check_range("--beta1", config.beta1, 0.0f, true, 1.0f));
      first(check_range("--beta2", config.beta2, 0.0f, true, 1.0f));
      first(check_range("--eps", config.eps, 0.0f, false));
      first(check_range("--weight-decay", config.weight_decay, 0.0f, true));
      if (error.empty()) {
        // The fp32 scalars make_adam_params() derives: the step size is
        // largest at step 1, lr / (1 - beta1); AdamW's decoupled decay
        // factor 1 - lr * wd (Adam's decay is an L2 term on the gradient).
        // Past the float range either would write NaN and Inf into the
        // weights, where torch raises.
        const double lr = config.lr;
        const double step_size = lr / (1.0 - static_cast<double>(config.beta1));
        const double decay = 1.0 - lr * static_cast<double>(config.weight_decay);
        if (!std::isfinite(static_cast<float>(step_size)))
          error = "--lr " + number_text(config.lr) + " gives the step size lr / (1 - beta1) past the float range";
        else if (config.kind == OptimizerKind::kAdamW && !std::isfinite(static_cast<float>(decay)))
          error = "--lr " + number_text(config.lr) + " times --weight-decay " + number_text(config.weight_decay) +
                  " is past the float range";
      }
      return error;
  }
  return "--optimizer must be sgd, adam or adamw, got kind " + std::to_string(static_cast<uint32_t>(config.kind));
}
}  // namespace

Status validate(const OptimizerConfig& config) {
  std::string error = validation_error(config, false);
  if (error.empty()) return Status::Ok();
  return {ErrorCode::kInvalidArgument, std::move(error)};
}

Status validate_update(const OptimizerConfig& config) {
  std::string error = validation_error(config, true);
  if (error.empty()) return Status::Ok();
  return {ErrorCode::kInvalidArgument, std::move(error)};
}

const char* optimizer_kind_name(OptimizerKind kind) noexcept {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
  }
  return "unknown";
}

bool parse_optimizer_kind(const std::string& text, OptimizerKind* out) noexcept {
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    if (text == optimizer_kind_name(kind)) {
      if (out != nullptr) *out = kind;
      return true;
    }
  }
  return false;
}

size_t state_arrays(const OptimizerConfig& config) noexcept {
  switch (config.kind) {
    case OptimizerKind::kSgd:
      return config.momentum != 0.0f ? 1 : 0;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return config.amsgrad ? 3 : 2;
  }
  return 0;
}

// Outside the preconditions (checked by assert in debug builds) a dtype or
// kind outside its enum leaves the tensor untouched.
void apply_cpu(const OptimizerConfig& config, const TensorState& tensor, const void* grad, GradDtype dtype,
               uint64_t step) {
  assert(validate_update(config).ok());
  assert(step >= 1);
  assert(dtype_size(dtype) != 0);
  if (tensor.n == 0 || dtype_size(dtype) == 0) return;
  const auto* bytes = static_cast<const unsigned char*>(grad);
  switch (config.kind) {
    case OptimizerKind::kSgd:
      apply_sgd(config, tensor, bytes, dtype, step);
      return;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      apply_adam(config, tensor, bytes, dtype, step);
      return;
  }
}

unsigned set_cpu_threads(unsigned threads) noexcept {
  t_cpu_threads = threads;
  return static_cast<unsigned>(split_threads(kCpuSplitMinElements));
}

// A dtype outside the enum reports false: the caller then refuses the push.
bool all_finite_cpu(const void* grad, GradDtype dtype, uint64_t n) {
  const auto* bytes = static_cast<const unsigned char*>(grad);
  switch (dtype) {
    case GradDtype::kF32:
      return all_finite_typed<GradDtype::kF32>(bytes, n);
    case GradDtype::kF16:
      return all_finite_typed<GradDtype::kF16>(bytes, n);
    case GradDtype::kBF16:
      return all_finite_typed<GradDtype::kBF16>(bytes, n);
  }
  return false;
}

}  // namespace shmps::kernels
