// Lowering a thread's scheduling for --fed-priority (FederationPriority):
// header-only, so that the engines' plugins use it without linking the
// server. Linux applies nice values and policies per thread; a thread
// inherits its creator's, so an engine that starts its threads from a
// lowered one has them lowered too.
#pragma once

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "shmps/server/federation.hpp"

namespace shmps::server {

// Lowers the calling thread as `priority` asks (kNormal leaves it):
// kLow sets its nice value to 19, kIdle its policy to SCHED_IDLE. Neither
// needs a privilege; raising it back would (RLIMIT_NICE, CAP_SYS_NICE), so
// call it only on a thread that does the federation's work alone. "" on
// success, else why.
inline std::string lower_thread_priority(FederationPriority priority) {
  if (priority == FederationPriority::kLow) {
    // PRIO_PROCESS with a thread id: that thread only (Linux).
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19) != 0)
      return std::string("setpriority(19): ") + std::strerror(errno);
  } else if (priority == FederationPriority::kIdle) {
    sched_param param{};
    if (::sched_setscheduler(0, SCHED_IDLE, &param) != 0)
      return std::string("sched_setscheduler(SCHED_IDLE): ") + std::strerror(errno);
  }
  return "";
}

}  // namespace shmps::server
