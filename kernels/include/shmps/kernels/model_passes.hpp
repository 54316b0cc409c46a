// Elementwise passes over a whole model's fp32 weights: the federation's
// round (the weighted delta, the outer step; docs/federation.md, "A round")
// and the backends' merge of its correction into the weights. Vectorized
// like the optimizers (optimizer_cpu.cpp), and, like them, every operation
// separately rounded (no FMA), so that every host of a federation computes
// the same bits on any x86-64 or other target. Host-only, reentrant; the
// arrays of one call must not overlap.
#pragma once

#include <cstdint>

namespace shmps::kernels {

// dst[i] += src[i].
void add_cpu(float* dst, const float* src, uint64_t n) noexcept;

// out[i] = weight * (a[i] - b[i]).
void weighted_difference_cpu(float* out, const float* a, const float* b, float weight, uint64_t n) noexcept;

// The plain-average outer step, with the correction in the same pass:
// anchor[i] += sum[i] / divisor, then correction[i] = anchor[i] -
// correction[i] (on entry correction holds the snapshot S, on return the
// new anchor minus S). A division, not a product with a rounded
// 1 / divisor: (n d) / n is d exactly when n d is exact.
void average_step_cpu(float* anchor, const float* sum, float divisor, float* correction, uint64_t n) noexcept;

// The Nesterov outer step: PyTorch's SGD (dampening 0, nesterov) on the
// pseudo-gradient g = -(sum[i] / divisor): buf = g on the first step
// (started false), else momentum * buf + g; d = g + momentum * buf;
// anchor -= lr * d; then the correction as average_step_cpu's.
struct NesterovStep {
  float lr = 0.0f;
  float momentum = 0.0f;
  bool started = false;  // buf holds an earlier step's momentum
};
void nesterov_step_cpu(float* anchor, float* buf, const float* sum, float divisor, const NesterovStep& step,
                       float* correction, uint64_t n) noexcept;

}  // namespace shmps::kernels
