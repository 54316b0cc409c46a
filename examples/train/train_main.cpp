// shmps-train: asynchronous data-parallel training of a 784-256-10 MLP on
// Fashion-MNIST through a shmps-server.
//
// The parent (trainer.hpp) loads the data, writes a He initialisation to a
// temp file, starts shmps-server with it (own_server.hpp; or uses
// --connect), attaches as a worker of its own for evaluation, and forks N
// worker processes (worker_process.hpp). Each worker runs the training
// loop (train_loop.hpp): it pulls all weights, computes one minibatch
// gradient of its shard and pushes it with the version it pulled; the
// server applies it unless it is more than --max-staleness versions old
// (then the worker pulls and tries again). The parent evaluates every epoch
// of applied pushes and prints a curve (evaluation.hpp).
//
// --in-process (in_process.hpp) is the ceiling the server path is measured
// against: the same training loop with the same data order, batch and
// optimizer in this one process; no server, no shared memory.
//
// Exit status (options.hpp): 0 done, 1 a runtime failure (server, worker,
// mismatch of counts), 2 bad usage, missing dataset, or a --connect server
// whose weights are all zero.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <utility>

#include "mlp.hpp"
#include "options.hpp"
#include "stop_signals.hpp"
#include "trainer.hpp"

namespace {

// OpenBLAS fixes its kernels when it is loaded: when it took this CPU for
// an older one (shmps::train::better_blas_coretype()), run this program
// again with OPENBLAS_CORETYPE set, before anything else happens (the
// workers are forked from this process and keep its choice). A user's
// own OPENBLAS_CORETYPE is never overridden; a failed exec only costs
// the speed.
void use_the_cpus_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string chosen = shmps::train::blas_corename();
  const std::string better = shmps::train::better_blas_coretype(chosen, shmps::train::cpu_features());
  if (better.empty()) return;
  std::fprintf(stderr,
               "shmps-train: OpenBLAS chose its %s kernels, but this CPU runs %s ones (its model number is "
               "hidden, e.g. by a hypervisor); restarting with OPENBLAS_CORETYPE=%s\n",
               chosen.c_str(), better.c_str(), better.c_str());
  ::setenv("OPENBLAS_CORETYPE", better.c_str(), /*overwrite=*/1);
  std::fflush(nullptr);
  ::execv("/proc/self/exe", argv);
  std::fprintf(stderr, "shmps-train: exec /proc/self/exe: %s; going on with the %s kernels\n", std::strerror(errno),
               chosen.c_str());
  ::unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    shmps::train::Options options;
    if (std::optional<int> rc = shmps::train::parse_options(argc, argv, options)) return *rc;
    use_the_cpus_blas_kernels(argv);  // after --help and bad options, before the first thread or child
    int rc = 0;
    {
      shmps::train::Trainer trainer(std::move(options));
      rc = trainer.run();
    }  // the cleanup, before dying of a signal that stopped the job
    shmps::train::die_of_stop_signal();
    return rc;
  } catch (const std::exception& e) {
    std::cerr << "shmps-train: " << e.what() << "\n";
    return 1;
  }
}
