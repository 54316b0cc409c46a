// shmps-train --in-process: the ceiling the server path is measured
// against. The same training loop (train_shard) with the same data order,
// batch and optimizer as --workers 1, in this one process, each gradient
// applied at once with shmps::kernels::apply_cpu; no server, no shared
// memory. Single-threaded.
#pragma once

#include "idx.hpp"
#include "mlp.hpp"
#include "options.hpp"

namespace shmps::train {

// Trains, then scores the snapshots taken at the evaluation points (so the
// wall time is training alone) and writes the curve. Returns the exit code:
// 0, kExitUsage for an optimizer the server would refuse or too many
// snapshots, kExitFailure for a failed loop or CSV file.
int run_in_process(const Options& o, const MlpShape& shape, const Dataset& train, const Dataset& test);

}  // namespace shmps::train
