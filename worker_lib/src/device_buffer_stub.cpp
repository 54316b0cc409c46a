// device_buffer.hpp in a build without CUDA: every call says so.
#include "device_buffer.hpp"

namespace shmps::detail {
namespace {
Status no_cuda() {
  return {ErrorCode::kCuda,
          "this shmps worker library was built without CUDA (SHMPS_CUDA=OFF or no nvcc at "
          "build time); device buffers need it"};
}
}  // namespace

Result<DeviceBuffer> describe_device_buffer(const void*, size_t, bool) { return no_cuda(); }
Status record_device_event(const DeviceBuffer&, void*) { return no_cuda(); }
Status mark_device_stream(const DeviceBuffer&, void*) { return no_cuda(); }
Result<bool> device_stream_marked(const DeviceBuffer&) { return no_cuda(); }
void release_device_buffer(DeviceBuffer&) {}
Result<void*> allocate_device_memory(size_t, int) { return no_cuda(); }
void free_device_memory(void*, int) {}

}  // namespace shmps::detail
