// The counters Worker::stats() reports, declared once: SHMPS_SERVER_STATS(X)
// expands X(name, source, from) for each, in the wire order of the reply.
// It generates shmps::ServerStats (worker.hpp), the reply the server writes
// (shm::StatsReply, layout.hpp), the server's fill of it, the worker's copy
// out of it and the Python package's Stats, so a counter added here (and
// counted where it happens) reaches all of them. `source` says where the
// server takes the value:
//   block     StatsBlock::<from>, the server-wide counter (layout.hpp)
//   entry     WorkerEntry::<from> of the worker that asks: its own counts
//   rejected  StatsBlock::rejected: refused requests of every kind, by
//             cause: `from` is stale (pushes), nonfinite (pushes and
//             inits), timeout (pulls held by --staleness-policy wait past
//             their wait), or invalid (every other cause, of any request:
//             bad length, dtype, range, id, request, no capacity)
// The counters: the version (applied updates, or the restored
// checkpoint's), gradients applied, weight pulls, the mean staleness of the
// last 128 applied pushes in millionths, requests rejected by cause, the
// requests queued in all lanes now and the most ever queued at once,
// workers attached now, died, and evicted (sessions the server ended: a
// process stopped too long, a corrupt lane), and the asking worker's
// applied and rejected pushes and its pulls; then what the staleness
// policies did: pulls held back (wait) and their time in all, in ns, pushes
// applied with a reduced lr (scale) and the sum of their factors in
// millionths, server-wide and the asking worker's own; the threads the
// last update of a tensor from 4 MiB ran on; the federation's (zero when
// the server is not federated): rounds completed, hosts in the last round,
// its time in ns, bytes contributed, local updates not yet merged, the
// anchor's hash, failed rounds; the sum of the asking worker's own scale
// factors, in millionths.
// Plain preprocessor lists; part of the public API (installed with
// worker.hpp). Append only: the order is the reply's layout.
#pragma once

#define SHMPS_SERVER_STATS(X)                              \
  X(version, block, version)                               \
  X(gradients_applied, block, gradients_applied)           \
  X(weights_pulled, block, weights_pulled)                 \
  X(avg_staleness_micro, block, avg_staleness_micro)       \
  X(rejected_stale, rejected, stale)                       \
  X(rejected_invalid, rejected, invalid)                   \
  X(rejected_nonfinite, rejected, nonfinite)               \
  X(ring_depth, block, ring_depth)                         \
  X(ring_high_water, block, ring_high_water)               \
  X(workers_attached, block, workers_attached)             \
  X(workers_died, block, workers_died)                     \
  X(my_pushes_applied, entry, pushes_applied)              \
  X(my_pushes_rejected, entry, pushes_rejected)            \
  X(my_pulls, entry, pulls)                                \
  X(workers_evicted, block, workers_evicted)               \
  X(rejected_timeout, rejected, timeout)                   \
  X(pulls_waited, block, pulls_waited)                     \
  X(wait_ns, block, wait_ns)                               \
  X(pushes_scaled, block, pushes_scaled)                   \
  X(scale_factor_sum_micro, block, scale_factor_sum_micro) \
  X(my_pulls_waited, entry, pulls_waited)                  \
  X(my_wait_ns, entry, wait_ns)                            \
  X(my_pushes_scaled, entry, pushes_scaled)                \
  X(apply_threads, block, apply_threads)                   \
  X(fed_round, block, fed_round)                           \
  X(fed_members, block, fed_members)                       \
  X(fed_round_ns, block, fed_round_ns)                     \
  X(fed_bytes, block, fed_bytes)                           \
  X(fed_drift, block, fed_drift)                           \
  X(fed_anchor_hash, block, fed_anchor_hash)               \
  X(fed_failures, block, fed_failures)                     \
  X(my_scale_factor_sum_micro, entry, scale_factor_sum_micro)
