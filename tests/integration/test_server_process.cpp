// shmps::ChildProcess and shmps::ServerProcess (server_process.hpp) with
// real processes: what a spawned child starts with (its environment,
// signal mask and dispositions, descriptors) whatever the caller's threads
// and signal state, and how a child is waited for and signalled when
// another part of the program reaps it.
#define BOOST_TEST_MODULE test_server_process
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cstdlib>
#include <string>
#include <thread>

#include "test_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;

BOOST_AUTO_TEST_SUITE(server_process)

// The child's environment is this process's, less env_unset, plus each of
// env_defaults not set (a set one keeps its value; a name in both is
// removed, then set to the default).
BOOST_AUTO_TEST_CASE(spawn_applies_env_unset_then_env_defaults) {
  test::TempDir dir("spawnenv");
  const std::string log = (dir.path / "env.log").string();
  ::setenv("SHMPS_T_KEEP", "kept", 1);
  ::setenv("SHMPS_T_GONE", "set", 1);
  ::setenv("SHMPS_T_OWN", "mine", 1);
  ::setenv("SHMPS_T_BOTH", "mine", 1);
  ChildProcess::SpawnOptions o;
  o.log_path = log;
  o.env_unset = {"SHMPS_T_GONE", "SHMPS_T_BOTH", "SHMPS_T_ABSENT"};
  o.env_defaults = {{"SHMPS_T_OWN", "default"}, {"SHMPS_T_NEW", "new"}, {"SHMPS_T_BOTH", "default"}};
  auto child = ChildProcess::spawn(
      {"/bin/sh", "-c", "echo \"[$SHMPS_T_KEEP][${SHMPS_T_GONE-unset}][$SHMPS_T_OWN][$SHMPS_T_NEW][$SHMPS_T_BOTH]\""},
      o);
  for (const char* key : {"SHMPS_T_KEEP", "SHMPS_T_GONE", "SHMPS_T_OWN", "SHMPS_T_BOTH"}) ::unsetenv(key);
  BOOST_REQUIRE(child.ok());
  BOOST_TEST(child->wait(10s) == 0);
  BOOST_TEST(test::read_file(log) == "[kept][unset][mine][new][default]\n");
  BOOST_TEST(std::getenv("SHMPS_T_NEW") == nullptr);  // this process's own stays as it was
}

// A thread of this process that holds glibc's environment lock at the fork
// (any setenv() or unsetenv(); here a setenv() that changes nothing, so
// that the spawns' reads of the environment race no write) must not hang
// the child: it applies env_unset without the lock. Each spawn must exec
// and exit within seconds.
BOOST_AUTO_TEST_CASE(spawn_while_another_thread_holds_the_environment_lock_does_not_hang) {
  ::setenv("SHMPS_T_CHURN", "x", 1);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load(std::memory_order_relaxed)) ::setenv("SHMPS_T_CHURN", "y", /*overwrite=*/0);  // relaxed: a flag
  });
  ChildProcess::SpawnOptions o;
  o.env_unset = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"};
  o.env_defaults = {{"SHMPS_T_DEFAULT", "1"}};
  int hung = 0;
  for (int i = 0; i < 100 && hung == 0; ++i) {
    auto child = ChildProcess::spawn({"/bin/true"}, o);
    BOOST_REQUIRE(child.ok());
    if (child->wait(5s) != 0) ++hung;  // (its destructor kills it)
  }
  stop.store(true, std::memory_order_relaxed);
  churn.join();
  ::unsetenv("SHMPS_T_CHURN");
  BOOST_TEST(hung == 0, "a child hung between fork and exec");
}

BOOST_AUTO_TEST_SUITE_END()
