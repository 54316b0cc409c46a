#include "reload_parser.hpp"

#include <exception>
#include <string>
#include <utility>

#include "threads.hpp"

namespace shmps::server {

ReloadParser::ReloadParser(Source source, std::function<void()> parsed)
    : source_(std::move(source)), parsed_(std::move(parsed)) {
  thread_ = start_helper_thread([this] { loop(); });
}

ReloadParser::~ReloadParser() {
  {
    std::lock_guard lock(mu_);
    quit_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void ReloadParser::start() {
  busy_ = true;
  {
    std::lock_guard lock(mu_);
    requested_ = true;
  }
  cv_.notify_one();
}

std::optional<Result<ServerConfig>> ReloadParser::take() {
  if (!ready_.load(std::memory_order_acquire)) return std::nullopt;  // SYNC(reload_parsed)
  std::lock_guard lock(mu_);
  ready_.store(false, std::memory_order_relaxed);  // relaxed: under mu_, which orders it
  busy_ = false;
  return std::exchange(result_, std::nullopt);
}

void ReloadParser::loop() {
  name_this_thread("shmps-reload");
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return quit_ || requested_; });
    if (quit_) return;
    requested_ = false;
    lock.unlock();
    Result<ServerConfig> parsed = Status{ErrorCode::kInternal, "reload: no result"};
    try {
      parsed = source_();
    } catch (const std::exception& e) {  // the thread's edge: an exception must not end the process
      parsed = Status{ErrorCode::kInternal, std::string("reload: ") + e.what()};
    }
    lock.lock();
    result_.emplace(std::move(parsed));
    ready_.store(true, std::memory_order_release);  // SYNC(reload_parsed)
    lock.unlock();
    parsed_();
    lock.lock();
  }
}

}  // namespace shmps::server
