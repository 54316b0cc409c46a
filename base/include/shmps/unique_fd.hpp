// A file descriptor closed with its owner (an flock taken on it goes with
// it); movable, not copyable. Not installed: internal to the server and
// the tools.
#pragma once

#include <unistd.h>

#include <utility>

namespace shmps {

struct UniqueFd {
  UniqueFd() = default;
  explicit UniqueFd(int descriptor) noexcept : fd(descriptor) {}
  UniqueFd(UniqueFd&& other) noexcept : fd(std::exchange(other.fd, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      if (fd >= 0) ::close(fd);
      fd = std::exchange(other.fd, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() {
    if (fd >= 0) ::close(fd);
  }

  int fd = -1;
};

}  // namespace shmps
