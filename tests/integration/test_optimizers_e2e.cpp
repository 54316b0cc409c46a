// Every optimizer through a real server process: several pushes, applied in
// order, must leave exactly the weights that kernels::apply_cpu (itself
// pinned to PyTorch by tests/kernels) computes for the same sequence, with
// PyTorch's per-tensor step counts (a push of one tensor steps only it).
#define BOOST_TEST_MODULE test_optimizers_e2e
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <fstream>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"

using namespace shmps;
namespace k = shmps::kernels;

namespace {

struct Case {
  std::string label;
  std::vector<std::string> args;
  k::OptimizerConfig config;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  k::OptimizerConfig c;
  c.kind = k::OptimizerKind::kSgd;
  c.lr = 0.1f;
  out.push_back({"sgd", {"--optimizer", "sgd", "--lr", "0.1"}, c});
  c.momentum = 0.9f;
  c.weight_decay = 0.01f;
  out.push_back(
      {"sgd_momentum_wd", {"--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01"}, c});
  c.dampening = 0.5f;
  out.push_back(
      {"sgd_dampening",
       {"--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01", "--dampening", "0.5"},
       c});
  c.dampening = 0.0f;
  c.nesterov = true;
  out.push_back({"sgd_nesterov",
                 {"--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01", "--nesterov"},
                 c});
  k::OptimizerConfig a;
  a.kind = k::OptimizerKind::kAdam;
  a.lr = 0.01f;
  out.push_back({"adam", {"--optimizer", "adam", "--lr", "0.01"}, a});
  a.amsgrad = true;
  a.weight_decay = 0.1f;
  a.beta1 = 0.8f;
  a.beta2 = 0.99f;
  a.eps = 1e-6f;
  out.push_back({"adam_amsgrad_wd",
                 {"--optimizer", "adam", "--lr", "0.01", "--amsgrad", "--weight-decay", "0.1", "--beta1", "0.8",
                  "--beta2", "0.99", "--eps", "1e-6"},
                 a});
  k::OptimizerConfig w;
  w.kind = k::OptimizerKind::kAdamW;
  w.lr = 0.01f;
  w.weight_decay = 0.01f;  // AdamW's default, left implicit on the command line
  out.push_back({"adamw", {"--optimizer", "adamw", "--lr", "0.01"}, w});
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(optimizers_e2e)

BOOST_AUTO_TEST_CASE(each_optimizer_through_the_server_matches_the_reference) {
  // Two tensors (sizes 6 and 3); the initial weights come from a file.
  const std::vector<uint64_t> sizes = {6, 3};
  const uint64_t total = 9;
  std::vector<float> init(total);
  for (uint64_t i = 0; i < total; ++i) init[i] = std::sin(static_cast<float>(i) + 1.0f);
  const std::string init_path = "/tmp/shmps_opt_init_" + std::to_string(::getpid()) + ".bin";
  std::ofstream(init_path, std::ios::binary).write(reinterpret_cast<const char*>(init.data()), total * 4);

  for (const Case& c : cases()) {
    BOOST_TEST_CONTEXT("optimizer " << c.label) {
      std::vector<std::string> args = {"--tensor",        "a:2x3", "--tensor",    "b:3",
                                       "--max-staleness", "1000",  "--init-file", init_path};
      args.insert(args.end(), c.args.begin(), c.args.end());
      test::ServerProcess server(test::unique_name(c.label), args);
      WorkerOptions o;
      o.name = server.name();
      auto w = Worker::connect(o);
      BOOST_REQUIRE_MESSAGE(w.ok(), w.status().to_string());
      auto grad = (*w)->register_buffer(total * 4);
      auto out = (*w)->register_buffer(total * 4);
      BOOST_REQUIRE(grad.ok() && out.ok());

      // Reference state, kept per tensor like the server.
      std::vector<float> ref = init;
      std::vector<std::vector<float>> state(3, std::vector<float>(total, 0.0f));
      std::vector<uint64_t> steps(2, 0);
      const auto ref_apply = [&](uint32_t t, const float* g) {
        const uint64_t off = t == 0 ? 0 : sizes[0];
        k::TensorState ts;
        ts.weights = ref.data() + off;
        for (int s = 0; s < 3; ++s) ts.state[s] = state[s].data() + off;
        ts.n = sizes[t];
        k::apply_cpu(c.config, ts, g, k::GradDtype::kF32, ++steps[t]);
      };

      float* g = static_cast<float*>(grad->data);
      for (int step = 0; step < 6; ++step) {
        for (uint64_t i = 0; i < total; ++i) g[i] = std::cos(static_cast<float>(step * 13 + i)) * 0.5f;
        if (step % 3 == 2) {
          // Only tensor b, from the front of the buffer: steps only b.
          auto v = (*w)->push(1, grad->id, 0, sizes[1] * 4, Dtype::kF32, static_cast<uint64_t>(step));
          BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
          ref_apply(1, g);
        } else {
          auto v = (*w)->push(kAllTensors, grad->id, 0, total * 4, Dtype::kF32, static_cast<uint64_t>(step));
          BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
          BOOST_TEST(*v == static_cast<uint64_t>(step + 1));
          ref_apply(0, g);
          ref_apply(1, g + sizes[0]);
        }
      }
      auto v = (*w)->pull(kAllTensors, out->id, 0);
      BOOST_REQUIRE(v.ok());
      BOOST_TEST(*v == 6u);
      const float* got = static_cast<const float*>(out->data);
      for (uint64_t i = 0; i < total; ++i) {
        BOOST_TEST(got[i] == ref[i], "element " << i << ": server " << got[i] << ", reference " << ref[i]);
        BOOST_TEST(got[i] != init[i]);  // every element moved
      }
    }
  }
  ::unlink(init_path.c_str());
}

BOOST_AUTO_TEST_CASE(half_precision_gradients_match_their_fp32_values) {
  test::ServerProcess server(test::unique_name("half"), {"--tensor", "w:4", "--optimizer", "sgd", "--lr", "1"});
  WorkerOptions o;
  o.name = server.name();
  auto w = Worker::connect(o);
  BOOST_REQUIRE(w.ok());
  auto buf = (*w)->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  // f16: 1.0, -2.0, 0.5, 65504 ; bf16: 1.0, -2.0, 0.5, 3.0
  const uint16_t f16[4] = {0x3C00, 0xC000, 0x3800, 0x7BFF};
  std::memcpy(buf->data, f16, 8);
  BOOST_REQUIRE((*w)->push(0, buf->id, 0, 8, Dtype::kF16, 0).ok());
  const uint16_t bf16[4] = {0x3F80, 0xC000, 0x3F00, 0x4040};
  std::memcpy(buf->data, bf16, 8);
  BOOST_REQUIRE((*w)->push(0, buf->id, 0, 8, Dtype::kBF16, 1).ok());
  BOOST_REQUIRE((*w)->pull(0, buf->id, 0).ok());
  const float* got = static_cast<const float*>(buf->data);
  const float expect[4] = {-2.0f, 4.0f, -1.0f, -65507.0f};
  for (int i = 0; i < 4; ++i) BOOST_TEST(got[i] == expect[i]);
}

BOOST_AUTO_TEST_SUITE_END()
