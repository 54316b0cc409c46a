#include "shmps/shm/in_process.hpp"

#include <sys/random.h>
#include <unistd.h>

#include <cerrno>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace shmps::shm {
namespace {

struct Offers {
  std::mutex mutex;
  std::unordered_map<uint64_t, InProcessOffer> kept;
};

Offers& offers() {
  static Offers o;
  return o;
}

}  // namespace

Result<uint64_t> offer_in_process(InProcessOffer offer) {
  Offers& o = offers();
  const std::lock_guard lock(o.mutex);
  while (true) {
    uint64_t token = 0;
    const ssize_t n = ::getrandom(&token, sizeof token, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof token))
      return Status{ErrorCode::kInternal, std::string("getrandom() for an in-process buffer's token: ") +
                                              (n < 0 ? std::strerror(errno) : "short read")};
    if (token != 0 && o.kept.try_emplace(token, offer).second) return token;
  }
}

void withdraw_in_process(uint64_t token) noexcept {
  if (token == 0) return;
  Offers& o = offers();
  const std::lock_guard lock(o.mutex);
  o.kept.erase(token);
}

Result<InProcessOffer> take_in_process(const BufferDesc& desc, uint32_t worker_pid) {
  if (worker_pid != static_cast<uint32_t>(::getpid()))
    return Status{ErrorCode::kBadRequest,
                  "an in-process buffer from another process (pid " + std::to_string(worker_pid) + ")"};
  uint64_t token = 0;
  std::memcpy(&token, desc.handle, sizeof token);
  Offers& o = offers();
  const std::lock_guard lock(o.mutex);
  const auto it = token == 0 ? o.kept.end() : o.kept.find(token);
  if (it == o.kept.end())
    return Status{ErrorCode::kBadRequest, "an in-process buffer this process did not offer, or offered once already"};
  const InProcessOffer offer = it->second;
  o.kept.erase(it);
  return offer;
}

}  // namespace shmps::shm
