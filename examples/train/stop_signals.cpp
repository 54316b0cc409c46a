#include "stop_signals.hpp"

#include <signal.h>

#include "shmps/stop_signals.hpp"

namespace shmps::train {

// SIGPIPE: stdout's reader went (`shmps-train | head`); dying of it at
// once would leave the temp files, the server and its segment behind.
void catch_stop_signals() { stop_signals::catch_signals({SIGINT, SIGTERM, SIGHUP, SIGPIPE}); }

void restore_stop_signals() { stop_signals::restore_defaults(); }

int stop_signal() { return stop_signals::caught(); }

void die_of_stop_signal() { stop_signals::die_of_caught(); }

}  // namespace shmps::train
