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
  for (const char* header : {"[1] Round trip of a 4 KiB gradient push", "[2] Push + apply", "[3] Scaling", "Goals",
                             "ref: shm spin ping-pong", "ref: apply alone", "ref: memcpy", "unix socket", "boost mq",
                             "p50/spin ref", "push/apply"})
    BOOST_TEST(run.output.find(header) != std::string::npos, "missing: " << header);
  BOOST_TEST((run.output.find("zeromq ipc") != std::string::npos ||
              run.output.find("built without libzmq") != std::string::npos));
  std::FILE* f = std::fopen(csv.c_str(), "r");
  BOOST_TEST(f != nullptr);
  if (f != nullptr) std::fclose(f);
  std::remove(csv.c_str());
}
