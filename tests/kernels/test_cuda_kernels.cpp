// The CUDA optimizers (optimizer_cuda.hpp) on the GPU against apply_cpu:
// every reference configuration x gradient dtype x shape (odd lengths,
// misaligned arrays, 10M elements), 3 steps, bitwise equal (the kernels are
// built with --fmad=false); all_finite_cuda finds NaN/Inf anywhere.
// Without a device the GPU cases are skipped with the reason.
#define BOOST_TEST_MODULE shmps_cuda_kernels
#include <boost/test/unit_test.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "apply_harness.hpp"
#include "kernel_test_util.hpp"
#include "shmps/cuda_check.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/kernels/optimizer_cuda.hpp"

namespace shmps::kernels {
#include "reference_values.inc"
}  // namespace shmps::kernels

namespace shmps::kernels::test {
namespace {

// Precondition of every GPU case: skips it, with the reason, where there
// is no device (or no driver).
boost::test_tools::assertion_result has_cuda_device(boost::unit_test::test_unit_id) {
  std::string reason;
  if (cuda_device_count(&reason) > 0) return true;
  boost::test_tools::assertion_result result(false);
  result.message() << "no CUDA device: " << reason;
  return result;
}

#define REQUIRE_CUDA(expr) BOOST_REQUIRE_EQUAL(SHMPS_CUDA_ERROR(expr), "")

// Device memory for one case, freed at scope exit. Applies go to a stream
// of its own on odd steps and to the default stream on even ones, so both
// paths run. The stream is a blocking one: its work waits for the uploads
// and memsets on the default stream (a cudaMemcpy from pageable memory may
// return before its DMA has landed).
class CudaDevice {
 public:
  CudaDevice() { REQUIRE_CUDA(cudaStreamCreate(&stream_)); }
  ~CudaDevice() {
    for (void* p : blocks_) (void)cudaFree(p);  // best effort: a destructor cannot fail the test usefully
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  unsigned char* alloc(size_t bytes) {
    void* p = nullptr;
    REQUIRE_CUDA(cudaMalloc(&p, bytes + 256));  // cudaMalloc is 256-byte aligned
    blocks_.push_back(p);
    REQUIRE_CUDA(cudaMemset(p, 0, bytes + 256));
    return static_cast<unsigned char*>(p);
  }
  void upload(void* dst, const void* src, size_t bytes) {
    REQUIRE_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void download(void* dst, const void* src, size_t bytes) {
    REQUIRE_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }

  void apply(const OptimizerConfig& config, const TensorState& tensor, const void* grad, GradDtype dtype,
             uint64_t step) {
    cudaStream_t stream = step % 2 == 1 ? stream_ : nullptr;
    BOOST_REQUIRE_MESSAGE(apply_cuda(config, tensor, grad, dtype, step, stream).ok(), "apply_cuda");
    REQUIRE_CUDA(cudaStreamSynchronize(stream));
  }

  bool all_finite(const void* grad, GradDtype dtype, uint64_t n) {
    if (flag_ == nullptr) flag_ = reinterpret_cast<int*>(alloc(sizeof(int)));
    bool finite = false;
    BOOST_REQUIRE(all_finite_cuda(grad, dtype, n, flag_, stream_, &finite).ok());
    // The asynchronous form gives the same answer through the flag.
    int nonfinite = -1;
    BOOST_REQUIRE(all_finite_cuda_async(grad, dtype, n, flag_, nullptr).ok());
    REQUIRE_CUDA(cudaMemcpy(&nonfinite, flag_, sizeof nonfinite, cudaMemcpyDeviceToHost));
    BOOST_TEST(nonfinite == (finite ? 0 : 1));
    return finite;
  }

 private:
  cudaStream_t stream_ = nullptr;
  int* flag_ = nullptr;
  std::vector<void*> blocks_;
};

constexpr GradDtype kDtypes[] = {GradDtype::kF32, GradDtype::kF16, GradDtype::kBF16};

// Every reference case of `kind` x dtype x shape; 3 steps (2 for 10M
// elements: the first-step rule and the general one).
void check_kind(OptimizerKind kind) {
  for (const RefCase& ref : kRefCases) {
    if (ref.config.kind != kind) continue;
    for (const GradDtype dtype : kDtypes) {
      for (const Shape& shape : apply_shapes(true)) {
        BOOST_TEST_CONTEXT(ref.name << " (" << describe_config(ref.config) << "), " << dtype_name(dtype) << ", "
                                    << shape.what) {
          CudaDevice device;
          run_against_cpu(device, ref.config, dtype, shape, shape.n > 1'000'000 ? 2 : 3, 7);
        }
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(cuda)

BOOST_AUTO_TEST_CASE(sgd_matches_apply_cpu, *boost::unit_test::precondition(has_cuda_device)) {
  check_kind(OptimizerKind::kSgd);
}

BOOST_AUTO_TEST_CASE(adam_matches_apply_cpu, *boost::unit_test::precondition(has_cuda_device)) {
  check_kind(OptimizerKind::kAdam);
}

BOOST_AUTO_TEST_CASE(adamw_matches_apply_cpu, *boost::unit_test::precondition(has_cuda_device)) {
  check_kind(OptimizerKind::kAdamW);
}

BOOST_AUTO_TEST_CASE(all_finite_finds_nan_and_inf, *boost::unit_test::precondition(has_cuda_device)) {
  for (const GradDtype dtype : kDtypes) {
    for (const Shape& shape : apply_shapes(true)) {
      BOOST_TEST_CONTEXT(dtype_name(dtype) << ", " << shape.what) {
        CudaDevice device;
        run_finite_checks(device, dtype, shape);
      }
    }
  }
}

// An empty tensor launches nothing and needs no pointers; the empty
// gradient is finite.
BOOST_AUTO_TEST_CASE(empty_tensor_is_a_no_op, *boost::unit_test::precondition(has_cuda_device)) {
  CudaDevice device;
  int* flag = reinterpret_cast<int*>(device.alloc(sizeof(int)));
  BOOST_TEST(apply_cuda(OptimizerConfig{}, TensorState{}, nullptr, GradDtype::kF32, 1, nullptr).ok());
  bool finite = false;
  BOOST_TEST(all_finite_cuda(nullptr, GradDtype::kF32, 0, flag, nullptr, &finite).ok());
  BOOST_TEST(finite);
}

// No device needed: the count never aborts, and says why when it is 0.
BOOST_AUTO_TEST_CASE(device_count_reports_its_reason) {
  std::string reason;
  const int count = cuda_device_count(&reason);
  BOOST_TEST(count >= 0);
  if (count == 0) {
    BOOST_TEST(reason.rfind("cuda", 0) == 0u, "reason: " << reason);
    BOOST_TEST_MESSAGE("no CUDA device here: " << reason);
  }
}

// No device needed: bad arguments are refused before any CUDA call.
BOOST_AUTO_TEST_CASE(bad_arguments_are_refused) {
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  float dummy[4] = {};
  TensorState tensor;
  tensor.weights = dummy;
  tensor.n = 4;
  // Refused as arguments (kInvalidArgument), with the reason named.
  const auto contains = [](const Status& s, const char* part) {
    return s.code() == ErrorCode::kInvalidArgument && s.message().find(part) != std::string::npos;
  };
  BOOST_TEST(contains(apply_cuda(adam, tensor, dummy, GradDtype::kF32, 0, nullptr), "step must be >= 1"));
  BOOST_TEST(contains(apply_cuda(adam, tensor, dummy, static_cast<GradDtype>(4), 1, nullptr), "dtype 4"));
  BOOST_TEST(contains(apply_cuda(adam, tensor, dummy, GradDtype::kF32, 1, nullptr), "state[0] is null"));
  BOOST_TEST(contains(apply_cuda(adam, tensor, nullptr, GradDtype::kF32, 1, nullptr), "null weights or gradient"));
  bool finite = true;
  BOOST_TEST(contains(all_finite_cuda(dummy, static_cast<GradDtype>(0), 4, nullptr, nullptr, &finite), "dtype 0"));
  BOOST_TEST(contains(all_finite_cuda(dummy, GradDtype::kF16, 4, nullptr, nullptr, &finite), "null flag"));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace shmps::kernels::test
