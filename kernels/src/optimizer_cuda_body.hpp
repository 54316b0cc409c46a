// What each CUDA thread of the optimizer kernels does (optimizer_cuda.cu):
// the alignment plan, the per-thread grid-stride bodies over update.hpp and
// the dispatch from runtime options to one instantiation per variant.
// Compiles with g++ too (CUDA types only under __CUDA_ARCH__), so the tests
// run these bodies on the host over an emulated grid. Pure; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "dtype_dispatch.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/kernels/update.hpp"

#if defined(__CUDA_ARCH__)
#define SHMPS_UNROLL _Pragma("unroll")
#else
#define SHMPS_UNROLL
#endif

namespace shmps::kernels::cuda_detail {

// One vector load or store: 16 bytes (LDG.128 / STG.128), the widest a
// thread can issue; 4 fp32 or 8 fp16/bf16 elements.
constexpr uint32_t kVectorBytes = 16;

// How a kernel reads the gradient, chosen per call by plan_access():
// kVector: 16-byte vectors over the bulk, scalar elements for the head and
//   tail (every array is 16-byte aligned at element `head`);
// kElement: one element per load (the gradient is element-aligned, but not
//   16-byte aligned together with the fp32 arrays);
// kByte: the gradient is not even element-aligned (an odd byte offset):
//   each element is assembled from byte loads.
enum class GradAccess { kVector, kElement, kByte };

template <GradDtype kDtype>
inline constexpr uint32_t kGradBytes = kDtype == GradDtype::kF32 ? 4 : 2;
// Elements per gradient vector: 4 for fp32, 8 for fp16/bf16 (the fp32
// arrays then take two 16-byte vectors per gradient vector).
template <GradDtype kDtype>
inline constexpr uint32_t kLanes = kVectorBytes / kGradBytes<kDtype>;

// The device arrays of one call and how they split: elements [0, head) and
// [head + vectors * lanes, n) are scalar, the rest are `vectors` vectors.
struct Arrays {
  float* weights = nullptr;
  float* state[3] = {nullptr, nullptr, nullptr};
  const unsigned char* grad = nullptr;
  uint64_t n = 0;
  uint64_t head = 0;
  uint64_t vectors = 0;
};

struct Plan {
  GradAccess access = GradAccess::kByte;
  uint64_t head = 0;
  uint64_t vectors = 0;
};

// Host: the access plan for n elements of a gradient of `grad_bytes`-byte
// elements beside `count` fp32 arrays (float-aligned). kVector when one
// element offset `head` < lanes makes every array 16-byte aligned and at
// least one whole vector follows; else kElement or kByte by the gradient's
// own alignment. A search, not a formula: with 2-byte gradients the head is
// found where the float arrays' (4-byte) and gradient's (2-byte) steps meet.
inline Plan plan_access(const float* const* arrays, int count, const void* grad, uint32_t grad_bytes, uint64_t n) {
  const auto address = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  Plan plan;
  if (address(grad) % grad_bytes != 0) return plan;  // kByte
  plan.access = GradAccess::kElement;
  const uint32_t lanes = kVectorBytes / grad_bytes;
  for (uint64_t head = 0; head < lanes && head < n; ++head) {
    bool aligned = (address(grad) + head * grad_bytes) % kVectorBytes == 0;
    for (int a = 0; a < count; ++a) {
      aligned = aligned && (address(arrays[a]) + head * sizeof(float)) % kVectorBytes == 0;
    }
    if (!aligned) continue;
    const uint64_t vectors = (n - head) / lanes;
    if (vectors > 0) {
      plan.access = GradAccess::kVector;
      plan.head = head;
      plan.vectors = vectors;
    }
    break;
  }
  return plan;
}

// ---------------------------------------------------------------------------
// Loads and stores. On the device: one instruction each (the caller
// guarantees the alignment); on the host: memcpy, which is what the
// emulating tests need (no aliasing questions, any alignment).

template <class T>
SHMPS_HD inline T load_aligned(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T value;
  std::memcpy(&value, p, sizeof value);
  return value;
#endif
}

// Any alignment: memcpy with an unknown alignment is byte loads on the device.
template <class T>
SHMPS_HD inline T load_unaligned(const unsigned char* p) {
  T value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

// 16 bytes at a 16-byte aligned address, as four 32-bit words (lane order:
// word k holds the bytes 4k..4k+3, little-endian, on host and device alike).
struct Words {
  uint32_t w[4];
};

SHMPS_HD inline Words load16(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  return Words{{v.x, v.y, v.z, v.w}};
#else
  Words value;
  std::memcpy(&value, p, sizeof value);
  return value;
#endif
}

// kLanes fp32 values from / to a 16-byte aligned address (1 or 2 vectors).
template <uint32_t kCount>
SHMPS_HD inline void load_floats(const float* p, float (&out)[kCount]) {
  static_assert(kCount % 4 == 0);
#if defined(__CUDA_ARCH__)
  SHMPS_UNROLL
  for (uint32_t k = 0; k < kCount / 4; ++k) {
    const float4 v = reinterpret_cast<const float4*>(p)[k];
    out[4 * k + 0] = v.x;
    out[4 * k + 1] = v.y;
    out[4 * k + 2] = v.z;
    out[4 * k + 3] = v.w;
  }
#else
  std::memcpy(out, p, sizeof out);
#endif
}

template <uint32_t kCount>
SHMPS_HD inline void store_floats(float* p, const float (&in)[kCount]) {
  static_assert(kCount % 4 == 0);
#if defined(__CUDA_ARCH__)
  SHMPS_UNROLL
  for (uint32_t k = 0; k < kCount / 4; ++k) {
    reinterpret_cast<float4*>(p)[k] = make_float4(in[4 * k + 0], in[4 * k + 1], in[4 * k + 2], in[4 * k + 3]);
  }
#else
  std::memcpy(p, in, sizeof in);
#endif
}

template <GradDtype kDtype>
SHMPS_HD inline float widen(uint16_t bits) {
  if constexpr (kDtype == GradDtype::kF16) {
    return f16_to_float(bits);
  } else {
    return bf16_to_float(bits);
  }
}

// Gradient element i (scalar access).
template <GradDtype kDtype, GradAccess kAccess>
SHMPS_HD inline float load_grad(const unsigned char* grad, uint64_t i) {
  const unsigned char* p = grad + i * kGradBytes<kDtype>;
  if constexpr (kDtype == GradDtype::kF32) {
    return kAccess == GradAccess::kByte ? load_unaligned<float>(p) : load_aligned<float>(p);
  } else {
    return widen<kDtype>(kAccess == GradAccess::kByte ? load_unaligned<uint16_t>(p) : load_aligned<uint16_t>(p));
  }
}

// The kLanes gradient elements of the vector at element e (16-byte aligned).
template <GradDtype kDtype>
SHMPS_HD inline void load_grad_vector(const unsigned char* grad, uint64_t e, float (&out)[kLanes<kDtype>]) {
  const Words v = load16(grad + e * kGradBytes<kDtype>);
  SHMPS_UNROLL
  for (uint32_t k = 0; k < 4; ++k) {
    if constexpr (kDtype == GradDtype::kF32) {
      out[k] = float_from_bits(v.w[k]);
    } else {
      out[2 * k] = widen<kDtype>(static_cast<uint16_t>(v.w[k] & 0xFFFFu));
      out[2 * k + 1] = widen<kDtype>(static_cast<uint16_t>(v.w[k] >> 16));
    }
  }
}

// ---------------------------------------------------------------------------
// The optimizer variants. Each Op fixes the option flags at compile time:
// force() writes them into the kernel's local copy of the params, so after
// inlining sgd_update / adam_update every `if (p.flag)` folds away and the
// loop has no option branches (as the CPU loops in optimizer_cpu.cpp).
// kStates: state arrays touched; kReadsState: whether they are read first.

template <bool kWeightDecay, bool kMomentum, bool kFirstStep, bool kNesterov>
struct SgdOp {
  using Params = SgdParams;
  static constexpr int kStates = kMomentum ? 1 : 0;
  static constexpr bool kReadsState = kMomentum && !kFirstStep;  // step 1 sets buf = g
  SHMPS_HD static Params force(Params p) {
    p.use_weight_decay = kWeightDecay;
    p.use_momentum = kMomentum;
    p.nesterov = kNesterov;
    return p;
  }
  SHMPS_HD static void update(const Params& p, float& w, float (&s)[3], float g) {
    sgd_update(w, s[0], g, p, kFirstStep);
  }
};

enum class Decay { kNone, kL2, kDecoupled };

template <Decay kDecay, bool kAmsgrad, bool kLerpFromM>
struct AdamOp {
  using Params = AdamParams;
  static constexpr int kStates = kAmsgrad ? 3 : 2;
  static constexpr bool kReadsState = true;
  SHMPS_HD static Params force(Params p) {
    p.lerp_from_m = kLerpFromM;
    p.use_l2 = kDecay == Decay::kL2;
    p.decoupled = kDecay == Decay::kDecoupled;
    p.amsgrad = kAmsgrad;
    return p;
  }
  SHMPS_HD static void update(const Params& p, float& w, float (&s)[3], float g) {
    adam_update(w, s[0], s[1], s[2], g, p);
  }
};

// Element i, scalar.
template <class Op, GradDtype kDtype, GradAccess kAccess>
SHMPS_HD inline void apply_element(const typename Op::Params& p, const Arrays& a, uint64_t i) {
  float w = a.weights[i];
  float s[3] = {0.0f, 0.0f, 0.0f};
  if constexpr (Op::kReadsState) {
    SHMPS_UNROLL
    for (int k = 0; k < Op::kStates; ++k) s[k] = a.state[k][i];
  }
  Op::update(p, w, s, load_grad<kDtype, kAccess>(a.grad, i));
  a.weights[i] = w;
  SHMPS_UNROLL
  for (int k = 0; k < Op::kStates; ++k) a.state[k][i] = s[k];
}

// The kLanes elements from e (every array 16-byte aligned there): all loads
// first, then the math, then all stores, so a thread has its 16-byte
// loads in flight together.
template <class Op, GradDtype kDtype>
SHMPS_HD inline void apply_vector(const typename Op::Params& p, const Arrays& a, uint64_t e) {
  constexpr uint32_t kN = kLanes<kDtype>;
  float w[kN];
  float s[3][kN] = {};
  float g[kN];
  load_floats(a.weights + e, w);
  if constexpr (Op::kReadsState) {
    SHMPS_UNROLL
    for (int k = 0; k < Op::kStates; ++k) load_floats(a.state[k] + e, s[k]);
  }
  load_grad_vector<kDtype>(a.grad, e, g);
  SHMPS_UNROLL
  for (uint32_t j = 0; j < kN; ++j) {
    float sj[3] = {s[0][j], s[1][j], s[2][j]};
    Op::update(p, w[j], sj, g[j]);
    SHMPS_UNROLL
    for (int k = 0; k < 3; ++k) s[k][j] = sj[k];
  }
  store_floats(a.weights + e, w);
  SHMPS_UNROLL
  for (int k = 0; k < Op::kStates; ++k) store_floats(a.state[k] + e, s[k]);
}

// What thread `thread` of `threads` (grid-stride: it takes every
// threads-th item) does for one apply. kVector: vectors, then the scalar
// head and tail elements (fewer than 2 * lanes, taken by the first threads).
template <class Op, GradDtype kDtype, GradAccess kAccess>
SHMPS_HD inline void apply_thread(const typename Op::Params& params, const Arrays& a, uint64_t thread,
                                  uint64_t threads) {
  const typename Op::Params p = Op::force(params);
  if constexpr (kAccess == GradAccess::kVector) {
    constexpr uint32_t kN = kLanes<kDtype>;
    for (uint64_t v = thread; v < a.vectors; v += threads) apply_vector<Op, kDtype>(p, a, a.head + v * kN);
    for (uint64_t i = thread; i < a.head; i += threads) apply_element<Op, kDtype, GradAccess::kElement>(p, a, i);
    for (uint64_t i = a.head + a.vectors * kN + thread; i < a.n; i += threads) {
      apply_element<Op, kDtype, GradAccess::kElement>(p, a, i);
    }
  } else {
    for (uint64_t i = thread; i < a.n; i += threads) apply_element<Op, kDtype, kAccess>(p, a, i);
  }
}

// ---------------------------------------------------------------------------
// Finite check: 1 when any element this thread visits is NaN or +-Inf.
// Branch-free OR over the exponent bits, no early exit (the rare non-finite
// gradient costs one full pass, the common finite one no more).

template <GradDtype kDtype, GradAccess kAccess>
SHMPS_HD inline uint32_t nonfinite_element(const unsigned char* grad, uint64_t i) {
  const unsigned char* p = grad + i * kGradBytes<kDtype>;
  if constexpr (kDtype == GradDtype::kF32) {
    const uint32_t bits = kAccess == GradAccess::kByte ? load_unaligned<uint32_t>(p) : load_aligned<uint32_t>(p);
    return f32_bits_finite(bits) ? 0u : 1u;
  } else {
    const uint16_t bits = kAccess == GradAccess::kByte ? load_unaligned<uint16_t>(p) : load_aligned<uint16_t>(p);
    if constexpr (kDtype == GradDtype::kF16) {
      return f16_bits_finite(bits) ? 0u : 1u;
    } else {
      return bf16_bits_finite(bits) ? 0u : 1u;
    }
  }
}

template <GradDtype kDtype>
SHMPS_HD inline uint32_t nonfinite_vector(const unsigned char* grad, uint64_t e) {
  const Words v = load16(grad + e * kGradBytes<kDtype>);
  uint32_t bad = 0;
  SHMPS_UNROLL
  for (uint32_t k = 0; k < 4; ++k) {
    if constexpr (kDtype == GradDtype::kF32) {
      bad |= f32_bits_finite(v.w[k]) ? 0u : 1u;
    } else if constexpr (kDtype == GradDtype::kF16) {
      bad |= (f16_bits_finite(static_cast<uint16_t>(v.w[k] & 0xFFFFu)) ? 0u : 1u) |
             (f16_bits_finite(static_cast<uint16_t>(v.w[k] >> 16)) ? 0u : 1u);
    } else {
      bad |= (bf16_bits_finite(static_cast<uint16_t>(v.w[k] & 0xFFFFu)) ? 0u : 1u) |
             (bf16_bits_finite(static_cast<uint16_t>(v.w[k] >> 16)) ? 0u : 1u);
    }
  }
  return bad;
}

// The gradient-only twin of apply_thread (Arrays' float arrays unused).
template <GradDtype kDtype, GradAccess kAccess>
SHMPS_HD inline uint32_t nonfinite_thread(const Arrays& a, uint64_t thread, uint64_t threads) {
  uint32_t bad = 0;
  if constexpr (kAccess == GradAccess::kVector) {
    constexpr uint32_t kN = kLanes<kDtype>;
    for (uint64_t v = thread; v < a.vectors; v += threads) bad |= nonfinite_vector<kDtype>(a.grad, a.head + v * kN);
    for (uint64_t i = thread; i < a.head; i += threads) {
      bad |= nonfinite_element<kDtype, GradAccess::kElement>(a.grad, i);
    }
    for (uint64_t i = a.head + a.vectors * kN + thread; i < a.n; i += threads) {
      bad |= nonfinite_element<kDtype, GradAccess::kElement>(a.grad, i);
    }
  } else {
    for (uint64_t i = thread; i < a.n; i += threads) bad |= nonfinite_element<kDtype, kAccess>(a.grad, i);
  }
  return bad;
}

// ---------------------------------------------------------------------------
// Dispatch (host): turns the runtime options into template arguments and
// calls f with a value of the chosen type (an Op, or an integral_constant
// of the dtype or access). One instantiation per meaningful variant: the
// 5 SGD momentum modes x weight decay, 3 Adam decay modes x amsgrad x lerp.

template <class F>
auto visit_sgd(const SgdParams& p, bool first_step, F&& f) {
  const auto with_wd = [&](auto wd) {
    constexpr bool kWd = decltype(wd)::value;
    if (!p.use_momentum) return f(SgdOp<kWd, false, false, false>{});
    if (first_step) return p.nesterov ? f(SgdOp<kWd, true, true, true>{}) : f(SgdOp<kWd, true, true, false>{});
    return p.nesterov ? f(SgdOp<kWd, true, false, true>{}) : f(SgdOp<kWd, true, false, false>{});
  };
  return p.use_weight_decay ? with_wd(std::true_type{}) : with_wd(std::false_type{});
}

template <class F>
auto visit_adam(const AdamParams& p, F&& f) {
  const auto with_flags = [&](auto amsgrad, auto lerp) {
    constexpr bool kAmsgrad = decltype(amsgrad)::value;
    constexpr bool kLerp = decltype(lerp)::value;
    if (p.use_l2) return f(AdamOp<Decay::kL2, kAmsgrad, kLerp>{});
    if (p.decoupled) return f(AdamOp<Decay::kDecoupled, kAmsgrad, kLerp>{});
    return f(AdamOp<Decay::kNone, kAmsgrad, kLerp>{});
  };
  const auto with_amsgrad = [&](auto amsgrad) {
    return p.lerp_from_m ? with_flags(amsgrad, std::true_type{}) : with_flags(amsgrad, std::false_type{});
  };
  return p.amsgrad ? with_amsgrad(std::true_type{}) : with_amsgrad(std::false_type{});
}

using detail::visit_dtype;  // dtype_dispatch.hpp, shared with the CPU path

template <class F>
auto visit_access(GradAccess access, F&& f) {
  switch (access) {
    case GradAccess::kVector:
      return f(std::integral_constant<GradAccess, GradAccess::kVector>{});
    case GradAccess::kElement:
      return f(std::integral_constant<GradAccess, GradAccess::kElement>{});
    case GradAccess::kByte:
    default:
      return f(std::integral_constant<GradAccess, GradAccess::kByte>{});
  }
}

// ---------------------------------------------------------------------------
// One call, from the public arguments to the kernel's (host). Kept here,
// beside the bodies, so the host tests plan and dispatch exactly as
// apply_cuda does.

// Checks apply_cuda's arguments and plans the call: "" and *arrays, *plan
// filled (arrays->n == 0: nothing to do), or the message apply_cuda returns.
inline std::string prepare_apply(const OptimizerConfig& config, const TensorState& tensor, const void* grad,
                                 GradDtype dtype, uint64_t step, Arrays* arrays, Plan* plan) {
  if (step == 0) return "apply_cuda: step must be >= 1 (PyTorch's count after incrementing), got 0";
  const size_t grad_bytes = dtype_size(dtype);
  if (grad_bytes == 0) {
    return "apply_cuda: gradient dtype " + std::to_string(static_cast<uint32_t>(dtype)) +
           " is not f32 (1), f16 (2) or bf16 (3)";
  }
  if (config.kind != OptimizerKind::kSgd && config.kind != OptimizerKind::kAdam &&
      config.kind != OptimizerKind::kAdamW) {
    return "apply_cuda: unknown optimizer kind " + std::to_string(static_cast<uint32_t>(config.kind));
  }
  *arrays = Arrays{};
  *plan = Plan{};
  if (tensor.n == 0) return "";
  if (tensor.weights == nullptr || grad == nullptr) return "apply_cuda: null weights or gradient";
  const int states = static_cast<int>(state_arrays(config));
  const float* floats[4] = {tensor.weights, nullptr, nullptr, nullptr};
  for (int s = 0; s < states; ++s) {
    if (tensor.state[s] == nullptr) {
      return "apply_cuda: " + std::string(optimizer_kind_name(config.kind)) + " needs " + std::to_string(states) +
             " state arrays, state[" + std::to_string(s) + "] is null";
    }
    arrays->state[s] = tensor.state[s];
    floats[s + 1] = tensor.state[s];
  }
  arrays->weights = tensor.weights;
  arrays->grad = static_cast<const unsigned char*>(grad);
  arrays->n = tensor.n;
  *plan = plan_access(floats, states + 1, grad, static_cast<uint32_t>(grad_bytes), tensor.n);
  arrays->head = plan->head;
  arrays->vectors = plan->vectors;
  return "";
}

// Computes the per-step scalars exactly as apply_cpu does and calls
// launch(op, dtype_c, access_c, params) with the variant's Op value, the
// dtype and access as integral_constants, and the scalars (SgdParams or
// AdamParams). config.kind and dtype must be valid (prepare_apply checked).
template <class Launch>
auto dispatch_apply(const OptimizerConfig& config, GradDtype dtype, uint64_t step, GradAccess access, Launch&& launch) {
  const auto with_op = [&](const auto& params, auto op) {
    return visit_dtype(dtype, [&](auto dtype_c) {
      return visit_access(access, [&](auto access_c) { return launch(op, dtype_c, access_c, params); });
    });
  };
  if (config.kind == OptimizerKind::kSgd) {
    const SgdParams params = make_sgd_params(config);
    return visit_sgd(params, step == 1, [&](auto op) { return with_op(params, op); });
  }
  const AdamParams params = make_adam_params(config, step);
  return visit_adam(params, [&](auto op) { return with_op(params, op); });
}

}  // namespace shmps::kernels::cuda_detail
