#include "train_loop.hpp"

#include <algorithm>
#include <random>
#include <vector>

namespace shmps::train {
namespace {

// The examples of one minibatch, copied out of the training set.
class Minibatch {
 public:
  Minibatch(size_t batch, size_t features) : features_(features), x_(batch * features), y_(batch) {}
  // Copies examples shard[start .. start+n) in.
  void gather(const Dataset& train, const std::vector<uint32_t>& shard, size_t start, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      const size_t ex = shard[start + i];
      std::copy_n(train.images.data() + ex * features_, features_, x_.data() + i * features_);
      y_[i] = train.labels[ex];
    }
    n_ = n;
  }
  const float* x() const { return x_.data(); }
  const uint8_t* y() const { return y_.data(); }
  size_t size() const { return n_; }

 private:
  size_t features_;
  std::vector<float> x_;
  std::vector<uint8_t> y_;
  size_t n_ = 0;
};

// The version weights() holds, once known current: not before the first
// pull, nor after a failed one.
struct Pulled {
  bool current = false;
  uint64_t version = 0;
};

// One update from `batch`: the gradient on the weights `pulled` names (a
// pull first where they are not current), then push_and_pull(), until a
// push is applied; stale and lost pushes are counted and redone on the
// weights pulled with them.
Status apply_one(Mlp& mlp, const Minibatch& batch, UpdatePath& path, LoopCounts& counts, Pulled& pulled) {
  while (true) {
    if (!pulled.current) {
      Result<uint64_t> v = path.pull();
      if (!v.ok() && v.status().code() == ErrorCode::kServerRestarted) continue;
      if (!v.ok()) return Status(v.status().code(), "pull: " + v.status().to_string());
      pulled = {true, *v};
    }
    mlp.loss_and_gradient(path.weights(), batch.x(), batch.y(), batch.size(), path.grad());
    UpdatePath::Step step = path.push_and_pull(pulled.version);
    const ErrorCode pushed = step.pushed.status().code();
    if (!step.pushed.ok() && pushed != ErrorCode::kStale && pushed != ErrorCode::kServerRestarted)
      return Status(pushed, "push: " + step.pushed.status().to_string());
    if (step.pushed.ok()) {
      ++counts.applied;
    } else if (pushed == ErrorCode::kStale) {
      ++counts.rejected;
    } else {
      ++counts.lost;
    }
    pulled.current = step.pulled.ok();
    if (step.pulled.ok()) {
      pulled.version = *step.pulled;
    } else if (step.pulled.status().code() != ErrorCode::kServerRestarted) {
      return Status(step.pulled.status().code(), "pull: " + step.pulled.status().to_string());
    }
    if (step.pushed.ok()) return Status::Ok();
  }
}

}  // namespace

size_t shard_size(size_t count, size_t index, size_t workers) {
  return count > index ? (count - index + workers - 1) / workers : 0;
}

size_t steps_per_epoch(size_t shard, size_t batch) { return (shard + batch - 1) / batch; }

Status train_shard(const WorkerPlan& plan, const Dataset& train, const MlpShape& shape, UpdatePath& path,
                   LoopCounts& counts, const AfterApply& after_apply) {
  std::vector<uint32_t> shard;
  for (size_t i = plan.index; i < train.count; i += plan.workers) shard.push_back(static_cast<uint32_t>(i));
  Minibatch batch(plan.batch, train.features);
  Mlp mlp(shape, plan.batch);
  std::mt19937_64 rng(plan.seed * 0x9E3779B97F4A7C15ull + plan.index + 1);
  Pulled pulled;

  for (size_t epoch = 0; epoch < plan.epochs; ++epoch) {
    std::shuffle(shard.begin(), shard.end(), rng);
    for (size_t start = 0; start < shard.size(); start += plan.batch) {
      batch.gather(train, shard, start, std::min(plan.batch, shard.size() - start));
      if (Status s = apply_one(mlp, batch, path, counts, pulled); !s.ok()) return s;
      if (after_apply && !after_apply(counts.applied)) return Status(ErrorCode::kInternal, "stopped after an update");
    }
  }
  return Status::Ok();
}

}  // namespace shmps::train
