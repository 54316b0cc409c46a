// The server's threads: their names, their CPUs for --fed-cpus, and
// lowering their scheduling for --fed-priority (FederationPriority).
// Header-only, so that the engines' plugins use it without linking the
// server. Linux keeps a name, a CPU mask, a nice value and a policy per
// thread, and a thread inherits all four from its creator: an engine that
// starts its threads from a placed, lowered, named one has them placed,
// lowered and named too. Place and lower a thread before naming it, so
// that a thread seen by its name is already where it belongs.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shmps/server/federation.hpp"

namespace shmps::server {

// Starts a thread running `f` with SIGINT, SIGTERM and SIGHUP blocked in
// it (a thread inherits its creator's mask: blocked around the start,
// restored after, also when std::thread throws std::system_error). They
// then reach the thread that handles them, and never interrupt a helper
// thread's system calls (run_server() installs its handlers without
// SA_RESTART). For every thread the server starts: the checkpoint writer,
// the reload parser, the orphan sweeper, the federation's threads, the
// parent watch; the threads these start inherit the mask.
template <class F>
std::thread start_helper_thread(F&& f) {
  sigset_t signals, previous;
  sigemptyset(&signals);
  for (const int signo : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&signals, signo);
  ::pthread_sigmask(SIG_BLOCK, &signals, &previous);
  try {
    std::thread t(std::forward<F>(f));
    ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    return t;
  } catch (...) {
    ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    throw;
  }
}

// Names the calling thread as `top -H`, `ps -L`, perf and
// /proc/PID/task/TID/comm show it (at most 15 characters), so that an
// operator can tell the threads apart, or pin them apart (taskset -p, per
// thread id): shmps-server (the consumer: the main thread, and the
// OpenMP threads that split its large updates), shmps-fed (the
// federation's round loop), shmps-fed-io (an engine's own threads: Gloo's
// I/O thread), shmps-ckpt (the checkpoint writer), shmps-reload (a
// reload's parse), shmps-sweep (dead workers' buffer objects).
// docs/operations.md.
inline void name_this_thread(const char* name) noexcept { (void)::pthread_setname_np(::pthread_self(), name); }

static_assert(kMaxCpus == CPU_SETSIZE, "FederationConfig::cpus are indices into a cpu_set_t");

// The CPUs thread `tid` of this process (0: the calling thread) may run
// on, ascending; empty if they cannot be read.
inline std::vector<uint32_t> thread_cpus(pid_t tid = 0) {
  std::vector<uint32_t> cpus;
  cpu_set_t set;
  if (::sched_getaffinity(tid, sizeof set, &set) != 0) return cpus;
  for (uint32_t c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// Restricts the calling thread to `cpus` (FederationConfig::cpus; each
// below kMaxCpus), which the threads it starts inherit; empty leaves it.
// The kernel keeps those of them that are online and in the server's
// cgroup, and refuses only a list without any: "" then, else why. The
// CPUs the thread got: thread_cpus().
inline std::string pin_this_thread(const std::vector<uint32_t>& cpus) {
  if (cpus.empty()) return "";
  cpu_set_t set;
  CPU_ZERO(&set);
  for (uint32_t c : cpus) CPU_SET(c, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0) return std::string("sched_setaffinity: ") + std::strerror(errno);
  return "";
}

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
