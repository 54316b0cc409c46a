// A configuration reload (SIGHUP): what may change while workers run is
// applied and logged old -> new; any other difference waits for a restart
// and is logged as such. Consumer thread only.
#pragma once

#include "shmps/server/config.hpp"
#include "shmps/shm/layout.hpp"

namespace shmps::server {

// Applies next's live keys (lr, max-staleness, staleness-policy,
// apply-threads, log-level) to `running` and to the segment's config block `shared` (shmps-inspect shows
// the values in force), logging every difference under the more verbose of
// the old and the new log level. An lr the optimizer refuses is logged and
// kept as it was. A key read on one side only (momentum under sgd, not adam)
// and a weight decay that is each optimizer's default come and go with the
// optimizer, whose change is logged: they are not logged themselves.
void apply_live(ServerConfig& running, const ServerConfig& next, shm::ConfigBlock& shared);

}  // namespace shmps::server
