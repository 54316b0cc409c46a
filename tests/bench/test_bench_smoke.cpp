// Smoke test of shmps-bench: `--quick` runs every section end to end (a
// shmps-server child, forked workers) and prints every table. Checks only
// that it finishes and what it prints, never a timing.
#define BOOST_TEST_MODULE test_bench_smoke
#include <boost/test/unit_test.hpp>

#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_processes.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;
using shmps::test::Process;
using namespace std::chrono_literals;

namespace {

// A scratch folder, removed with everything in it.
struct Scratch {
  fs::path dir = fs::temp_directory_path() / shmps::test::unique_name("bench_smoke");
  Scratch() { fs::create_directories(dir); }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

// The cells of one CSV line (RFC 4180 quoting: "..." with "" for ").
std::vector<std::string> csv_cells(const std::string& line) {
  std::vector<std::string> cells(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char ch = line[i];
    if (quoted && ch == '"' && i + 1 < line.size() && line[i + 1] == '"') {
      cells.back() += '"';
      ++i;
    } else if (ch == '"') {
      quoted = !quoted;
    } else if (ch == ',' && !quoted) {
      cells.emplace_back();
    } else {
      cells.back() += ch;
    }
  }
  return cells;
}

}  // namespace

BOOST_AUTO_TEST_CASE(quick_run_prints_every_table) {
  Scratch scratch;
  const fs::path out = scratch.dir / "out.txt";
  const fs::path csv = scratch.dir / "bench.csv";
  const std::string cmd = "exec " + shmps::test::shell_quote(shmps::test::program_path("shmps-bench")) +
                          " --quick --csv " + shmps::test::shell_quote(csv.string()) + " --server " +
                          shmps::test::shell_quote(shmps::test::program_path("shmps-server")) + " >" +
                          shmps::test::shell_quote(out.string()) + " 2>&1";
  Process bench = Process::spawn({"/bin/sh", "-c", cmd});
  const int rc = bench.wait(std::chrono::seconds(SHMPS_SMOKE_WAIT_S));  // tests/bench/CMakeLists.txt
  const std::string output = shmps::test::read_file(out);
  BOOST_TEST_MESSAGE(output);
  BOOST_REQUIRE_MESSAGE(rc == 0, "shmps-bench --quick exited with " << rc << " (-1: still running after "
                                                                    << SHMPS_SMOKE_WAIT_S << " s):\n"
                                                                    << output);

  const std::vector<std::string> expected{"[1] Round trip",
                                          "[2] Push + apply throughput",
                                          "[3] Optimizer throughput",
                                          "[4] Server resident memory",
                                          "p50 ns",
                                          "p99 ns",
                                          "p999 ns",
                                          "ref: shm spin ping-pong",
                                          "ref: unix socket",
                                          "push+apply GB/s",
                                          "memcpy GB/s",
                                          "traffic GB/s",
                                          "memcpy traffic GB/s",
                                          "VmHWM at start",
                                          "formula",
                                          "Goals"};
  for (const std::string& text : expected) BOOST_TEST(output.find(text) != std::string::npos, "missing: " << text);

  const std::string rows = shmps::test::read_file(csv);
  BOOST_TEST(rows.rfind("section,row,column,value\n", 0) == 0);
  for (const char* section : {"round_trip,", "push_throughput,", "optimizers,", "memory,", "tail_latency,", "goals,"})
    BOOST_TEST(rows.find("\n" + std::string(section)) != std::string::npos, "no CSV rows of " << section);
  // Every printed cell once: (section, row, column) names one value.
  std::istringstream lines(rows);
  std::set<std::string> keys;
  for (std::string line; std::getline(lines, line);) {
    const std::vector<std::string> cells = csv_cells(line);
    BOOST_REQUIRE_MESSAGE(cells.size() == 4, "not 4 cells: " << line);
    BOOST_TEST(keys.insert(cells[0] + "\n" + cells[1] + "\n" + cells[2]).second, "a second value at " << line);
  }
}

BOOST_AUTO_TEST_CASE(bad_option_fails_with_usage_error) {
  Process bench = Process::spawn({shmps::test::program_path("shmps-bench"), "--repeats", "0"});
  BOOST_TEST(bench.wait(10s) == 2);
  Process negative = Process::spawn({shmps::test::program_path("shmps-bench"), "--repeats", "-1"});
  BOOST_TEST(negative.wait(10s) == 2);  // not read as 2^32 - 1 repeats
}

// shmps-fed-bench refuses counts below 1 at parsing (exit 2, the option
// named): a 0 would divide by zero into NaN in its JSON, a -1 size a vector.
BOOST_AUTO_TEST_CASE(fed_bench_refuses_counts_below_one) {
  const std::string fed_bench = shmps::test::program_path("shmps-fed-bench");
  const std::vector<std::vector<std::string>> cases{{"serve", "--connect", "none", "--pushes", "0"},
                                                    {"serve", "--connect", "none", "--pushes", "-1"},
                                                    {"round", "--rounds", "0"},
                                                    {"round", "--repeats", "0"},
                                                    {"round", "--repeats", "-3"},
                                                    {"serve", "--connect", "none", "--elements", "0"}};
  for (const auto& args : cases) {
    std::vector<std::string> argv{fed_bench};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = shmps::test::run_captured(argv, 10s);
    const std::string option = args[args.size() - 2];
    BOOST_TEST_INFO(option << " " << args.back() << ": " << r.output);
    BOOST_TEST(r.exit_code == 2);
    BOOST_TEST(r.output.find("shmps-fed-bench: " + option + " must be >= 1") != std::string::npos);
  }
}

// SIGINT to shmps-bench while its workers push: it stops them and its
// servers and removes every object it named in /dev/shm (the segments,
// and the buffers of the workers it killed, which no one unregistered)
// before it dies of the signal.
BOOST_AUTO_TEST_CASE(sigint_mid_run_leaves_nothing_in_dev_shm) {
  Scratch scratch;
  const fs::path out = scratch.dir / "out.txt";
  const std::string cmd = "exec " + shmps::test::shell_quote(shmps::test::program_path("shmps-bench")) +
                          " --section 5 --repeats 1 --tail-pushes 4000 --server " +
                          shmps::test::shell_quote(shmps::test::program_path("shmps-server")) + " >" +
                          shmps::test::shell_quote(out.string()) + " 2>&1";
  Process bench = Process::spawn({"/bin/sh", "-c", cmd});
  const std::string mine = "bench_" + std::to_string(bench.pid()) + "_";
  const auto buffers_registered = [&] {
    for (const std::string& name : shmps::bench_test::shm_objects_with(mine))
      if (name.find(".p") != std::string::npos) return true;  // a worker's buffer: shmps.<server>.p<pid>.<n>
    return false;
  };
  BOOST_REQUIRE_MESSAGE(shmps::test::eventually(buffers_registered, 100s), "no worker buffer within 100 s:\n"
                                                                               << shmps::test::read_file(out));
  BOOST_TEST_MESSAGE("before SIGINT: " << shmps::bench_test::joined(shmps::bench_test::shm_objects_with(mine)));
  ::kill(bench.pid(), SIGINT);
  const int rc = bench.wait(60s);
  const std::string output = shmps::test::read_file(out);
  BOOST_TEST_INFO(output);
  BOOST_TEST(rc == 128 + SIGINT);  // died of it, as a shell expects
  BOOST_TEST(output.find("stopped by signal 2") != std::string::npos);
  const auto left = shmps::bench_test::shm_objects_with(mine);
  BOOST_TEST(left.empty(), "left in /dev/shm: " << shmps::bench_test::joined(left));
}
