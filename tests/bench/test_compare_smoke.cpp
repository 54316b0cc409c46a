// shmps-compare --quick end to end: it starts every server, measures every
// system once and prints its tables. Checks the exit code and the table
// headers, never a timing (the figures of a smoke run mean nothing).
#define BOOST_TEST_MODULE test_compare_smoke
#include <boost/test/unit_test.hpp>

#include <cstdio>
#include <string>

#include "test_support.hpp"

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
