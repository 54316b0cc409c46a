// Server-side fixtures for tests that link shmps::server_core: the option
// parser called as shmps-server's main calls it, and a Server run in this
// process on a thread for the scope of a test. Header-only: include it after
// BOOST_TEST_MODULE's unit_test.hpp. Use from the test's main thread.
#pragma once

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shmps/server/options.hpp"
#include "shmps/server/server.hpp"

namespace shmps::test {

// parse_options() of "shmps-server <args...>".
inline Result<server::ParsedOptions> parse_server_args(std::vector<std::string> args) {
  args.insert(args.begin(), "shmps-server");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return server::parse_options(static_cast<int>(argv.size()), argv.data());
}

// Runs a Server on a thread for the scope; stop() (or the destructor) asks it
// to stop, joins, and checks run() returned ok. (Boost.Test macros are not
// thread-safe: the thread only records the outcome.)
struct InProcessServer {
  explicit InProcessServer(const server::ServerConfig& config,
                           std::unique_ptr<server::FederationEngine> engine = nullptr) {
    auto s = engine ? server::Server::create_federated(config, std::move(engine)) : server::Server::create(config);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    server = std::move(s).value();
    thread = std::thread([this] { run_ok = server->run().ok(); });
  }
  void stop() {
    if (!thread.joinable()) return;
    server->request_stop();
    thread.join();
    BOOST_TEST(run_ok.load());
  }
  ~InProcessServer() { stop(); }
  std::unique_ptr<server::Server> server;
  std::thread thread;
  std::atomic<bool> run_ok{false};
};

}  // namespace shmps::test
