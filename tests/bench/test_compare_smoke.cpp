// shmps-compare --quick end to end: it starts every server, measures every
// system once and prints its tables. Checks the exit code and the table
// headers, never a timing (the figures of a smoke run mean nothing).
#define BOOST_TEST_MODULE test_compare_smoke
#include <boost/test/unit_test.hpp>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "bench_processes.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
using shmps::test::Process;

namespace {

// shmps-compare with `args`, its output in a file of a scratch folder; each
// run of these tests measures 3 shmps servers before the baselines.
struct Compare {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / shmps::test::unique_name("compare_smoke");
  std::filesystem::path out = dir / "out.txt";
  Process process;
  pid_t pid = -1;  // process.pid(), kept past its reaping
  explicit Compare(const std::string& args) {
    std::filesystem::create_directories(dir);
    process = Process::spawn({"/bin/sh", "-c",
                              "exec " + shmps::test::shell_quote(shmps::test::program_path("shmps-compare")) + " " +
                                  args + " >" + shmps::test::shell_quote(out.string()) + " 2>&1"});
    pid = process.pid();
  }
  ~Compare() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  // "_<pid>_": in the names of all it makes in /dev/shm (its shmps
  // servers', "bench_<pid>_...", and its message queues', "shmps_cmp_<pid>_...").
  std::string mine() const { return "_" + std::to_string(pid) + "_"; }
  // Once the first shmps server has a worker's buffer: every server and
  // baseline server is up, and the measuring has begun.
  bool measuring() const {
    for (const std::string& name : shmps::bench_test::shm_objects_with("bench" + mine()))
      if (name.find(".p") != std::string::npos) return true;
    return false;
  }
  std::string output() const { return shmps::test::read_file(out.string()); }
};

}  // namespace

BOOST_AUTO_TEST_CASE(quick_run_prints_every_table) {
  const std::string csv = "/tmp/" + shmps::test::unique_name("compare") + ".csv";
  const auto run = shmps::test::run_captured({shmps::test::program_path("shmps-compare"), "--quick", "--csv", csv},
                                             std::chrono::seconds(100));
  BOOST_TEST_INFO(run.output);
  BOOST_TEST(run.exit_code == 0);
  for (const char* header : {"[1] Round trip of a 4 KiB gradient push",
                             "[2] Push + apply",
                             "[3] Scaling",
                             "Goals",
                             "ref: shm spin ping-pong",
                             "ref: apply alone",
                             "ref: check+apply",
                             "ref: memcpy",
                             "shmps, --allow-nonfinite",
                             "unix socket",
                             "boost mq",
                             "p50/spin ref",
                             "push/apply",
                             "over apply ms",
                             "Load average",
                             "its check+apply in one process",
                             "ref: check+apply, N gradients in turn",
                             "vs same work in 1 process",
                             "the same work with N gradients in one process",
                             "no verdicts"})
    BOOST_TEST(run.output.find(header) != std::string::npos, "missing: " << header);
  // A smoke run's figures mean nothing: no goal gets a verdict.
  BOOST_TEST(run.output.find("MET") == std::string::npos);
  BOOST_TEST(run.output.find("MISSED") == std::string::npos);
  BOOST_TEST((run.output.find("zeromq ipc") != std::string::npos ||
              run.output.find("built without libzmq") != std::string::npos));
  std::FILE* f = std::fopen(csv.c_str(), "r");
  BOOST_TEST(f != nullptr);
  if (f != nullptr) std::fclose(f);
  std::remove(csv.c_str());
}

// The command line is shmps-bench's (bench/support/bench_support.cpp): a bad value
// is a usage error, --section picks sections.
BOOST_AUTO_TEST_CASE(bad_option_fails_and_sections_select) {
  const auto bad = shmps::test::run_captured({shmps::test::program_path("shmps-compare"), "--section", "4"},
                                             std::chrono::seconds(20));
  BOOST_TEST(bad.exit_code == 2);
  BOOST_TEST(bad.output.find("--section must be 1..3") != std::string::npos, bad.output);
  const auto only = shmps::test::run_captured(
      {shmps::test::program_path("shmps-compare"), "--quick", "--section", "2", "--size-kib", "64"},
      std::chrono::seconds(100));
  BOOST_TEST_INFO(only.output);
  BOOST_TEST(only.exit_code == 0);
  BOOST_TEST(only.output.find("[2] Push + apply") != std::string::npos);
  BOOST_TEST(only.output.find("64 KiB") != std::string::npos);
  BOOST_TEST(only.output.find("[1] Round trip") == std::string::npos);
  BOOST_TEST(only.output.find("[3] Scaling") == std::string::npos);
}

// SIGINT mid-run: shmps-compare stops its servers and baseline servers and
// removes every object it named in /dev/shm (segments, worker buffers, the
// message queues) before it dies of the signal.
BOOST_AUTO_TEST_CASE(sigint_mid_run_leaves_nothing_in_dev_shm) {
  Compare run("--section 1 --repeats 50");
  BOOST_REQUIRE_MESSAGE(shmps::test::eventually([&] { return run.measuring(); }, 60s), "not measuring within 60 s:\n"
                                                                                           << run.output());
  BOOST_TEST_MESSAGE("before SIGINT: " << shmps::bench_test::joined(shmps::bench_test::shm_objects_with(run.mine())));
  ::kill(run.pid, SIGINT);
  const int rc = run.process.wait(60s);
  BOOST_TEST_INFO(run.output());
  BOOST_TEST(rc == 128 + SIGINT);
  const auto left = shmps::bench_test::shm_objects_with(run.mine());
  BOOST_TEST(left.empty(), "left in /dev/shm: " << shmps::bench_test::joined(left));
}

// The message-queue baseline server killed before it is measured: a 4 MiB
// push is 65 messages to a queue 16 deep that no one empties, so its
// client's sends time out and the run fails naming it, instead of
// blocking for ever.
BOOST_AUTO_TEST_CASE(a_dead_message_queue_server_fails_the_run) {
  Compare run("--section 2 --size-kib 4096 --repeats 2");
  BOOST_REQUIRE_MESSAGE(shmps::test::eventually([&] { return run.measuring(); }, 60s), "not measuring within 60 s:\n"
                                                                                           << run.output());
  // Its forked children by age: the baseline servers (socket, message
  // queue, ZeroMQ when built with it), then the measuring child.
  const auto forked = shmps::bench_test::children_named(run.pid, "shmps-compare");
  BOOST_REQUIRE_GE(forked.size(), 3u);
  ::kill(forked[1], SIGKILL);
  const int rc = run.process.wait(100s);
  const std::string output = run.output();
  BOOST_TEST_INFO(output);
  BOOST_TEST(rc == 1);  // -1: still running after 100 s
  BOOST_TEST(output.find("boost mq: ") != std::string::npos);
  BOOST_TEST(output.find("within 30 s") != std::string::npos);
  BOOST_TEST(shmps::bench_test::shm_objects_with(run.mine()).empty());
}
