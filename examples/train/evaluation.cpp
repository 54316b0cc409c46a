#include "evaluation.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <utility>

#include "shmps/status.hpp"

namespace shmps::train {
namespace {

constexpr size_t kTrainLossSamples = 10000;  // fixed training subset the curve scores
constexpr size_t kEvalBatch = 1000;

void print(const CurvePoint& p) {
  std::printf("epoch %.2f  train_loss %.4f  test_acc %.4f  pushes/s %.0f  rejected %llu  avg_staleness %.2f\n", p.epoch,
              p.train_loss, p.test_acc, p.pushes_per_s, static_cast<unsigned long long>(p.rejected), p.avg_staleness);
  std::fflush(stdout);
}

}  // namespace

std::string EvalSchedule::too_many() const {
  const std::string kept =
      " snapshots of the weights over " + std::to_string(total) + " updates; at most " + std::to_string(kMaxSnapshots);
  if (eval_every != 0)
    return "--eval-every " + std::to_string(eval_every) + " takes " + std::to_string(snapshots()) + kept +
           " (raise --eval-every)";
  return "--in-process scores its evaluations after training: --evals-per-epoch " + std::to_string(evals_per_epoch) +
         " over " + std::to_string(epochs) + " epochs takes " + std::to_string(snapshots()) + kept +
         " (lower --evals-per-epoch or --epochs, or use --eval-every)";
}

Curve::Curve(const MlpShape& shape, const Dataset& train, const Dataset& test, uint64_t per_epoch, bool defer)
    : train_(train),
      test_(test),
      mlp_(std::make_unique<Mlp>(shape, kEvalBatch)),
      per_epoch_(per_epoch),
      defer_(defer) {}

void Curve::record(Snapshot snapshot) {
  last_recorded_version_ = snapshot.version;
  if (defer_) {
    deferred_.push_back(std::move(snapshot));
    return;
  }
  score(snapshot);
}

void Curve::mark_training_start() {
  if (defer_)
    deferred_.back().elapsed_s = 0.0;
  else
    points_.back().elapsed_s = 0.0;
}

void Curve::score_deferred() {
  for (const Snapshot& s : deferred_) score(s);
  deferred_.clear();
}

// Test accuracy and loss, and the loss on the fixed training subset; the
// rate is over the interval since the previous point.
void Curve::score(const Snapshot& s) {
  const size_t train_n = std::min(train_.count, kTrainLossSamples);
  const float* params = s.weights.data();
  const EvalResult tr = mlp_->evaluate(params, train_.images.data(), train_.labels.data(), train_n);
  const EvalResult te = mlp_->evaluate(params, test_.images.data(), test_.labels.data(), test_.count);
  CurvePoint p;
  p.version = s.version;
  p.epoch = static_cast<double>(p.version) / static_cast<double>(per_epoch_);
  p.train_loss = tr.loss;
  p.test_loss = te.loss;
  p.test_acc = te.accuracy;
  if (!points_.empty()) {
    const CurvePoint& prev = points_.back();
    const double dt = s.elapsed_s - prev.elapsed_s;
    p.pushes_per_s = dt > 0 && p.version >= prev.version ? static_cast<double>(p.version - prev.version) / dt : 0;
  }
  p.rejected = s.rejected;
  p.avg_staleness = s.avg_staleness;
  p.elapsed_s = s.elapsed_s;
  print(p);
  points_.push_back(p);
}

bool csv_writable(const std::string& path) {
  if (path.empty()) return true;
  struct stat st {};
  const bool existed = ::lstat(path.c_str(), &st) == 0;  // a dangling link too: never unlinked below
  // O_APPEND: an existing file keeps its rows until write_csv() replaces it.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
  if (fd < 0) {
    std::cerr << "shmps-train: --csv " << path << ": cannot open for writing: " << errno_text(errno) << "\n";
    return false;
  }
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
  return true;
}

bool Curve::write_csv(const std::string& path) const {
  if (path.empty()) return true;
  errno = 0;
  std::ofstream csv(path);
  if (!csv) {
    std::cerr << "shmps-train: --csv " << path << ": cannot open for writing: " << errno_text(errno) << "\n";
    return false;
  }
  csv << "epoch,version,train_loss,test_loss,test_acc,pushes_per_s,rejected,avg_staleness,elapsed_s\n";
  for (const CurvePoint& p : points_) {
    csv << p.epoch << ',' << p.version << ',' << p.train_loss << ',' << p.test_loss << ',' << p.test_acc << ','
        << p.pushes_per_s << ',' << p.rejected << ',' << p.avg_staleness << ',' << p.elapsed_s << '\n';
  }
  csv.close();
  if (!csv) {
    std::cerr << "shmps-train: --csv " << path << ": write failed: " << errno_text(errno) << "\n";
    return false;
  }
  return true;
}

}  // namespace shmps::train
