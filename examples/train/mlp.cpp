#include "mlp.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <random>

// OpenBLAS's own entry point; declared here too so a cblas.h of another
// flavour still compiles (we link OpenBLAS either way).
extern "C" void openblas_set_num_threads(int num_threads);
extern "C" char* openblas_get_corename(void);

namespace shmps::train {

std::vector<ParamTensor> mlp_tensors(const MlpShape& s) {
  std::vector<ParamTensor> t;
  size_t offset = 0;
  auto add = [&](std::string name, std::vector<uint64_t> shape) {
    size_t count = 1;
    for (uint64_t d : shape) count *= d;
    t.push_back(ParamTensor{std::move(name), std::move(shape), offset, count});
    offset += count;
  };
  add("fc1.weight", {s.hidden, s.inputs});
  add("fc1.bias", {s.hidden});
  add("fc2.weight", {s.classes, s.hidden});
  add("fc2.bias", {s.classes});
  return t;
}

size_t mlp_parameter_count(const MlpShape& s) {
  return s.hidden * s.inputs + s.hidden + s.classes * s.hidden + s.classes;
}

void he_init(const MlpShape& shape, std::span<float> params, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const ParamTensor& t : mlp_tensors(shape)) {
    float* p = params.data() + t.offset;
    if (t.shape.size() == 1) {
      std::fill(p, p + t.count, 0.0f);
      continue;
    }
    const auto fan_in = static_cast<double>(t.shape[1]);
    std::normal_distribution<float> normal(0.0f, static_cast<float>(std::sqrt(2.0 / fan_in)));
    for (size_t i = 0; i < t.count; ++i) p[i] = normal(rng);
  }
}

void set_blas_threads(int threads) { openblas_set_num_threads(threads); }

std::string blas_corename() {
  const char* name = openblas_get_corename();
  return name == nullptr ? std::string() : std::string(name);
}

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512_skx = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

std::string better_blas_coretype(std::string_view chosen, const CpuFeatures& cpu) {
  static constexpr std::string_view kWithoutAvx2[] = {"Prescott", "Core2", "Penryn",     "Dunnington",
                                                      "Nehalem",  "Atom",  "Sandybridge"};
  if (std::find(std::begin(kWithoutAvx2), std::end(kWithoutAvx2), chosen) == std::end(kWithoutAvx2)) return "";
  if (cpu.avx512_skx) return "SkylakeX";
  if (cpu.avx2_fma) return "Haswell";
  return "";
}

Mlp::Mlp(const MlpShape& shape, size_t max_batch)
    : shape_(shape),
      parameter_count_(mlp_parameter_count(shape)),
      max_batch_(std::max<size_t>(max_batch, 1)),
      w1_(0),
      b1_(shape.hidden * shape.inputs),
      w2_(b1_ + shape.hidden),
      b2_(w2_ + shape.classes * shape.hidden),
      hidden_(max_batch_ * shape.hidden),
      logits_(max_batch_ * shape.classes),
      dhidden_(max_batch_ * shape.hidden) {}

double Mlp::forward(const float* params, const float* x, const uint8_t* labels, size_t batch, size_t* correct) {
  const auto n = static_cast<int>(batch);
  const auto in = static_cast<int>(shape_.inputs);
  const auto hid = static_cast<int>(shape_.hidden);
  const auto cls = static_cast<int>(shape_.classes);
  // hidden = relu(x W1^T + b1)
  float* h = hidden_.data();
  for (size_t i = 0; i < batch; ++i) std::copy_n(params + b1_, shape_.hidden, h + i * shape_.hidden);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, hid, in, 1.0f, x, in, params + w1_, in, 1.0f, h, hid);
  for (size_t i = 0; i < batch * shape_.hidden; ++i) h[i] = std::max(h[i], 0.0f);
  // logits = hidden W2^T + b2
  float* z = logits_.data();
  for (size_t i = 0; i < batch; ++i) std::copy_n(params + b2_, shape_.classes, z + i * shape_.classes);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cls, hid, 1.0f, h, hid, params + w2_, hid, 1.0f, z, cls);
  // Softmax in place; loss = logsumexp(z) - z[label], in double.
  double loss = 0.0;
  for (size_t i = 0; i < batch; ++i) {
    float* zi = z + i * shape_.classes;
    const size_t argmax = static_cast<size_t>(std::max_element(zi, zi + shape_.classes) - zi);
    const float zmax = zi[argmax];
    const float zlabel = zi[labels[i]];
    double sum = 0.0;
    for (size_t c = 0; c < shape_.classes; ++c) {
      zi[c] = std::exp(zi[c] - zmax);
      sum += zi[c];
    }
    const auto inv = static_cast<float>(1.0 / sum);
    for (size_t c = 0; c < shape_.classes; ++c) zi[c] *= inv;
    loss += std::log(sum) + static_cast<double>(zmax) - static_cast<double>(zlabel);
    if (correct != nullptr && argmax == labels[i]) ++*correct;
  }
  return loss;
}

double Mlp::loss_and_gradient(const float* params, const float* x, const uint8_t* labels, size_t batch, float* grad) {
  const double loss = forward(params, x, labels, batch, nullptr);
  const auto n = static_cast<int>(batch);
  const auto in = static_cast<int>(shape_.inputs);
  const auto hid = static_cast<int>(shape_.hidden);
  const auto cls = static_cast<int>(shape_.classes);
  const float* h = hidden_.data();
  // dz = (softmax - onehot) / batch, in place over the probabilities.
  float* dz = logits_.data();
  const float scale = 1.0f / static_cast<float>(batch);
  for (size_t i = 0; i < batch; ++i) {
    float* dzi = dz + i * shape_.classes;
    dzi[labels[i]] -= 1.0f;
    for (size_t c = 0; c < shape_.classes; ++c) dzi[c] *= scale;
  }
  // dW2 = dz^T hidden; db2 = column sums of dz.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cls, hid, n, 1.0f, dz, cls, h, hid, 0.0f, grad + w2_, hid);
  float* db2 = grad + b2_;
  std::fill(db2, db2 + shape_.classes, 0.0f);
  for (size_t i = 0; i < batch; ++i) {
    for (size_t c = 0; c < shape_.classes; ++c) db2[c] += dz[i * shape_.classes + c];
  }
  // dhidden = (dz W2) * relu'(pre-activation); hidden > 0 iff pre > 0.
  float* dh = dhidden_.data();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hid, cls, 1.0f, dz, cls, params + w2_, hid, 0.0f, dh, hid);
  for (size_t i = 0; i < batch * shape_.hidden; ++i) {
    if (h[i] <= 0.0f) dh[i] = 0.0f;
  }
  // dW1 = dhidden^T x; db1 = column sums of dhidden.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, hid, in, n, 1.0f, dh, hid, x, in, 0.0f, grad + w1_, in);
  float* db1 = grad + b1_;
  std::fill(db1, db1 + shape_.hidden, 0.0f);
  for (size_t i = 0; i < batch; ++i) {
    const float* dhi = dh + i * shape_.hidden;
    for (size_t j = 0; j < shape_.hidden; ++j) db1[j] += dhi[j];
  }
  return loss / static_cast<double>(batch);
}

EvalResult Mlp::evaluate(const float* params, const float* x, const uint8_t* labels, size_t count) {
  EvalResult r;
  size_t correct = 0;
  double loss = 0.0;
  for (size_t start = 0; start < count; start += max_batch_) {
    const size_t b = std::min(max_batch_, count - start);
    loss += forward(params, x + start * shape_.inputs, labels + start, b, &correct);
  }
  r.count = count;
  if (count > 0) {
    r.loss = loss / static_cast<double>(count);
    r.accuracy = static_cast<double>(correct) / static_cast<double>(count);
  }
  return r;
}

}  // namespace shmps::train
