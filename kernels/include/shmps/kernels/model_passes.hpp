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
// a = anchor[i] + sum[i] / divisor, the new anchor, is written over sum[i]
// (anchor is only read, so that a caller keeps it until it commits), then
// correction[i] = a - correction[i] (on entry correction holds the
// snapshot S, on return the new anchor minus S). A division, not a product
// with a rounded 1 / divisor: (n d) / n is d exactly when n d is exact.
// Returns whether every value written is finite (a sum of finite values
// can still overflow here).
bool average_step_cpu(const float* anchor, float* sum, float divisor, float* correction, uint64_t n) noexcept;

// The Nesterov outer step: PyTorch's SGD (dampening 0, nesterov) on the
// pseudo-gradient g = -(sum[i] / divisor): the new momentum b = g on the
// first step (started false), else momentum * buf + g, written to
// next_buf (buf is only read); d = g + momentum * b; the new anchor
// anchor - lr * d written over sum; then the correction and the result
// as average_step_cpu's (b checked too).
struct NesterovStep {
  float lr = 0.0f;
  float momentum = 0.0f;
  bool started = false;  // buf holds an earlier step's momentum
};
bool nesterov_step_cpu(const float* anchor, const float* buf, float* sum, float divisor, const NesterovStep& step,
                       float* next_buf, float* correction, uint64_t n) noexcept;

}  // namespace shmps::kernels
