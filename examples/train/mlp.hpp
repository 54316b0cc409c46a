// A two-layer perceptron (inputs -> hidden, ReLU -> classes, softmax
// cross-entropy) over ONE flat fp32 parameter vector laid out as PyTorch's
// nn.Linear pair: fc1.weight [hidden, inputs], fc1.bias [hidden],
// fc2.weight [classes, hidden], fc2.bias [classes]; the gradient has the same
// layout, so a worker pushes all tensors as one range. Matrix products go
// through CBLAS. An Mlp owns its scratch memory: one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace shmps::train {

struct MlpShape {
  size_t inputs = 784;  // 28x28 Fashion-MNIST pixels
  size_t hidden = 256;
  size_t classes = 10;
};

// One tensor of the flat parameter vector.
struct ParamTensor {
  std::string name;             // "fc1.weight", ...
  std::vector<uint64_t> shape;  // {out, in} for weights, {out} for biases
  size_t offset = 0;            // elements from the start of the vector
  size_t count = 0;             // elements
};

// The four tensors in the order of the flat vector (and of the server's
// tensor table).
std::vector<ParamTensor> mlp_tensors(const MlpShape& shape);
size_t mlp_parameter_count(const MlpShape& shape);

// He initialisation: weights ~ N(0, 2 / fan_in), biases 0. The same seed
// gives the same vector with the same standard library.
// Precondition: params.size() == mlp_parameter_count(shape).
void he_init(const MlpShape& shape, std::span<float> params, uint64_t seed);

// Limits this process's OpenBLAS to `threads` threads (no-op with another
// CBLAS). Worker processes use 1: they already fill the cores.
void set_blas_threads(int threads);

// The kernels OpenBLAS chose for this CPU when it was loaded, e.g.
// "Haswell" (openblas_get_corename()).
std::string blas_corename();

// What the CPU can run, as far as the BLAS kernels care.
struct CpuFeatures {
  bool avx2_fma = false;    // AVX2 and FMA: OpenBLAS's Haswell kernels
  bool avx512_skx = false;  // AVX-512 F, CD, BW, DQ and VL: its SkylakeX kernels
};
CpuFeatures cpu_features();  // this CPU (__builtin_cpu_supports)

// The OPENBLAS_CORETYPE to run with instead of `chosen`, or "" to keep it.
// OpenBLAS picks its kernels from the CPU's model number; under a
// hypervisor that hides it (e.g. one reporting "Intel(R) Xeon(R)
// Processor") Debian 12's OpenBLAS 0.3.21 falls back to its Prescott
// (SSE3) kernels on a CPU with AVX-512, much slower (docs/training.md).
// So when `chosen` is one of OpenBLAS's Intel cores without AVX2
// (Prescott, Core2, Penryn, Dunnington, Nehalem, Atom, Sandybridge) and
// `cpu` has more: "SkylakeX" with AVX-512, "Haswell" with AVX2 and FMA.
// Any other core (a newer Intel one, an AMD one) is kept. Pure function.
std::string better_blas_coretype(std::string_view chosen, const CpuFeatures& cpu);

struct EvalResult {
  double loss = 0.0;      // mean cross-entropy, nats
  double accuracy = 0.0;  // fraction of argmax == label
  size_t count = 0;
};

class Mlp {
 public:
  // Allocates scratch for minibatches of up to `max_batch` (> 0) examples;
  // no call below allocates.
  Mlp(const MlpShape& shape, size_t max_batch);

  const MlpShape& shape() const noexcept { return shape_; }
  size_t parameter_count() const noexcept { return parameter_count_; }
  size_t max_batch() const noexcept { return max_batch_; }

  // Forward and backward pass of one minibatch: `x` is [batch, inputs]
  // row-major, `labels` [batch] (each < classes), 1 <= batch <= max_batch.
  // Writes d(mean loss)/d(params) into `grad` (parameter_count() floats,
  // overwritten) and returns the mean loss of the batch.
  double loss_and_gradient(const float* params, const float* x, const uint8_t* labels, size_t batch, float* grad);

  // Mean loss and accuracy of `count` examples, in chunks of max_batch.
  EvalResult evaluate(const float* params, const float* x, const uint8_t* labels, size_t count);

 private:
  // Fills hidden_ (post-ReLU) and logits_ (turned into probabilities);
  // returns the summed (not mean) loss; counts correct argmaxes if asked.
  double forward(const float* params, const float* x, const uint8_t* labels, size_t batch, size_t* correct);

  MlpShape shape_;
  size_t parameter_count_;
  size_t max_batch_;
  size_t w1_, b1_, w2_, b2_;    // offsets of the four tensors
  std::vector<float> hidden_;   // [max_batch, hidden]
  std::vector<float> logits_;   // [max_batch, classes]; softmax, then dloss/dlogit
  std::vector<float> dhidden_;  // [max_batch, hidden]
};

}  // namespace shmps::train
