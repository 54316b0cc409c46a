// Checkpoints and restart: periodic and final checkpoints, the newest K
// kept, restore of weights + optimizer state + steps + version, a corrupt
// or truncated newest checkpoint skipped for the previous one, a
// checkpoint of another model refused, and the file format's own checks.
#define BOOST_TEST_MODULE test_checkpoint
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace k = shmps::kernels;

namespace {

struct TempDir {
  TempDir() : path(fs::temp_directory_path() / test::unique_name("ckpt")) { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  fs::path path;
};

std::vector<std::string> checkpoint_files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string ckpt_name(uint64_t version) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "ckpt-%020llu.shmps", static_cast<unsigned long long>(version));
  return buf;
}

using test::connect;

// The Adam model of these tests: tensors a:2x2, b:3.
std::vector<std::string> adam_args(const fs::path& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--tensor", "a:2x2", "--tensor", "b:3", "--optimizer", "adam", "--lr", "0.01",
                                "--max-staleness", "1000", "--init", "uniform", "--init-seed", "3",
                                "--checkpoint-dir", dir.string()};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

float grad_value(int step, uint64_t i) { return std::cos(static_cast<float>(step * 7 + i)) * 0.3f; }

// Pushes steps [first, last) of the gradient sequence as flat pushes.
void push_steps(Worker& w, const Buffer& g, int first, int last) {
  float* p = static_cast<float*>(g.data);
  for (int s = first; s < last; ++s) {
    for (uint64_t i = 0; i < 7; ++i) p[i] = grad_value(s, i);
    auto v = w.push(kAllTensors, g.id, 0, 28, Dtype::kF32, static_cast<uint64_t>(s));
    BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  }
}

std::vector<float> pull(Worker& w, const Buffer& b, uint64_t* version) {
  auto v = w.pull(kAllTensors, b.id, 0);
  BOOST_REQUIRE(v.ok());
  *version = *v;
  const float* p = static_cast<const float*>(b.data);
  return {p, p + 7};
}

}  // namespace

BOOST_AUTO_TEST_SUITE(checkpoint)

BOOST_AUTO_TEST_CASE(periodic_and_final_checkpoints_keep_the_newest_k) {
  TempDir dir;
  test::ServerProcess server(test::unique_name("every"), adam_args(dir.path, {"--checkpoint-every", "5", "--checkpoint-keep", "2"}));
  auto w = connect(server.name());
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  push_steps(*w, *g, 0, 4);
  BOOST_TEST(checkpoint_files(dir.path).empty());
  push_steps(*w, *g, 4, 5);
  BOOST_TEST(test::eventually([&] { return checkpoint_files(dir.path) == std::vector<std::string>{ckpt_name(5)}; }, 5s));
  push_steps(*w, *g, 5, 12);
  // The second lands at 10, or a little later if the writer was still busy.
  BOOST_TEST(test::eventually([&] {
    const auto files = checkpoint_files(dir.path);
    return files.size() == 2 && files[0] == ckpt_name(5) && files[1] >= ckpt_name(10);
  }, 5s));
  w.reset();
  BOOST_TEST(server.stop() == 0);
  const auto files = checkpoint_files(dir.path);
  BOOST_TEST(files.size() == 2u);
  BOOST_TEST(files.back() == ckpt_name(12));  // the final one; only the newest 2 kept
}

BOOST_AUTO_TEST_CASE(restart_restores_weights_optimizer_state_and_version) {
  TempDir dir;
  const std::string name = test::unique_name("restore");
  std::vector<float> before;
  {
    test::ServerProcess server(name, adam_args(dir.path));
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    push_steps(*w, *g, 0, 3);
    uint64_t v = 0;
    before = pull(*w, *g, &v);
    BOOST_TEST(v == 3u);
    w.reset();
    BOOST_TEST(server.stop() == 0);  // final checkpoint at version 3
  }
  test::ServerProcess server(name, adam_args(dir.path));
  auto w = connect(name);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  uint64_t v = 0;
  BOOST_TEST(pull(*w, *g, &v) == before);
  BOOST_TEST(v == 3u);
  push_steps(*w, *g, 3, 5);
  const std::vector<float> after = pull(*w, *g, &v);
  BOOST_TEST(v == 5u);

  // Reference: five uninterrupted steps (Adam's moments and step count must
  // have survived the restart for these to match).
  std::vector<float> ref(7);
  {
    test::ServerProcess fresh(test::unique_name("ref"), adam_args(dir.path / "ref"));
    auto r = connect(fresh.name());
    auto rg = r->register_buffer(28);
    BOOST_REQUIRE(rg.ok());
    push_steps(*r, *rg, 0, 5);
    ref = pull(*r, *rg, &v);
  }
  for (size_t i = 0; i < 7; ++i) BOOST_TEST(after[i] == ref[i], "element " << i);
}

BOOST_AUTO_TEST_CASE(corrupt_or_truncated_newest_checkpoint_falls_back_to_the_previous) {
  TempDir dir;
  const std::string name = test::unique_name("corrupt");
  std::vector<float> at_four;
  {
    test::ServerProcess server(name, adam_args(dir.path, {"--checkpoint-every", "4", "--checkpoint-keep", "5"}));
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    push_steps(*w, *g, 0, 4);
    uint64_t v = 0;
    at_four = pull(*w, *g, &v);
    BOOST_REQUIRE(test::eventually([&] { return fs::exists(dir.path / ckpt_name(4)); }));
    push_steps(*w, *g, 4, 6);
    w.reset();
    BOOST_TEST(server.stop() == 0);
  }
  BOOST_REQUIRE(fs::exists(dir.path / ckpt_name(6)));
  // Newest: one flipped payload byte (checksum). Then truncated.
  for (const char* damage : {"flip", "truncate"}) {
    BOOST_TEST_CONTEXT(damage) {
      const fs::path newest = dir.path / ckpt_name(6);
      if (std::string(damage) == "flip") {
        std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(64 + 2 * 112 + 8);
        f.put('\x7f');
      } else {
        fs::resize_file(newest, fs::file_size(newest) - 10);
      }
      const std::string log = (dir.path / "server.log").string();
      test::ServerProcess server(name, adam_args(dir.path, {"--checkpoint-keep", "5"}));
      auto w = connect(name);
      auto g = w->register_buffer(28);
      BOOST_REQUIRE(g.ok());
      uint64_t v = 0;
      BOOST_TEST(pull(*w, *g, &v) == at_four);
      BOOST_TEST(v == 4u);
      w.reset();
      // No update since the restore: the final checkpoint is not rewritten.
      BOOST_TEST(server.stop() == 0);
      if (std::string(damage) == "flip") {
        // Put back a damaged newest for the truncation round.
        BOOST_REQUIRE(fs::exists(newest));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(checkpoint_of_another_model_is_not_restored) {
  TempDir dir;
  const std::string name = test::unique_name("other");
  {
    test::ServerProcess server(name, adam_args(dir.path));
    auto w = connect(name);
    auto g = w->register_buffer(28);
    BOOST_REQUIRE(g.ok());
    push_steps(*w, *g, 0, 2);
    w.reset();
    BOOST_TEST(server.stop() == 0);
  }
  // Same tensors, other optimizer state layout (SGD without momentum).
  test::ServerProcess server(name, {"--tensor", "a:2x2", "--tensor", "b:3", "--optimizer", "sgd",
                                    "--checkpoint-dir", dir.path.string()});
  auto w = connect(name);
  auto g = w->register_buffer(28);
  BOOST_REQUIRE(g.ok());
  uint64_t v = 99;
  const std::vector<float> weights = pull(*w, *g, &v);
  BOOST_TEST(v == 0u);
  for (float x : weights) BOOST_TEST(x == 0.0f);  // --init zero, not the Adam run's weights
}

BOOST_AUTO_TEST_CASE(checkpoint_options_are_validated) {
  std::vector<std::string> argv{test::program_path("shmps-server"), "--name", test::unique_name("opt"),
                                "--tensor", "w:1", "--checkpoint-every", "5"};
  auto p = test::Process::spawn(argv);
  BOOST_TEST(p.wait(10s) == 2);  // needs --checkpoint-dir
}

BOOST_AUTO_TEST_SUITE_END()
