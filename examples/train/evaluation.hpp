// shmps-train's learning curve: when to evaluate (EvalSchedule), the
// weights taken at each point (Snapshot), their scores on the test set and
// a fixed training subset (Curve), the printed line per point and the CSV
// file. One thread; scoring uses OpenBLAS, so make the Curve after the
// workers are forked.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "idx.hpp"
#include "mlp.hpp"

namespace shmps::train {

// Weight snapshots a deferred-scoring run may keep for scoring after
// training (814 KB each for the default model).
inline constexpr uint64_t kMaxSnapshots = 500;

// The evaluation points during training, in applied pushes: points 1 ..
// count()-1 at at(k); the final weights are scored after training.
struct EvalSchedule {
  uint64_t total = 0;      // applied pushes of the whole run
  uint64_t per_epoch = 1;  // applied pushes per epoch
  uint64_t epochs = 1;
  uint64_t evals_per_epoch = 1;
  uint64_t eval_every = 0;  // > 0: every N pushes instead
  bool deferred = false;    // snapshots kept and scored after training
  uint64_t count() const { return eval_every != 0 ? (total + eval_every - 1) / eval_every : epochs * evals_per_epoch; }
  uint64_t at(uint64_t k) const { return eval_every != 0 ? k * eval_every : per_epoch * k / evals_per_epoch; }
  // The snapshots a deferred run keeps: the initial weights, at most one
  // per point and per applied push, and the final weights.
  uint64_t snapshots() const { return std::min(count(), total) + 1; }
  // Deferred scoring keeps every snapshot until training ends: refuse a
  // schedule that would hold more than kMaxSnapshots.
  bool fits() const { return !deferred || snapshots() <= kMaxSnapshots; }
  // Why it does not fit, and which option to change.
  std::string too_many() const;
};

// The weights at one evaluation point, with what the curve records about
// them; scored at once (live) or after training (--eval-every, --in-process).
struct Snapshot {
  uint64_t version = 0;  // applied pushes since the start of this run
  double elapsed_s = 0;  // training time when they were taken
  uint64_t rejected = 0;
  double avg_staleness = 0;
  std::vector<float> weights;
};

// One row of the curve.
struct CurvePoint {
  double epoch = 0;
  uint64_t version = 0;  // applied pushes since the start of this run
  double train_loss = 0;
  double test_loss = 0;
  double test_acc = 0;
  double pushes_per_s = 0;
  uint64_t rejected = 0;
  double avg_staleness = 0;
  double elapsed_s = 0;
};

// Whether the CSV file at `path` can be written ("": no file, true),
// checked before training so that a bad path costs no run: false with the
// reason printed as write_csv() prints it. Leaves no file behind.
bool csv_writable(const std::string& path);

class Curve {
 public:
  // `per_epoch`: applied pushes per epoch. `defer`: keep snapshots and
  // score them in score_deferred(), so that evaluation takes no CPU from
  // training and elapsed_s is training time alone. The datasets must
  // outlive the Curve.
  Curve(const MlpShape& shape, const Dataset& train, const Dataset& test, uint64_t per_epoch, bool defer);

  // Scores `snapshot` now (printing its line), or keeps it for
  // score_deferred().
  void record(Snapshot snapshot);
  // Training time runs from here: the last point recorded (the initial
  // weights) gets elapsed_s 0.
  void mark_training_start();
  // Scores the kept snapshots, in order.
  void score_deferred();

  bool deferred() const { return defer_; }
  uint64_t last_recorded_version() const { return last_recorded_version_; }
  // Precondition: a point has been scored.
  double final_test_accuracy() const { return points_.back().test_acc; }

  // Writes the scored points to `path` (header, then a row each; "": no
  // file); false with the reason printed when it cannot.
  bool write_csv(const std::string& path) const;

 private:
  void score(const Snapshot& snapshot);

  const Dataset& train_;
  const Dataset& test_;
  std::unique_ptr<Mlp> mlp_;
  uint64_t per_epoch_;
  bool defer_;
  std::vector<CurvePoint> points_;
  std::vector<Snapshot> deferred_;  // kept for scoring after training, when deferred
  uint64_t last_recorded_version_ = 0;
};

}  // namespace shmps::train
