// The optimizers shmps applies: SGD (momentum, dampening, nesterov,
// weight_decay), Adam and AdamW (amsgrad), exactly as PyTorch defines them
// (the formulas are in update.hpp, next to the per-element code).
// Host-only API. Functions are reentrant; apply_cpu() on one tensor must not
// run concurrently with another call on the same tensor (the caller, the
// server's single consumer thread, serialises them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "shmps/status.hpp"

namespace shmps::kernels {

// Values are part of the shm layout's config block: never reuse one.
enum class OptimizerKind : uint32_t { kSgd = 1, kAdam = 2, kAdamW = 3 };

// Gradient element types. Values match shmps::shm::Dtype.
enum class GradDtype : uint32_t { kF32 = 1, kF16 = 2, kBF16 = 3 };

// Bytes per element of a gradient dtype; 0 for a value outside the enum.
size_t dtype_size(GradDtype dtype) noexcept;

// Hyperparameters, with PyTorch's names (torch.optim.SGD, torch.optim.Adam,
// torch.optim.AdamW) and its defaults but for lr (PyTorch's is 1e-3, as is
// shmps-server's --lr) and AdamW's weight_decay (below). Fields that a kind
// does not use are ignored (momentum for Adam, betas for SGD).
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f;
  // SGD
  float momentum = 0.0f;
  float dampening = 0.0f;
  bool nesterov = false;
  // SGD and Adam: L2 penalty added to the gradient; AdamW: decoupled decay.
  // PyTorch's defaults: 0 for SGD and Adam, 0.01 for AdamW.
  float weight_decay = 0.0f;
  // Adam / AdamW
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  bool amsgrad = false;
};

// Checks the hyperparameters as PyTorch does: lr > 0 (shmps also refuses 0),
// momentum >= 0, 0 <= dampening, weight_decay >= 0, 0 <= beta1,beta2 < 1,
// eps > 0, nesterov requires momentum > 0 and dampening == 0, all finite;
// for Adam and AdamW also the fp32 scalars an update derives finite:
// lr / (1 - beta1), and AdamW's 1 - lr * weight_decay (torch raises on them).
// Errors: kInvalidArgument with a message naming the offending option,
// e.g. "--beta2 must be in [0, 1), got 1".
Status validate(const OptimizerConfig& config);
// The same rules for the config of one update (the configured one with
// the lr of a schedule or of --staleness-policy scale), which may have
// lr 0 (a cosine or linear schedule's end): apply_cpu()'s precondition.
Status validate_update(const OptimizerConfig& config);

// "sgd", "adam", "adamw"; parse_optimizer_kind returns false on other text.
const char* optimizer_kind_name(OptimizerKind kind) noexcept;
bool parse_optimizer_kind(const std::string& text, OptimizerKind* out) noexcept;

// Number of fp32 state arrays, each as long as the tensor, that the
// optimizer keeps per parameter: SGD 0 (momentum == 0) or 1 (momentum
// buffer); Adam/AdamW 2 (exp_avg, exp_avg_sq) or 3 with amsgrad (+ max_exp_avg_sq).
size_t state_arrays(const OptimizerConfig& config) noexcept;

// Tensors of at least this many elements (4 MiB of fp32) are split over
// OpenMP threads when built with SHMPS_OPENMP; shorter ones run on the
// calling thread. The split is elementwise: it changes no result.
inline constexpr uint64_t kCpuSplitMinElements = uint64_t{1} << 20;

// The most threads the calling thread's later apply_cpu() and
// all_finite_cpu() calls split a tensor over: 0 (the default) every thread
// OpenMP would use (as many as the process's affinity mask has CPUs, or
// OMP_NUM_THREADS); 1 the calling thread alone. Per calling thread; no
// system call. Returns how many threads a split will then run on (1
// without SHMPS_OPENMP).
unsigned set_cpu_threads(unsigned threads) noexcept;

// One tensor's weights and optimizer state, all fp32, n elements each.
// state[i] for i < state_arrays(config) must be valid; PyTorch's lazily
// created state is modelled by `step` (see apply_cpu).
struct TensorState {
  float* weights = nullptr;
  float* state[3] = {nullptr, nullptr, nullptr};
  uint64_t n = 0;
};

// Applies one optimizer step to `tensor` with gradient `grad` (n elements
// of `dtype`, any alignment). `step` is PyTorch's per-parameter step count
// AFTER incrementing it for this update (1 on the first update): it selects
// the first-step momentum rule (buf = g, no dampening) and Adam's bias
// correction 1 - beta^step. Precondition: validate_update(config) is ok, step >= 1,
// grad does not alias the tensor. Tensors of kCpuSplitMinElements or more
// are split over threads (set_cpu_threads()). Never fails.
void apply_cpu(const OptimizerConfig& config, const TensorState& tensor, const void* grad, GradDtype dtype,
               uint64_t step);

// True when all n elements of grad are finite (no NaN, no +-Inf). Reads
// only; any alignment. Split as apply_cpu() is.
bool all_finite_cpu(const void* grad, GradDtype dtype, uint64_t n);

}  // namespace shmps::kernels
