// The server in-process (Server::create + run() on a thread) with workers
// on other threads: the same protocol under ThreadSanitizer's eyes, and the
// option parser / config file.
#define BOOST_TEST_MODULE test_server
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <thread>

#include "server_support.hpp"
#include "shmps/server/options.hpp"
#include "shmps/server/server.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"

using namespace shmps;
using namespace shmps::server;

namespace {

using test::InProcessServer;

}  // namespace

BOOST_AUTO_TEST_SUITE(server)

BOOST_AUTO_TEST_CASE(threads_push_concurrently_each_push_applied_once) {
  ServerConfig config;
  config.name = test::unique_name("inproc");
  config.tensors = {{"w", {1}}, {"b", {3}}};
  config.optimizer.lr = 1.0f;
  config.max_staleness = 1u << 30;
  InProcessServer server(config);
  constexpr int kThreads = 3;
  constexpr int kPushes = 2000;  // each iteration pushes once or twice
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      WorkerOptions o;
      o.name = config.name;
      auto w = Worker::connect(o);
      if (!w.ok()) {
        ++failures;
        return;
      }
      auto buf = (*w)->register_buffer(16);
      if (!buf.ok()) {
        ++failures;
        return;
      }
      std::fill_n(static_cast<float*>(buf->data), 4, -1.0f);
      for (int n = 0; n < kPushes; ++n) {
        Result<uint64_t> v = (*w)->push(kAllTensors, buf->id, 0, 16, Dtype::kF32, 0);
        if (n % 2) {
          auto ticket = (*w)->push_async(kAllTensors, buf->id, 0, 16, Dtype::kF32, 0);
          v = ticket.ok() ? (*w)->wait(ticket.value()) : Result<uint64_t>(ticket.status());
        }
        if (!v.ok()) ++failures;
      }
      if (!(*w)->ping().ok()) ++failures;
    });
  }
  for (auto& t : threads) t.join();
  BOOST_TEST(failures.load() == 0);
  server.stop();
  const uint64_t expected = uint64_t{kThreads} * (kPushes + kPushes / 2);
  BOOST_TEST(server.server->version() == expected);
  const std::vector<float> weights = server.server->weights().value();
  for (float x : weights) BOOST_TEST(x == static_cast<float>(expected));
}

BOOST_AUTO_TEST_CASE(invalid_config_is_refused_naming_the_option) {
  ServerConfig config;
  config.name = test::unique_name("bad");
  config.tensors = {{"w", {4}}};
  config.optimizer.lr = -1.0f;
  auto s = Server::create(config);
  BOOST_TEST((s.status().code() == ErrorCode::kInvalidArgument));
  BOOST_TEST(s.status().message().find("--lr") != std::string::npos);
  config.optimizer.lr = 0.1f;
  config.lane_capacity = 48;
  BOOST_TEST(Server::create(config).status().message().find("--ring-capacity") != std::string::npos);
  config.lane_capacity = 64;
  config.init.kind = InitSpec::Kind::kFile;
  config.init.file = "/nonexistent/init.bin";
  BOOST_TEST(Server::create(config).status().message().find("--init-file") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(init_file_sets_the_weights_and_its_size_is_checked) {
  const std::string path = "/tmp/shmps_init_" + std::to_string(::getpid()) + ".bin";
  const float values[5] = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(values), sizeof values);
  ServerConfig config;
  config.name = test::unique_name("init");
  config.tensors = {{"a", {2, 2}}, {"b", {1}}};
  config.init.kind = InitSpec::Kind::kFile;
  config.init.file = path;
  auto s = Server::create(config);
  BOOST_REQUIRE(s.ok());
  BOOST_TEST((*s)->weights().value() == std::vector<float>(values, values + 5), boost::test_tools::per_element());
  s = Result<std::unique_ptr<Server>>(Status{});
  config.tensors = {{"a", {2, 3}}};
  auto bad = Server::create(config);
  BOOST_TEST(bad.status().message().find("holds 20 bytes; the tensors need 24") != std::string::npos);
  ::unlink(path.c_str());
}

// The initial weights reach the backend a chunk (2^20 values) at a time:
// across chunk and tensor boundaries they are the one sequence a single
// loop draws, or the file's values in order; a bad value in a later chunk
// still fails the start and leaves no segment.
BOOST_AUTO_TEST_CASE(initial_weights_span_chunks_as_one_sequence) {
  constexpr uint64_t kA = 1'500'000, kB = 1'200'001;  // 2.6 chunks, the tensor boundary inside the 2nd
  ServerConfig config;
  config.name = test::unique_name("chunks");
  config.tensors = {{"a", {kA}}, {"b", {kB}}};
  config.init.seed = 11;
  config.init.scale = 0.5f;
  const auto reference = [&](auto dist) {
    std::mt19937_64 rng(config.init.seed);
    std::vector<float> w(kA + kB);
    for (float& x : w) x = dist(rng);
    return w;
  };
  config.init.kind = InitSpec::Kind::kNormal;
  {
    auto s = Server::create(config);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    BOOST_TEST(((*s)->weights().value() == reference(std::normal_distribution<float>(0.0f, 0.5f))));
  }
  config.init.kind = InitSpec::Kind::kUniform;
  {
    auto s = Server::create(config);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    BOOST_TEST(((*s)->weights().value() == reference(std::uniform_real_distribution<float>(-0.5f, 0.5f))));
  }
  const std::string path = "/tmp/shmps_init_chunks_" + std::to_string(::getpid()) + ".bin";
  std::vector<float> values(kA + kB);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 65521) - 7.0f;
  const auto write = [&] {
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * 4));
  };
  write();
  config.init.kind = InitSpec::Kind::kFile;
  config.init.file = path;
  {
    auto s = Server::create(config);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    BOOST_TEST(((*s)->weights().value() == values));
  }
  values[(2 << 20) + 5] = std::numeric_limits<float>::quiet_NaN();  // in the third chunk
  write();
  auto bad = Server::create(config);
  BOOST_TEST(bad.status().message().find("contains NaN or Inf") != std::string::npos, bad.status().to_string());
  BOOST_TEST(!std::filesystem::exists("/dev/shm/shmps." + config.name), "segment left behind");
  ::unlink(path.c_str());
}

BOOST_AUTO_TEST_CASE(command_line_parses_every_option) {
  auto p = test::parse_server_args({"--name",
                                    "job",
                                    "--tensor",
                                    "fc1.weight:256x784",
                                    "--tensor",
                                    "fc1.bias:256:f32",
                                    "--optimizer",
                                    "adam",
                                    "--lr",
                                    "0.002",
                                    "--beta1",
                                    "0.8",
                                    "--beta2",
                                    "0.99",
                                    "--eps",
                                    "1e-6",
                                    "--amsgrad",
                                    "--max-staleness",
                                    "3",
                                    "--ring-capacity",
                                    "128",
                                    "--max-workers",
                                    "8",
                                    "--max-buffers",
                                    "4",
                                    "--backend",
                                    "host",
                                    "--init",
                                    "normal",
                                    "--init-scale",
                                    "0.1",
                                    "--init-seed",
                                    "5",
                                    "--allow-nonfinite",
                                    "--group-access"});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  const ServerConfig& c = p->config;
  BOOST_TEST(c.name == "job");
  BOOST_TEST(c.tensors.size() == 2u);
  BOOST_TEST((c.tensors[0].shape == std::vector<uint64_t>{256, 784}));
  BOOST_TEST((c.optimizer.kind == kernels::OptimizerKind::kAdam));
  BOOST_TEST(c.optimizer.lr == 0.002f);
  BOOST_TEST(c.optimizer.beta2 == 0.99f);
  BOOST_TEST(c.optimizer.amsgrad);
  BOOST_TEST(c.max_staleness == 3u);
  BOOST_TEST(c.lane_capacity == 128u);
  BOOST_TEST(c.max_workers == 8u);
  BOOST_TEST(c.max_buffers == 4u);
  BOOST_TEST((c.backend == BackendKind::kHost));
  BOOST_TEST((c.init.kind == InitSpec::Kind::kNormal));
  BOOST_TEST(c.allow_nonfinite);
  BOOST_TEST(c.group_access);
  auto adamw = test::parse_server_args({"--name", "j", "--tensor", "w:1", "--optimizer", "adamw"});
  BOOST_REQUIRE(adamw.ok());
  BOOST_TEST(adamw->config.optimizer.weight_decay == 0.01f);  // PyTorch's AdamW default
}

// --max-worker-buffer-bytes: auto is 8 x the model's fp32 bytes, at least
// 1 GiB; a number of bytes is taken as given; anything else is refused
// naming the option; the effective configuration prints it back.
BOOST_AUTO_TEST_CASE(worker_buffer_budget_is_auto_or_a_number_of_bytes) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  auto small = test::parse_server_args({"--name", "j", "--tensor", "w:4"});
  BOOST_REQUIRE(small.ok());
  BOOST_TEST(small->config.max_worker_buffer_bytes == 0u);
  BOOST_TEST(worker_buffer_budget(small->config) == kGiB);
  auto large = test::parse_server_args({"--name", "j", "--tensor", "w:1024x1024x64", "--tensor", "b:1"});
  BOOST_REQUIRE(large.ok());
  BOOST_TEST(worker_buffer_budget(large->config) == 8 * 4 * (uint64_t{1} << 26) + 8 * 4);
  auto given = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--max-worker-buffer-bytes", "4096"});
  BOOST_REQUIRE(given.ok());
  BOOST_TEST(worker_buffer_budget(given->config) == 4096u);
  bool printed = false;
  for (const auto& [key, value] : config_entries(given->config))
    if (key == "max-worker-buffer-bytes") printed = value == "4096";
  BOOST_TEST(printed);
  for (const std::string bad : {"0", "1G", "", "18446744073709551616"}) {
    auto p = test::parse_server_args({"--name", "j", "--tensor", "w:4", "--max-worker-buffer-bytes", bad});
    BOOST_TEST(!p.ok(), bad);
    BOOST_TEST(
        p.status().message().find("--max-worker-buffer-bytes must be auto or a number of bytes") != std::string::npos,
        p.status().message());
  }
}

BOOST_AUTO_TEST_CASE(bad_options_name_the_option) {
  const auto message = [](std::vector<std::string> args) {
    auto p = test::parse_server_args(std::move(args));
    BOOST_TEST(!p.ok());
    return p.status().message();
  };
  BOOST_TEST(message({"--tensor", "w:1"}).find("--name") != std::string::npos);
  BOOST_TEST(message({"--name", "j"}).find("--tensor") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:0x3"}).find("dimension 0") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:3:f16"}).find("fp32 only") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w"}).find("--tensor 'w'") != std::string::npos);
  BOOST_TEST(message({"--name", "a/b", "--tensor", "w:1"}).find("--name") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:1", "--optimizer", "rmsprop"}).find("--optimizer") !=
             std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:1", "--momentum", "-1"}).find("--momentum") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:1", "--nesterov"}).find("--nesterov") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:1", "--backend", "tpu"}).find("--backend") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:1", "--bogus", "1"}).find("bogus") != std::string::npos);
  BOOST_TEST(message({"--name", "j", "--tensor", "w:1", "--lr", "fast"}).find("lr") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(config_file_sets_options_and_names_unknown_keys) {
  const std::string path = "/tmp/shmps_conf_" + std::to_string(::getpid()) + ".conf";
  std::ofstream(path) << "# comment\nname = fromfile\ntensor = w:4x4\ntensor = b:4\noptimizer = sgd\n"
                         "momentum = 0.9\nnesterov = true\nmax-staleness = 7\n";
  auto p = test::parse_server_args({"--config", path, "--lr", "0.5"});
  BOOST_REQUIRE_MESSAGE(p.ok(), p.status().to_string());
  BOOST_TEST(p->config.name == "fromfile");
  BOOST_TEST(p->config.tensors.size() == 2u);
  BOOST_TEST(p->config.optimizer.momentum == 0.9f);
  BOOST_TEST(p->config.optimizer.nesterov);
  BOOST_TEST(p->config.max_staleness == 7u);
  BOOST_TEST(p->config.optimizer.lr == 0.5f);
  std::ofstream(path) << "name = x\ntensor = w:1\nlearning-rate = 0.1\n";
  auto bad = test::parse_server_args({"--config", path});
  BOOST_TEST(!bad.ok());
  BOOST_TEST(bad.status().message().find("learning-rate") != std::string::npos);
  BOOST_TEST(bad.status().message().find(path) != std::string::npos);
  ::unlink(path.c_str());
}

BOOST_AUTO_TEST_SUITE_END()
