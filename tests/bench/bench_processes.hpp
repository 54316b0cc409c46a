// What the bench tests look for around a benchmark process: the objects it
// leaves in /dev/shm, and its forked children. Single-threaded test code.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace shmps::bench_test {

// The names in /dev/shm that contain `part` (e.g. "_<pid>_": every object a
// benchmark of that pid names, segments, buffers and queues alike).
inline std::vector<std::string> shm_objects_with(const std::string& part) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find(part) != std::string::npos) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& n : names) text += (text.empty() ? "" : " ") + n;
  return text;
}

// The children of `pid` whose command (/proc/<pid>/comm) is `comm`, by pid
// (the order they were forked in, short of pid wrap-around).
inline std::vector<pid_t> children_named(pid_t pid, const std::string& comm) {
  std::vector<pid_t> out;
  for (pid_t c : test::child_pids(pid)) {
    std::string name = test::read_file("/proc/" + std::to_string(c) + "/comm");
    while (!name.empty() && name.back() == '\n') name.pop_back();
    if (name == comm) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace shmps::bench_test
