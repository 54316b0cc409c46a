// The CUDA kernels' thread bodies (kernels/src/optimizer_cuda_body.hpp) run
// on the host over an emulated grid, against apply_cpu: the alignment plan,
// the vector/head/tail split, the grid-stride coverage and the dispatch to
// each variant, with no GPU needed. The GPU itself: test_cuda_kernels.cpp.
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "apply_harness.hpp"
#include "kernel_test_util.hpp"
#include "optimizer_cuda_body.hpp"
#include "shmps/kernels/optimizer.hpp"

namespace shmps::kernels {
#include "reference_values.inc"
}  // namespace shmps::kernels

namespace shmps::kernels::test {
namespace {

using cuda_detail::Arrays;
using cuda_detail::GradAccess;
using cuda_detail::Plan;

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// Host memory standing in for device memory; the body runs thread by
// thread. Every element belongs to exactly one thread, so running the
// threads one after the other gives what the GPU gives.
class EmulatedDevice {
 public:
  explicit EmulatedDevice(uint64_t threads) : threads_(threads) {}

  unsigned char* alloc(size_t bytes) {
    blocks_.push_back(std::make_unique<unsigned char[]>(bytes + 256));
    unsigned char* base = blocks_.back().get();
    std::memset(base, 0, bytes + 256);
    return base + (256 - address(base) % 256) % 256;
  }
  void upload(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

  void apply(const OptimizerConfig& config, const TensorState& tensor, const void* grad, GradDtype dtype,
             uint64_t step) {
    Arrays arrays;
    Plan plan;
    BOOST_REQUIRE_EQUAL(cuda_detail::prepare_apply(config, tensor, grad, dtype, step, &arrays, &plan), "");
    if (arrays.n == 0) return;
    const float* floats[4] = {tensor.weights, tensor.state[0], tensor.state[1], tensor.state[2]};
    check_plan(plan, floats, 1 + static_cast<int>(state_arrays(config)), grad, dtype, tensor.n);
    cuda_detail::dispatch_apply(
        config, dtype, step, plan.access, [&](auto op, auto dtype_c, auto access_c, const auto& params) {
          for (uint64_t t = 0; t < threads_; ++t) {
            cuda_detail::apply_thread<decltype(op), decltype(dtype_c)::value, decltype(access_c)::value>(params, arrays,
                                                                                                         t, threads_);
          }
        });
  }

  bool all_finite(const void* grad, GradDtype dtype, uint64_t n) {
    Arrays arrays;
    arrays.grad = static_cast<const unsigned char*>(grad);
    arrays.n = n;
    const Plan plan = cuda_detail::plan_access(nullptr, 0, grad, static_cast<uint32_t>(dtype_size(dtype)), n);
    check_plan(plan, nullptr, 0, grad, dtype, n);
    arrays.head = plan.head;
    arrays.vectors = plan.vectors;
    uint32_t bad = 0;
    cuda_detail::visit_dtype(dtype, [&](auto dtype_c) {
      cuda_detail::visit_access(plan.access, [&](auto access_c) {
        for (uint64_t t = 0; t < threads_; ++t) {
          bad |=
              cuda_detail::nonfinite_thread<decltype(dtype_c)::value, decltype(access_c)::value>(arrays, t, threads_);
        }
      });
    });
    return bad == 0;
  }

  // How often each access plan ran: the shapes must reach all three.
  int plans[3] = {0, 0, 0};

 private:
  // The plan's promises, which the device relies on (a misaligned vector
  // load faults there): kVector only when every array is 16-byte aligned at
  // `head`, head below one vector, fewer than one vector left for the tail;
  // kElement only when the gradient is element-aligned.
  void check_plan(const Plan& plan, const float* const* floats, int count, const void* grad, GradDtype dtype,
                  uint64_t n) {
    ++plans[static_cast<int>(plan.access)];
    const uint64_t size = dtype_size(dtype);
    const uint64_t lanes = 16 / size;
    if (plan.access == GradAccess::kVector) {
      BOOST_REQUIRE_LT(plan.head, lanes);
      BOOST_REQUIRE_GE(plan.vectors, 1u);
      BOOST_REQUIRE_LE(plan.head + plan.vectors * lanes, n);
      BOOST_REQUIRE_LT(n - plan.head - plan.vectors * lanes, lanes);
      BOOST_REQUIRE_EQUAL((address(grad) + plan.head * size) % 16, 0u);
      for (int a = 0; a < count; ++a) BOOST_REQUIRE_EQUAL((address(floats[a]) + plan.head * 4) % 16, 0u);
    } else if (plan.access == GradAccess::kElement) {
      BOOST_REQUIRE_EQUAL(address(grad) % size, 0u);
    } else {
      BOOST_REQUIRE_NE(address(grad) % size, 0u);
    }
  }

  uint64_t threads_;
  std::vector<std::unique_ptr<unsigned char[]>> blocks_;
};

constexpr GradDtype kDtypes[] = {GradDtype::kF32, GradDtype::kF16, GradDtype::kBF16};

}  // namespace

BOOST_AUTO_TEST_SUITE(cuda_body)

// Every reference configuration, every dtype, every shape, 3 steps, on a
// grid of 197 threads (not a multiple of anything) and of 1 thread (one
// thread does everything: the grid-stride loops wrap many times).
BOOST_AUTO_TEST_CASE(emulated_kernels_match_apply_cpu) {
  for (const uint64_t threads : {uint64_t{197}, uint64_t{1}}) {
    EmulatedDevice device(threads);
    for (const RefCase& ref : kRefCases) {
      for (const GradDtype dtype : kDtypes) {
        for (const Shape& shape : apply_shapes(false)) {
          BOOST_TEST_CONTEXT(ref.name << " (" << describe_config(ref.config) << "), " << dtype_name(dtype) << ", "
                                      << shape.what << ", " << threads << " threads") {
            run_against_cpu(device, ref.config, dtype, shape, 3, 11);
          }
        }
      }
    }
    BOOST_TEST(device.plans[static_cast<int>(GradAccess::kVector)] > 0);
    BOOST_TEST(device.plans[static_cast<int>(GradAccess::kElement)] > 0);
    BOOST_TEST(device.plans[static_cast<int>(GradAccess::kByte)] > 0);
  }
}

BOOST_AUTO_TEST_CASE(emulated_finite_check_matches_all_finite_cpu) {
  EmulatedDevice device(197);
  for (const GradDtype dtype : kDtypes) {
    for (const Shape& shape : apply_shapes(false)) {
      BOOST_TEST_CONTEXT(dtype_name(dtype) << ", " << shape.what) { run_finite_checks(device, dtype, shape); }
    }
  }
  BOOST_TEST(device.plans[static_cast<int>(GradAccess::kVector)] > 0);
  BOOST_TEST(device.plans[static_cast<int>(GradAccess::kElement)] > 0);
  BOOST_TEST(device.plans[static_cast<int>(GradAccess::kByte)] > 0);
}

// The head search: with 2-byte gradients the head is where the fp32
// arrays' and the gradient's 16-byte boundaries meet, up to 7 elements in.
BOOST_AUTO_TEST_CASE(plan_finds_the_common_vector_boundary) {
  alignas(64) static float weights[64];
  alignas(64) static unsigned char grad[256];
  const float* floats[1] = {weights + 2};  // aligned from element 2 (mod 4)
  // f16 gradient 4 bytes past a boundary: aligned from element 6 (mod 8).
  Plan plan = cuda_detail::plan_access(floats, 1, grad + 4, 2, 40);
  BOOST_TEST((plan.access == GradAccess::kVector));
  BOOST_TEST(plan.head == 6u);
  BOOST_TEST(plan.vectors == 4u);  // (40 - 6) / 8
  // f16 gradient 2 bytes past: element 7 (mod 8), never 2 (mod 4).
  plan = cuda_detail::plan_access(floats, 1, grad + 2, 2, 40);
  BOOST_TEST((plan.access == GradAccess::kElement));
  // Too short for one vector after the head: scalar.
  plan = cuda_detail::plan_access(floats, 1, grad + 4, 2, 13);
  BOOST_TEST((plan.access == GradAccess::kElement));
  // Odd byte address: bytes.
  plan = cuda_detail::plan_access(floats, 1, grad + 1, 4, 40);
  BOOST_TEST((plan.access == GradAccess::kByte));
}

BOOST_AUTO_TEST_CASE(prepare_apply_refuses_bad_arguments) {
  Arrays arrays;
  Plan plan;
  OptimizerConfig config;
  config.momentum = 0.9f;
  float w[4] = {};
  float grad[4] = {};
  TensorState tensor;
  tensor.weights = w;
  tensor.n = 4;
  const auto prepare = [&](const OptimizerConfig& c, GradDtype dtype, uint64_t step) {
    return cuda_detail::prepare_apply(c, tensor, grad, dtype, step, &arrays, &plan);
  };
  BOOST_TEST(prepare(config, GradDtype::kF32, 0).find("step must be >= 1") != std::string::npos);
  BOOST_TEST(prepare(config, static_cast<GradDtype>(7), 1).find("dtype 7") != std::string::npos);
  OptimizerConfig bad_kind = config;
  bad_kind.kind = static_cast<OptimizerKind>(9);
  BOOST_TEST(prepare(bad_kind, GradDtype::kF32, 1).find("kind 9") != std::string::npos);
  BOOST_TEST(prepare(config, GradDtype::kF32, 1).find("state[0] is null") != std::string::npos);
  tensor.state[0] = w;
  BOOST_TEST(prepare(config, GradDtype::kF32, 1) == "");
  tensor.n = 0;
  tensor.weights = nullptr;
  BOOST_TEST(prepare(config, GradDtype::kF32, 1) == "");
  BOOST_TEST(arrays.n == 0u);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace shmps::kernels::test
