// device_buffer.hpp in a build without CUDA: every call says so.
#include "device_buffer.hpp"

namespace shmps::detail {
namespace {
Status no_cuda() {
  return {ErrorCode::kCuda, "device buffers need CUDA, and this shmps worker library was built without it "
                            "(SHMPS_CUDA=OFF or no nvcc at build time)"};
}
}  // namespace

Result<DeviceBuffer> describe_device_buffer(const void*, size_t, bool) { return no_cuda(); }
Status record_device_event(const DeviceBuffer&, void*) { return no_cuda(); }
void release_device_buffer(DeviceBuffer&) {}

}  // namespace shmps::detail
