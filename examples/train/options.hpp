// shmps-train's command line: the options, their checks, and the optimizer
// they ask for. Plain values; parse once in main() before any thread or
// child exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "idx.hpp"
#include "shmps/kernels/optimizer.hpp"

namespace shmps::train {

// Exit status: 0 done, kExitFailure a runtime failure (server, worker,
// mismatch of counts), kExitUsage bad usage, missing dataset, or a
// --connect server whose weights are all zero; 128 + N when signal N
// (SIGINT, SIGTERM, SIGHUP, SIGPIPE) stopped the job, after its cleanup.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
// The most --epochs.
inline constexpr size_t kMaxEpochs = 1'000'000;

struct Options {
  size_t workers = 4;
  size_t epochs = 20;
  size_t batch = 64;
  std::string optimizer = "adam";
  double lr = 0.0;  // parse_options(): the optimizer's default where --lr is not given
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = -1.0;  // < 0: the server's default (0; AdamW 0.01)
  uint64_t max_staleness = 8;
  size_t train_limit = 0;
  size_t shard_index = 0;  // --shard I/N: train on images I, I+N, ... (a host's share)
  size_t shard_count = 1;
  size_t test_limit = 0;
  size_t evals_per_epoch = 1;
  uint64_t eval_every = 0;  // > 0: snapshot every N applied updates, score after training
  bool in_process = false;  // the ceiling: no server, apply_cpu in this process
  std::string data_dir = kDefaultFashionMnistDir;
  std::string csv;
  uint64_t seed = 1;
  std::string name;
  std::string server_bin;
  std::string connect;
  bool evaluate = false;             // with connect: score its weights, train nothing
  uint64_t checkpoint_every = 1000;  // own server: checkpoint so a restart resumes
};

// Parses argv into `o` and checks it; fills the defaults that depend on
// other options (lr, name; workers 1 with --in-process). Returns the exit
// code to leave with when there is nothing to run: 0 after --help or
// --version (printed), kExitUsage after a bad option (printed to stderr).
std::optional<int> parse_options(int argc, char** argv, Options& o);

// The optimizer as the server started by shmps-train runs it (its option
// defaults: momentum only for SGD, weight decay 0, AdamW 0.01).
// Precondition: `o` passed parse_options.
kernels::OptimizerConfig optimizer_config(const Options& o);

// Shortest text that reads back as the same double.
std::string format_double(double v);

}  // namespace shmps::train
