// The model passes (model_passes.hpp): one branch-free loop each, over
// __restrict pointers, compiled -O3 with AVX2 clones (CMakeLists.txt) so
// that the vectorizer takes them; at cache-resident sizes (the 814 KB
// model) that is what bounds a round's own passes, from a few MiB on
// memory bandwidth does.
#include "shmps/kernels/model_passes.hpp"

#include "clones.hpp"

namespace shmps::kernels {

SHMPS_KERNEL_CLONES void add_cpu(float* __restrict dst, const float* __restrict src, uint64_t n) noexcept {
  for (uint64_t i = 0; i < n; ++i) dst[i] += src[i];
}

SHMPS_KERNEL_CLONES void weighted_difference_cpu(float* __restrict out, const float* __restrict a,
                                                 const float* __restrict b, float weight, uint64_t n) noexcept {
  for (uint64_t i = 0; i < n; ++i) out[i] = weight * (a[i] - b[i]);
}

SHMPS_KERNEL_CLONES void average_step_cpu(float* __restrict anchor, const float* __restrict sum, float divisor,
                                          float* __restrict correction, uint64_t n) noexcept {
  for (uint64_t i = 0; i < n; ++i) {
    const float a = anchor[i] + sum[i] / divisor;
    anchor[i] = a;
    correction[i] = a - correction[i];
  }
}

namespace {

template <bool kStarted>
SHMPS_KERNEL_CLONES void nesterov_loop(float* __restrict anchor, float* __restrict buf, const float* __restrict sum,
                                       float divisor, float mu, float neg_lr, float* __restrict correction,
                                       uint64_t n) noexcept {
  for (uint64_t i = 0; i < n; ++i) {
    const float g = -(sum[i] / divisor);
    const float b = kStarted ? buf[i] * mu + g : g;
    buf[i] = b;
    const float d = g + b * mu;
    const float a = anchor[i] + d * neg_lr;
    anchor[i] = a;
    correction[i] = a - correction[i];
  }
}

}  // namespace

void nesterov_step_cpu(float* anchor, float* buf, const float* sum, float divisor, const NesterovStep& step,
                       float* correction, uint64_t n) noexcept {
  if (step.started) {
    nesterov_loop<true>(anchor, buf, sum, divisor, step.momentum, -step.lr, correction, n);
  } else {
    nesterov_loop<false>(anchor, buf, sum, divisor, step.momentum, -step.lr, correction, n);
  }
}

}  // namespace shmps::kernels
