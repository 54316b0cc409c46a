// A reload's parse, off the consumer thread. Reading and checking the
// configuration again (the command line and its --config file) takes
// tens of milliseconds for a large model's file (docs/operations.md):
// done on the consumer thread, every worker would wait that long.
// ReloadParser runs the parse on a thread of its own ("shmps-reload"); the
// consumer starts it and later takes the result, to apply between two
// requests (apply_live()). One parse at a time: a reload asked for while
// one runs starts once the consumer has taken that one's result, so
// SIGHUPs that come faster than a parse merge into the next.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "shmps/server/config.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

class ReloadParser {
 public:
  using Source = std::function<Result<ServerConfig>()>;

  // `parsed` runs on the parser's thread after each parse, once its
  // result can be taken (it wakes the consumer). The thread starts with
  // SIGINT, SIGTERM and SIGHUP blocked, so that they reach the thread
  // that handles them and never interrupt the parse's reads. Throws
  // std::system_error when the thread cannot be started (the caller's
  // signal mask is as it was).
  ReloadParser(Source source, std::function<void()> parsed);
  // Waits for a parse in progress.
  ~ReloadParser();
  ReloadParser(const ReloadParser&) = delete;
  ReloadParser& operator=(const ReloadParser&) = delete;

  // Consumer: starts a parse; only while not busy().
  void start();
  // Consumer: a parse was started and its result not taken yet.
  bool busy() const noexcept { return busy_; }
  // Consumer: the parse's result, once; none while it runs. A parse that
  // throws (it should not) gives kInternal with the exception's text.
  std::optional<Result<ServerConfig>> take();

 private:
  void loop();

  const Source source_;
  const std::function<void()> parsed_;
  // ---- the consumer's
  bool busy_ = false;  // from start() until take() returned its result
  std::mutex mu_;
  std::condition_variable cv_;
  // ---- guarded by mu_
  bool requested_ = false;  // start() asked for a parse, not begun yet
  bool quit_ = false;
  std::optional<Result<ServerConfig>> result_;
  // ---- the consumer's cheap look: whether take() would return a result.
  // SYNC(reload_parsed): loop()'s release store after writing result_
  // (under mu_, which take() locks too) lets take() skip the lock while
  // there is none.
  std::atomic<bool> ready_{false};
  std::thread thread_;  // last: started once the members above are
};

}  // namespace shmps::server
