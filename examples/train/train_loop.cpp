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

// Counts a push's outcome into `counts`: true when it was applied, false
// when it was stale or lost with a server that died (to redo); any other
// error is returned, naming the push.
Result<bool> count_push(const Result<uint64_t>& pushed, LoopCounts& counts) {
  if (pushed.ok()) {
    ++counts.applied;
    return true;
  }
  const ErrorCode code = pushed.status().code();
  if (code == ErrorCode::kStale) {
    ++counts.rejected;
  } else if (code == ErrorCode::kServerRestarted) {
    ++counts.lost;
  } else {
    return Status(code, "push: " + pushed.status().to_string());
  }
  return false;
}

// Takes the answer of the pull made with a push: `pulled` current at its
// version, or not current when it was lost with the server (made again
// before the next gradient); any other error is returned, naming the pull.
Status take_pull(const Result<uint64_t>& answer, Pulled& pulled) {
  pulled.current = answer.ok();
  if (answer.ok()) {
    pulled.version = *answer;
  } else if (answer.status().code() != ErrorCode::kServerRestarted) {
    return Status(answer.status().code(), "pull: " + answer.status().to_string());
  }
  return Status::Ok();
}

Status after(const AfterApply& after_apply, const LoopCounts& counts) {
  if (after_apply && !after_apply(counts.applied)) return Status(ErrorCode::kInternal, "stopped after an update");
  return Status::Ok();
}

// One update from `batch`: the gradient on the weights `pulled` names (a
// pull first where they are not current), then push_and_pull(), until a
// push is applied; stale and lost pushes are counted and redone on the
// weights pulled with them.
Status apply_one(Mlp& mlp, const Minibatch& batch, UpdatePath& path, LoopCounts& counts, Pulled& pulled,
                 const AfterApply& after_apply) {
  while (true) {
    if (!pulled.current) {
      Result<uint64_t> v = path.pull();
      if (!v.ok() && v.status().code() == ErrorCode::kServerRestarted) continue;
      if (!v.ok()) return Status(v.status().code(), "pull: " + v.status().to_string());
      pulled = {true, *v};
    }
    mlp.loss_and_gradient(path.weights(), batch.x(), batch.y(), batch.size(), path.grad());
    UpdatePath::Step step = path.push_and_pull(pulled.version);
    Result<bool> applied = count_push(step.pushed, counts);
    if (!applied.ok()) return applied.status();
    if (Status s = take_pull(step.pulled, pulled); !s.ok()) return s;
    if (*applied) return after(after_apply, counts);
  }
}

// The pipelined loop's step in flight: its minibatch, kept to redo it.
struct Pipeline {
  const Minibatch* in_flight = nullptr;
};

// Ends the step in flight, if any: true when it was applied (or there was
// none) and its pull made the weights current; false when the caller must
// start again from apply_one(): its push was redone here where it was stale
// or lost, or its pull was lost.
Result<bool> end_in_flight(Mlp& mlp, UpdatePath& path, LoopCounts& counts, Pulled& pulled, Pipeline& pipe,
                           const AfterApply& after_apply) {
  if (pipe.in_flight == nullptr) return true;
  const Minibatch& batch = *pipe.in_flight;
  pipe.in_flight = nullptr;
  UpdatePath::Step step = path.end_step();
  Result<bool> applied = count_push(step.pushed, counts);
  if (!applied.ok()) return applied.status();
  if (Status s = take_pull(step.pulled, pulled); !s.ok()) return s;
  if (*applied) {
    if (Status s = after(after_apply, counts); !s.ok()) return s;
    return pulled.current;
  }
  if (Status s = apply_one(mlp, batch, path, counts, pulled, after_apply); !s.ok()) return s;
  return false;
}

// One pipelined update from `batch`: its gradient from the current weights
// while the step in flight is served, then that step's answers, then this
// gradient sent (begin_step) with a pull. A stale or lost step in flight is
// redone, and so is this minibatch, its gradient being of the same weights.
Status pipelined_one(Mlp& mlp, const Minibatch& batch, UpdatePath& path, LoopCounts& counts, Pulled& pulled,
                     Pipeline& pipe, const AfterApply& after_apply) {
  if (!pulled.current) return apply_one(mlp, batch, path, counts, pulled, after_apply);
  mlp.loss_and_gradient(path.weights(), batch.x(), batch.y(), batch.size(), path.grad());
  const uint64_t version = pulled.version;
  Result<bool> flowing = end_in_flight(mlp, path, counts, pulled, pipe, after_apply);
  if (!flowing.ok()) return flowing.status();
  if (!*flowing) return apply_one(mlp, batch, path, counts, pulled, after_apply);
  if (Status s = path.begin_step(version); !s.ok()) {
    if (s.code() != ErrorCode::kServerRestarted) return Status(s.code(), "push: " + s.to_string());
    ++counts.lost;
    pulled.current = false;
    return apply_one(mlp, batch, path, counts, pulled, after_apply);
  }
  pipe.in_flight = &batch;
  return Status::Ok();
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
  // Two minibatches: the pipeline's step in flight keeps its own.
  Minibatch batches[2] = {Minibatch(plan.batch, train.features), Minibatch(plan.batch, train.features)};
  size_t next = 0;
  Mlp mlp(shape, plan.batch);
  std::mt19937_64 rng(plan.seed * 0x9E3779B97F4A7C15ull + plan.index + 1);
  Pulled pulled;
  Pipeline pipe;

  for (size_t epoch = 0; epoch < plan.epochs; ++epoch) {
    std::shuffle(shard.begin(), shard.end(), rng);
    for (size_t start = 0; start < shard.size(); start += plan.batch) {
      Minibatch& batch = batches[next];
      next ^= 1;
      batch.gather(train, shard, start, std::min(plan.batch, shard.size() - start));
      const Status s = plan.pipeline ? pipelined_one(mlp, batch, path, counts, pulled, pipe, after_apply)
                                     : apply_one(mlp, batch, path, counts, pulled, after_apply);
      if (!s.ok()) return s;
    }
  }
  Result<bool> last = end_in_flight(mlp, path, counts, pulled, pipe, after_apply);
  return last.ok() ? Status::Ok() : last.status();
}

}  // namespace shmps::train
