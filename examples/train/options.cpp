#include "options.hpp"

#include <unistd.h>

#include <boost/program_options.hpp>
#include <charconv>
#include <cmath>
#include <iostream>

#include "shmps/cli.hpp"
#include "shmps/shm/segment.hpp"

namespace po = boost::program_options;

namespace shmps::train {
namespace {

double default_lr(const std::string& optimizer) { return optimizer == "sgd" ? 0.01 : 1e-3; }

}  // namespace

std::optional<int> parse_options(int argc, char** argv, Options& o) {
  std::string shard;
  po::options_description desc("shmps-train options");
  // clang-format off
  desc.add_options()
    ("help,h", "show this help")
    ("version", "print the version and exit")
    ("workers", po::value(&o.workers)->default_value(o.workers), "worker processes")
    ("epochs", po::value(&o.epochs)->default_value(o.epochs), "passes over the training set")
    ("batch", po::value(&o.batch)->default_value(o.batch), "minibatch size per push")
    ("optimizer", po::value(&o.optimizer)->default_value(o.optimizer), "adam, adamw or sgd")
    ("lr", po::value(&o.lr), "learning rate (default: adam/adamw 0.001, sgd 0.01)")
    ("momentum", po::value(&o.momentum)->default_value(o.momentum, "0.9"), "SGD momentum")
    ("nesterov", po::bool_switch(&o.nesterov), "SGD with Nesterov momentum")
    ("weight-decay", po::value(&o.weight_decay), "weight decay (default: the server's, 0 or AdamW 0.01)")
    ("max-staleness", po::value(&o.max_staleness)->default_value(o.max_staleness),
     "versions a push may lag behind the server before it is rejected")
    ("train-limit", po::value(&o.train_limit)->default_value(0), "use the first N training images (0: all)")
    ("test-limit", po::value(&o.test_limit)->default_value(0), "use the first N test images (0: all)")
    ("shard", po::value(&shard), "I/N: train on images I, I+N, I+2N, ... of those (one host's share of a federated job)")
    ("evals-per-epoch", po::value(&o.evals_per_epoch)->default_value(1), "evaluations per epoch")
    ("eval-every", po::value(&o.eval_every)->default_value(0),
     "evaluate every N applied updates instead: the weights are snapshotted during training and scored "
     "after it, so elapsed_s excludes evaluation (0: --evals-per-epoch)")
    ("in-process", po::bool_switch(&o.in_process),
     "the ceiling: one process applies each gradient with the CPU optimizer itself (no server, no shared "
     "memory); same model, data order, batch and optimizer as --workers 1")
    ("data-dir", po::value(&o.data_dir)->default_value(o.data_dir), "folder of the Fashion-MNIST IDX files")
    ("csv", po::value(&o.csv), "write the learning curve to this CSV file")
    ("seed", po::value(&o.seed)->default_value(o.seed), "seed of the initialisation and the shuffles")
    ("name", po::value(&o.name), "server segment name (default: train_<pid>)")
    ("server-bin", po::value(&o.server_bin), "shmps-server to start (default: beside shmps-train)")
    ("connect", po::value(&o.connect), "use the running server of this name instead of starting one")
    ("evaluate", po::bool_switch(&o.evaluate),
     "with --connect: score that server's weights on the test set, train nothing (a federated job's merged model)")
    ("checkpoint-every", po::value(&o.checkpoint_every)->default_value(o.checkpoint_every),
     "own server: checkpoint every N updates; if the server dies it is restarted and resumes there (0: no restart)");
  // clang-format on
  po::variables_map vm;
  try {
    vm = cli::parse(argc, argv, desc);
  } catch (const po::error& e) {
    std::cerr << "shmps-train: " << e.what() << "\nsee shmps-train --help\n";
    return kExitUsage;
  }
  if (vm.count("help") != 0) {
    std::cout << desc;
    return 0;
  }
  if (vm.count("version") != 0) {
    std::cout << cli::version_line("shmps-train") << "\n";
    return 0;
  }
  std::string bad;
  if (!shard.empty()) {
    const size_t slash = shard.find('/');
    try {
      // Digits only: stoul reads "-1" as 2^64 - 1.
      if (slash == std::string::npos || shard.find_first_not_of("0123456789/") != std::string::npos)
        throw std::invalid_argument(shard);
      size_t used = 0;
      o.shard_index = std::stoul(shard.substr(0, slash), &used);
      if (used != slash) throw std::invalid_argument(shard);
      o.shard_count = std::stoul(shard.substr(slash + 1), &used);
      if (used != shard.size() - slash - 1) throw std::invalid_argument(shard);
    } catch (const std::exception&) {
      o.shard_count = 0;
    }
    if (o.shard_count == 0 || o.shard_index >= o.shard_count)
      bad = "--shard must be I/N with I < N, got '" + shard + "'";
  }
  // Its own server has two entries more (the evaluation worker, one spare),
  // and a server at most 256.
  if (o.workers < 1 || o.workers > 254) bad = "--workers must be 1..254";
  // Bounded so that epochs x pushes per epoch cannot wrap (at most 60,000
  // pushes per epoch: batch 1 over all of Fashion-MNIST).
  if (o.epochs < 1 || o.epochs > kMaxEpochs) bad = "--epochs must be 1.." + std::to_string(kMaxEpochs);
  if (o.batch < 1 || o.batch > 8192) bad = "--batch must be 1..8192";
  if (o.optimizer != "adam" && o.optimizer != "adamw" && o.optimizer != "sgd") {
    bad = "--optimizer must be adam, adamw or sgd";
  }
  if (vm.count("lr") == 0) o.lr = default_lr(o.optimizer);
  if (!(o.lr > 0.0) || !std::isfinite(o.lr)) bad = "--lr must be finite and > 0";
  if (vm.count("weight-decay") != 0 && !(o.weight_decay >= 0.0 && std::isfinite(o.weight_decay)))
    bad = "--weight-decay must be finite and >= 0";
  // As the server refuses what the optimizer does not read.
  if (o.optimizer != "sgd" && (!vm["momentum"].defaulted() || o.nesterov))
    bad = "--optimizer " + o.optimizer +
          " does not use --momentum or --nesterov: SGD options; remove them, or choose --optimizer sgd";
  // The hyperparameters as the server (or --in-process) checks them, so a
  // bad one is a usage error here rather than the server's exit 1. With
  // --connect the server's own optimizer applies.
  if (bad.empty() && o.connect.empty())
    if (const Status s = kernels::validate(optimizer_config(o)); !s.ok()) bad = s.message();
  if (o.evals_per_epoch < 1 || o.evals_per_epoch > 1000) bad = "--evals-per-epoch must be 1..1000";
  if (o.evaluate && o.connect.empty()) bad = "--evaluate scores a running server's weights: it needs --connect";
  // A segment name as the server checks it, so that a bad one is a usage
  // error here, before any server starts.
  if (vm.count("name") != 0)
    if (const Status s = shm::validate_name(o.name); !s.ok()) bad = "--name: " + s.message();
  if (vm.count("connect") != 0)
    if (const Status s = shm::validate_name(o.connect); !s.ok()) bad = "--connect: " + s.message();
  if (o.in_process) {
    if (vm.count("workers") != 0 && !vm["workers"].defaulted() && o.workers != 1)
      bad = "--in-process runs one training loop: --workers must be 1";
    if (!o.connect.empty()) bad = "--in-process uses no server: drop --connect";
    o.workers = 1;
  }
  if (!bad.empty()) {
    std::cerr << "shmps-train: " << bad << "\nsee shmps-train --help\n";
    return kExitUsage;
  }
  // The running server's configuration rules: say which options of ours
  // it makes void, rather than ignore them silently.
  if (!o.connect.empty()) {
    std::string ignored;
    for (const char* option :
         {"optimizer", "lr", "momentum", "nesterov", "weight-decay", "max-staleness", "checkpoint-every"}) {
      if (vm.count(option) != 0 && !vm[option].defaulted())
        ignored += std::string(ignored.empty() ? "" : ", ") + "--" + option;
    }
    if (!ignored.empty())
      std::cerr << "shmps-train: warning: ignoring " << ignored << ": with --connect the running server's "
                << "configuration applies\n";
  }
  if (o.name.empty()) o.name = "train_" + std::to_string(::getpid());
  return std::nullopt;
}

kernels::OptimizerConfig optimizer_config(const Options& o) {
  kernels::OptimizerConfig c;
  kernels::parse_optimizer_kind(o.optimizer, &c.kind);  // checked by parse_options
  c.lr = static_cast<float>(o.lr);
  if (c.kind == kernels::OptimizerKind::kSgd) {
    c.momentum = static_cast<float>(o.momentum);
    c.nesterov = o.nesterov;
  }
  c.weight_decay = o.weight_decay >= 0.0                      ? static_cast<float>(o.weight_decay)
                   : c.kind == kernels::OptimizerKind::kAdamW ? 0.01f
                                                              : 0.0f;
  return c;
}

std::string format_double(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace shmps::train
