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

// For an engine's own I/O thread (Gloo's), started from a thread that
// calls this: lowered as `priority` asks, and then, unless that made it
// SCHED_IDLE, under SCHED_BATCH at the same nice value. A SCHED_BATCH
// thread keeps its share of the CPU but does not preempt the running
// thread as it wakes (it runs when that one sleeps or is preempted at a
// tick). Gloo's I/O thread wakes at every message of a collective; where
// it shared a CPU with the federation thread, collectives stalled for a
// scheduler tick (4 ms here), and under SCHED_BATCH they did not
// (docs/federation.md, "Gloo's 4 ms stalls"). A thread under another
// policy than SCHED_OTHER (the server started under one) keeps it: this
// only lowers. "" on success, else why.
inline std::string lower_io_thread_priority(FederationPriority priority) {
  if (std::string why = lower_thread_priority(priority); !why.empty() || priority == FederationPriority::kIdle)
    return why;
  if (::sched_getscheduler(0) != SCHED_OTHER) return "";
  sched_param param{};
  if (::sched_setscheduler(0, SCHED_BATCH, &param) != 0)
    return std::string("sched_setscheduler(SCHED_BATCH): ") + std::strerror(errno);
  return "";
}

}  // namespace shmps::server
