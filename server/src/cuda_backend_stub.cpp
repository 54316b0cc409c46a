// make_cuda_backend() in a build without CUDA (SHMPS_CUDA=OFF or no nvcc):
// --backend cuda fails with a clear message, --backend auto picks host.
#include "backend.hpp"

namespace shmps::server {

Result<std::unique_ptr<Backend>> make_cuda_backend(const std::string&) {
  return Status{ErrorCode::kCuda,
                "--backend cuda: this shmps-server was built without CUDA (SHMPS_CUDA=OFF or no "
                "nvcc at build time); rebuild with the cuda preset, or use --backend host"};
}

bool cuda_backend_available(std::string* reason) {
  if (reason != nullptr) *reason = "built without CUDA";
  return false;
}

}  // namespace shmps::server
