#include "orphan_sweeper.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <exception>
#include <system_error>
#include <utility>
#include <vector>

#include "shmps/server/log.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/status.hpp"
#include "threads.hpp"

namespace shmps::server {
namespace {

// "1 orphaned buffer object" or "3 orphaned buffer objects".
std::string objects(size_t n) {
  return std::to_string(n) + (n == 1 ? " orphaned buffer object" : " orphaned buffer objects");
}

// The first names, then how many more.
std::string listed(const std::vector<std::string>& named, size_t total) {
  std::string out;
  for (const std::string& n : named) out += (out.empty() ? "" : ", ") + n;
  if (total > named.size()) out += " and " + std::to_string(total - named.size()) + " more";
  return out;
}

}  // namespace

OrphanSweeper::OrphanSweeper(std::string server_name) : name_(std::move(server_name)) {}

OrphanSweeper::~OrphanSweeper() { stop(); }

void OrphanSweeper::start() {
  if (running_) return;
  {
    std::lock_guard lock(mu_);
    quit_ = false;
  }
  try {
    thread_ = start_helper_thread([this] { loop(); });
    running_ = true;
  } catch (const std::system_error& e) {
    log::error(std::string("the sweep of dead workers' buffer objects runs on the consumer thread: its own thread "
                           "cannot start: ") +
               e.what());
  }
}

void OrphanSweeper::stop() {
  if (!running_) return;
  {
    std::lock_guard lock(mu_);
    quit_ = true;
  }
  cv_.notify_one();
  thread_.join();
  running_ = false;
}

void OrphanSweeper::sweep_soon() {
  {
    std::lock_guard lock(mu_);
    requested_ = true;
  }
  cv_.notify_one();
}

void OrphanSweeper::sweep_now() {
  {
    std::lock_guard lock(mu_);
    requested_ = false;
  }
  sweep();
}

void OrphanSweeper::tick(uint64_t now) {
  if (running_) return;
  bool asked = false;
  {
    std::lock_guard lock(mu_);
    asked = requested_;
  }
  if (!asked && now - last_tick_ns_ < kPeriodNs) return;
  last_tick_ns_ = now;
  sweep_now();
}

void OrphanSweeper::loop() {
  name_this_thread("shmps-sweep");
  using Clock = std::chrono::steady_clock;
  std::unique_lock lock(mu_);
  Clock::time_point next = Clock::now() + std::chrono::nanoseconds(kPeriodNs);
  while (true) {
    cv_.wait_until(lock, next, [&] { return quit_ || requested_; });
    if (quit_) return;
    requested_ = false;
    lock.unlock();
    try {
      sweep();
    } catch (const std::exception& e) {  // the thread's edge: an exception must not end the process
      log::error(std::string("sweeping dead workers' buffer objects: ") + e.what());
    }
    const Clock::time_point done = Clock::now();
    next = done + std::chrono::nanoseconds(kPeriodNs);
    lock.lock();
    // A sweep asked for meanwhile waits this long: worker deaths one after
    // another cost a sweep each kMinGapNs at most.
    cv_.wait_until(lock, done + std::chrono::nanoseconds(kMinGapNs), [&] { return quit_; });
  }
}

void OrphanSweeper::sweep() {
  std::vector<std::string> removed, refused;  // the first kNamedPerLine of each
  size_t removed_count = 0, refused_count = 0;
  std::vector<std::string> refused_paths;
  bool sticky = false;
  std::set<std::string> still_unremovable;
  for (const shm::OrphanBuffer& o : shm::orphan_buffers(name_)) {
    const std::string path = "/dev/shm/" + o.object_name;
    const int err = shm::ShmObject::remove(o.object_name);
    if (err == 0) {
      if (removed_count++ < kNamedPerLine) removed.push_back(path);
      continue;
    }
    // Named once: a later sweep finds it again until a worker of its user
    // (or an operator) removes it. One past the line's names is named by a
    // later sweep.
    if (unremovable_.count(o.object_name) != 0) {
      still_unremovable.insert(o.object_name);
      continue;
    }
    sticky |= err == EPERM || err == EACCES;
    if (refused_count++ >= kNamedPerLine) continue;
    still_unremovable.insert(o.object_name);
    struct stat st {};
    const std::string who = ::lstat(path.c_str(), &st) == 0 ? " (owner " + shm::owner_text(st.st_uid, st.st_gid) +
                                                                  ", mode " + shm::mode_text(st.st_mode) + ")"
                                                            : "";
    refused.push_back(path + who + ": " + errno_text(err));
    refused_paths.push_back(path);
  }
  // One that comes back after it was gone is logged again.
  unremovable_ = std::move(still_unremovable);
  if (removed_count != 0) log::info("removed " + objects(removed_count) + ": " + listed(removed, removed_count));
  if (refused_count == 0) return;
  std::string command;
  for (const std::string& p : refused_paths) command += " " + p;
  log::warn("cannot remove " + objects(refused_count) + ": " + listed(refused, refused_count) +
            (sticky ? "; /dev/shm is sticky: only an object's owner (or root) may remove it. A worker of that user "
                      "removes it as it attaches to '" +
                          name_ + "', or remove it by hand (sudo rm" + command + ")"
                    : std::string()));
}

}  // namespace shmps::server
