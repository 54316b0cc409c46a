#include "in_process.hpp"

#include <chrono>
#include <cstdio>
#include <iostream>
#include <utility>
#include <vector>

#include "evaluation.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "train_loop.hpp"

namespace shmps::train {
namespace {

using Clock = std::chrono::steady_clock;

// Weights, optimizer state and update rule of the server's host backend
// (the non-finite check, then apply_cpu per tensor with PyTorch's
// per-tensor step count), in this process's memory. Every push is applied:
// nothing is ever stale.
class LocalPath final : public UpdatePath {
 public:
  LocalPath(const MlpShape& shape, std::vector<float> init, const kernels::OptimizerConfig& config)
      : config_(config),
        tensors_(mlp_tensors(shape)),
        weights_(std::move(init)),
        grad_(weights_.size()),
        steps_(tensors_.size(), 0) {
    state_.resize(kernels::state_arrays(config_));
    for (std::vector<float>& a : state_) a.assign(weights_.size(), 0.0f);
  }
  Result<uint64_t> pull() override { return version_; }
  Step push_and_pull(uint64_t /*version: always current*/) override {
    Result<uint64_t> pushed = push();
    return {std::move(pushed), version_};
  }
  const float* weights() const override { return weights_.data(); }
  float* grad() override { return grad_.data(); }

 private:
  Result<uint64_t> push() {
    if (!kernels::all_finite_cpu(grad_.data(), kernels::GradDtype::kF32, grad_.size()))
      return Status(ErrorCode::kNonFinite, "NaN or Inf in the gradient");
    for (size_t t = 0; t < tensors_.size(); ++t) {
      kernels::TensorState ts;
      ts.weights = weights_.data() + tensors_[t].offset;
      for (size_t i = 0; i < state_.size(); ++i) ts.state[i] = state_[i].data() + tensors_[t].offset;
      ts.n = tensors_[t].count;
      kernels::apply_cpu(config_, ts, grad_.data() + tensors_[t].offset, kernels::GradDtype::kF32, ++steps_[t]);
    }
    return ++version_;
  }

  kernels::OptimizerConfig config_;
  std::vector<ParamTensor> tensors_;
  std::vector<float> weights_;
  std::vector<std::vector<float>> state_;
  std::vector<float> grad_;
  std::vector<uint64_t> steps_;  // per tensor, as the server counts them
  uint64_t version_ = 0;
};

}  // namespace

int run_in_process(const Options& o, const MlpShape& shape, const Dataset& train, const Dataset& test) {
  const kernels::OptimizerConfig config = optimizer_config(o);  // checked by parse_options()
  std::vector<float> init(mlp_parameter_count(shape));
  he_init(shape, init, o.seed);
  LocalPath path(shape, std::move(init), config);
  set_blas_threads(1);  // as a worker: the comparison is of where updates are applied

  const uint64_t per_epoch = steps_per_epoch(train.count, o.batch);
  Curve curve(shape, train, test, per_epoch, /*defer=*/true);
  // Every evaluation is scored after training, so at most kMaxSnapshots.
  const EvalSchedule schedule{per_epoch * o.epochs, per_epoch, o.epochs, o.evals_per_epoch, o.eval_every,
                              /*deferred=*/true};
  if (!schedule.fits()) {
    std::cerr << "shmps-train: " << schedule.too_many() << "\n";
    return kExitUsage;
  }
  std::printf("shmps-train: in-process (no server), batch %zu, %s lr %s, %zu epochs of %llu updates\n", o.batch,
              o.optimizer.c_str(), format_double(o.lr).c_str(), o.epochs, static_cast<unsigned long long>(per_epoch));
  std::fflush(stdout);

  Clock::time_point start = Clock::now();
  auto snapshot = [&](uint64_t version) {
    Snapshot s;
    s.version = version;
    s.elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();
    s.weights.assign(path.weights(), path.weights() + mlp_parameter_count(shape));
    return s;
  };
  curve.record(snapshot(0));
  curve.mark_training_start();
  start = Clock::now();
  uint64_t next_eval = 1;
  LoopCounts counts;
  const WorkerPlan plan{0, 1, o.epochs, o.batch, o.seed, ""};
  const Status s = train_shard(plan, train, shape, path, counts, [&](uint64_t applied) {
    if (next_eval < schedule.count() && applied >= schedule.at(next_eval)) {
      curve.record(snapshot(applied));
      ++next_eval;
    }
    return true;
  });
  const double train_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (!s.ok()) {
    std::cerr << "shmps-train: " << s.message() << "\n";
    return kExitFailure;
  }
  if (curve.last_recorded_version() != counts.applied) curve.record(snapshot(counts.applied));
  curve.score_deferred();
  std::printf("updates: applied %llu in this process (no server)\n", static_cast<unsigned long long>(counts.applied));
  std::printf("final test accuracy: %.4f (wall time %.1f s, in-process)\n", curve.final_test_accuracy(), train_s);
  std::fflush(stdout);
  if (!curve.write_csv(o.csv)) return kExitFailure;
  return counts.applied == schedule.total ? 0 : kExitFailure;
}

}  // namespace shmps::train
