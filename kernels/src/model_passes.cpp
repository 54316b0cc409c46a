// The model passes (model_passes.hpp): one branch-free loop each, over
// __restrict pointers, compiled -O3 with AVX2 clones (CMakeLists.txt) so
// that the vectorizer takes them; at cache-resident sizes (the 814 KB
// model) that is what bounds a round's own passes, from a few MiB on
// memory bandwidth does.
#include "shmps/kernels/model_passes.hpp"

#include "clones.hpp"

#include <bit>

namespace shmps::kernels {

SHMPS_KERNEL_CLONES void add_cpu(float* __restrict dst, const float* __restrict src, uint64_t n) noexcept {
  for (uint64_t i = 0; i < n; ++i) dst[i] += src[i];
}

SHMPS_KERNEL_CLONES void weighted_difference_cpu(float* __restrict out, const float* __restrict a,
                                                 const float* __restrict b, float weight, uint64_t n) noexcept {
  for (uint64_t i = 0; i < n; ++i) out[i] = weight * (a[i] - b[i]);
}

namespace {

// 1 when the float's exponent is all ones (Inf or NaN): an integer test the
// vectorizer folds into an OR reduction.
inline uint32_t not_finite(float x) noexcept {
  return (std::bit_cast<uint32_t>(x) & 0x7F800000u) == 0x7F800000u ? 1u : 0u;
}

}  // namespace

SHMPS_KERNEL_CLONES bool average_step_cpu(const float* __restrict anchor, float* __restrict sum, float divisor,
                                          float* __restrict correction, uint64_t n) noexcept {
  uint32_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const float a = anchor[i] + sum[i] / divisor;
    const float c = a - correction[i];
    sum[i] = a;
    correction[i] = c;
    bad |= not_finite(a) | not_finite(c);
  }
  return bad == 0;
}

namespace {

template <bool kStarted>
SHMPS_KERNEL_CLONES bool nesterov_loop(const float* __restrict anchor, const float* __restrict buf,
                                       float* __restrict sum, float divisor, float mu, float neg_lr,
                                       float* __restrict next_buf, float* __restrict correction, uint64_t n) noexcept {
  uint32_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const float g = -(sum[i] / divisor);
    const float b = kStarted ? buf[i] * mu + g : g;
    const float d = g + b * mu;
    const float a = anchor[i] + d * neg_lr;
    const float c = a - correction[i];
    next_buf[i] = b;
    sum[i] = a;
    correction[i] = c;
    bad |= not_finite(b) | not_finite(a) | not_finite(c);
  }
  return bad == 0;
}

}  // namespace

bool nesterov_step_cpu(const float* anchor, const float* buf, float* sum, float divisor, const NesterovStep& step,
                       float* next_buf, float* correction, uint64_t n) noexcept {
  return step.started
             ? nesterov_loop<true>(anchor, buf, sum, divisor, step.momentum, -step.lr, next_buf, correction, n)
             : nesterov_loop<false>(anchor, buf, sum, divisor, step.momentum, -step.lr, next_buf, correction, n);
}

}  // namespace shmps::kernels
