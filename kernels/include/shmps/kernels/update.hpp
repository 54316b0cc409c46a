// The per-element optimizer math, written once for every backend: the CPU
// loops (optimizer_cpu.cpp) and the CUDA kernels compile these same inline
// functions (SHMPS_HD is __host__ __device__ under nvcc). Pure functions of
// their arguments: no state, no allocation, safe from any thread.
// No CUDA types; the make_*_params builders are host-only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "shmps/kernels/optimizer.hpp"

#if defined(__CUDACC__)
#define SHMPS_HD __host__ __device__
#else
#define SHMPS_HD
#endif

namespace shmps::kernels {

// Rounding. The operations below are PyTorch's, in PyTorch's order, each
// rounded to fp32 on its own. Results still differ from PyTorch's CPU ones by
// a few ulp: its kernels fuse multiply-adds (FMA) and take sqrt from MKL
// (+-1 ulp). Both builds of this header keep every operation separate: the
// CPU one with -ffp-contract=off, the CUDA one with --fmad=false and nvcc's
// IEEE division and sqrt (kernels/CMakeLists.txt), so a CUDA kernel gives
// the CPU reference's bits and the GPU tests compare bit for bit
// (docs/optimizers.md, "Rounding: bitwise equal to the CPU reference").

// ---------------------------------------------------------------------------
// Gradient element conversions (f16 / bf16 -> f32). Exact for every input:
// f16 subnormals become normal floats, +-Inf stays +-Inf, NaN stays NaN
// (a signalling NaN comes back quiet). Pure integer/float bit work, so the
// same code runs on the host, on the device and vectorizes.

SHMPS_HD inline float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

SHMPS_HD inline uint32_t bits_from_float(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

// IEEE binary16 -> binary32. Branch-free (a mask select), after
// Marat Dukhan's FP16 library (fp16_ieee_to_fp32_value), which PyTorch also
// uses as c10::detail::fp16_ieee_to_fp32_value. Normal, Inf and NaN halves:
// shift exponent+mantissa into float position and rescale by 2^-112 (an
// exact multiply; exponent 31 lands on 255 so Inf/NaN survive). Subnormal
// halves (exponent 0, mantissa m): put m under the exponent of 0.5, giving
// the normal float 0.5 + m * 2^-24, and subtract 0.5; exact, and no float
// subnormal is ever an operand, so flush-to-zero modes do not change it.
SHMPS_HD inline float f16_to_float(uint16_t half) {
  const uint32_t w = static_cast<uint32_t>(half) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // drops the sign bit
  constexpr uint32_t kExpOffset = 0xE0u << 23;
  constexpr float kExpScale = 0x1.0p-112f;
  const float normalized = float_from_bits((two_w >> 4) + kExpOffset) * kExpScale;
  constexpr uint32_t kMagicMask = 126u << 23;
  constexpr float kMagicBias = 0.5f;
  const float denormalized = float_from_bits((two_w >> 17) | kMagicMask) - kMagicBias;
  constexpr uint32_t kDenormalizedCutoff = 1u << 27;
  // Select by mask rather than ?: so that GCC keeps the loop branch-free.
  const uint32_t subnormal_mask = 0u - static_cast<uint32_t>(two_w < kDenormalizedCutoff);
  const uint32_t magnitude =
      (bits_from_float(denormalized) & subnormal_mask) | (bits_from_float(normalized) & ~subnormal_mask);
  return float_from_bits(sign | magnitude);
}

// bfloat16 is the top half of a binary32: widening is a shift, exact for
// every value including NaN payloads.
SHMPS_HD inline float bf16_to_float(uint16_t bf16) { return float_from_bits(static_cast<uint32_t>(bf16) << 16); }

// Finite tests on raw bits (exponent field not all ones). Branch-free, so a
// reduction over them vectorizes.
SHMPS_HD inline bool f32_bits_finite(uint32_t bits) { return (bits & 0x7F800000u) != 0x7F800000u; }
SHMPS_HD inline bool f16_bits_finite(uint16_t bits) { return (bits & 0x7C00u) != 0x7C00u; }
SHMPS_HD inline bool bf16_bits_finite(uint16_t bits) { return (bits & 0x7F80u) != 0x7F80u; }

// ---------------------------------------------------------------------------
// SGD, as torch.optim.SGD documents it (algorithm box in
// https://pytorch.org/docs/stable/generated/torch.optim.SGD.html) and as its
// single-tensor path (_single_tensor_sgd, foreach=False) computes it:
//
//   if weight_decay != 0:  g = g + weight_decay * w        grad.add(param, alpha=wd)
//   if momentum != 0:
//     if t == 1:           buf = g                          torch.clone(grad)
//     else:                buf = momentum * buf + (1 - dampening) * g
//                                                  buf.mul_(momentum).add_(grad, alpha=1-dampening)
//     if nesterov:         g = g + momentum * buf           grad.add(buf, alpha=momentum)
//     else:                g = buf
//   w = w - lr * g                                          param.add_(grad, alpha=-lr)
//
// First momentum step: PyTorch sets buf = g, NOT (1 - dampening) * g as the
// naive recurrence from buf = 0 would give; dampening only applies from the
// second step on. maximize=True is not supported.
//
// Scalars are fp32, as PyTorch turns its Python-float hyperparameters into
// the tensor's dtype; (1 - dampening) is computed once by the caller.

struct SgdParams {
  float neg_lr = 0.0f;               // -lr
  float momentum = 0.0f;             // used when use_momentum
  float one_minus_dampening = 1.0f;  // 1 - dampening, rounded to fp32 once
  float weight_decay = 0.0f;         // used when use_weight_decay
  bool use_weight_decay = false;     // weight_decay != 0
  bool use_momentum = false;         // momentum != 0 (buf is read/written only then)
  bool nesterov = false;             // requires use_momentum
};

// Host: the SGD scalars for `config` (valid, kind kSgd).
inline SgdParams make_sgd_params(const OptimizerConfig& config) {
  SgdParams p;
  p.neg_lr = -config.lr;
  p.momentum = config.momentum;
  p.one_minus_dampening = 1.0f - config.dampening;  // exact result rounded once, as PyTorch's double then fp32
  p.weight_decay = config.weight_decay;
  p.use_weight_decay = config.weight_decay != 0.0f;
  p.use_momentum = config.momentum != 0.0f;
  p.nesterov = p.use_momentum && config.nesterov;
  return p;
}

// One element. `first_step`: PyTorch's step == 1 (the momentum buffer does
// not exist yet and is initialised to g). `buf` is untouched without momentum.
SHMPS_HD inline void sgd_update(float& w, float& buf, float g, const SgdParams& p, bool first_step) {
  if (p.use_weight_decay) g = g + p.weight_decay * w;
  if (p.use_momentum) {
    const float b = first_step ? g : buf * p.momentum + p.one_minus_dampening * g;
    buf = b;
    g = p.nesterov ? g + p.momentum * b : b;
  }
  w = w + p.neg_lr * g;
}

// ---------------------------------------------------------------------------
// Adam and AdamW, as torch.optim.Adam / torch.optim.AdamW document them
// (https://pytorch.org/docs/stable/generated/torch.optim.Adam.html,
//  https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html) and as
// the single-tensor path (_single_tensor_adam, foreach=False, capturable=False,
// PyTorch >= 2.0) computes them, step t >= 1:
//
//   AdamW:    w = w * (1 - lr * weight_decay)             param.mul_(1 - lr*wd)
//   Adam:     g = g + weight_decay * w  (if wd != 0)       grad.add(param, alpha=wd)
//   m = m + (1 - beta1) * (g - m)                          exp_avg.lerp_(grad, 1-beta1)
//       (= beta1 m + (1 - beta1) g; PyTorch < 2.0 wrote it that way)
//   v = v * beta2 + ((1 - beta2) * g) * g                  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
//   amsgrad:  vmax = max(vmax, v), use vmax for v below   torch.maximum(max_exp_avg_sq, exp_avg_sq, out=...)
//   denom = sqrt(v) / sqrt(1 - beta2^t) + eps              (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   w = w + (-(lr / (1 - beta1^t)) * m) / denom            param.addcdiv_(exp_avg, denom, value=-step_size)
//
// The per-step scalars (step_size, bias_correction2_sqrt, 1 - lr*wd) are
// computed in double, as PyTorch does in Python, then rounded to fp32 once
// (make_adam_params below).
// lerp: ATen's lerp(self, end, weight) is self + weight*(end - self) when
// |weight| < 0.5, else end - (end - self)*(1 - weight); both are written
// here as base + coeff*(g - m) with coeff exact, as ATen's vector lerp does.
// The first step needs no special case: m and v start at 0 (PyTorch's
// zeros_like state), so m1 = (1-beta1) g and v1 = (1-beta2) g^2.
// maximize=True is not supported.

struct AdamParams {
  float neg_step_size = 0.0f;          // -(lr / (1 - beta1^t))
  float bias_correction2_sqrt = 1.0f;  // sqrt(1 - beta2^t)
  float eps = 1e-8f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;  // 1 - beta2
  float lerp_coeff = 0.1f;         // w = fp32(1 - beta1); w when lerp_from_m, else w - 1
  float weight_decay = 0.0f;       // Adam's L2 term, used when use_l2
  float decay_factor = 1.0f;       // AdamW's 1 - lr*wd, used when decoupled
  bool lerp_from_m = true;         // |w| < 0.5: m + w*(g-m); else g - (g-m)*(1-w)
  bool use_l2 = false;             // Adam with weight_decay != 0
  bool decoupled = false;          // AdamW with weight_decay != 0
  bool amsgrad = false;            // vmax is read/written only then
};

// Host: the Adam/AdamW scalars for `config` (valid, kind kAdam or kAdamW)
// at `step` >= 1 (PyTorch's step count after incrementing). Computed in
// double from the fp32 hyperparameters, as PyTorch computes them from Python
// floats, then rounded to fp32 once: bias_correction = 1 - beta**step,
// step_size = lr / bias_correction1, bias_correction2 ** 0.5, 1 - lr * wd.
inline AdamParams make_adam_params(const OptimizerConfig& config, uint64_t step) {
  const double lr = config.lr;
  const double beta1 = config.beta1;
  const double beta2 = config.beta2;
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, t);
  const double bias_correction2 = 1.0 - std::pow(beta2, t);
  AdamParams p;
  p.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  p.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  p.eps = config.eps;
  p.beta2 = config.beta2;
  p.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const float weight = static_cast<float>(1.0 - beta1);  // ATen's lerp weight, fp32
  p.lerp_from_m = std::fabs(weight) < 0.5f;
  p.lerp_coeff = p.lerp_from_m ? weight : weight - 1.0f;
  const bool decay = config.weight_decay != 0.0f;
  p.weight_decay = config.weight_decay;
  p.decay_factor = static_cast<float>(1.0 - lr * static_cast<double>(config.weight_decay));
  p.use_l2 = decay && config.kind == OptimizerKind::kAdam;
  p.decoupled = decay && config.kind == OptimizerKind::kAdamW;
  p.amsgrad = config.amsgrad;
  return p;
}

// One element. m, v (and vmax with amsgrad) are the exp_avg, exp_avg_sq
// and max_exp_avg_sq state, zero before the first step.
SHMPS_HD inline void adam_update(float& w, float& m, float& v, float& vmax, float g, const AdamParams& p) {
  if (p.decoupled) w = w * p.decay_factor;
  if (p.use_l2) g = g + p.weight_decay * w;
  const float base = p.lerp_from_m ? m : g;
  const float m1 = base + p.lerp_coeff * (g - m);
  const float v1 = v * p.beta2 + p.one_minus_beta2 * g * g;
  m = m1;
  v = v1;
  float v_used = v1;
  if (p.amsgrad) {
    // NaN in v propagates like torch.maximum: vmax > NaN is false, so NaN is
    // taken; a NaN vmax implies v went NaN at the same step and stays NaN.
    const float vm = vmax > v1 ? vmax : v1;
    vmax = vm;
    v_used = vm;
  }
  const float denom = std::sqrt(v_used) / p.bias_correction2_sqrt + p.eps;
  w = w + p.neg_step_size * m1 / denom;
}

}  // namespace shmps::kernels
