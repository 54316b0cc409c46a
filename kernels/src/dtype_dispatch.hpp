// visit_dtype: turns a runtime gradient dtype into a compile-time constant
// for f, so each dtype gets its own specialised loop or kernel. Shared by
// the CPU implementation and the CUDA launchers (host code only).
#pragma once

#include <type_traits>

#include "shmps/kernels/optimizer.hpp"

namespace shmps::kernels::detail {

// dtype must be inside the enum (callers check dtype_size() first); a value
// outside it is treated as kF32.
template <class F>
auto visit_dtype(GradDtype dtype, F&& f) {
  switch (dtype) {
    case GradDtype::kF16:
      return f(std::integral_constant<GradDtype, GradDtype::kF16>{});
    case GradDtype::kBF16:
      return f(std::integral_constant<GradDtype, GradDtype::kBF16>{});
    case GradDtype::kF32:
    default:
      return f(std::integral_constant<GradDtype, GradDtype::kF32>{});
  }
}

}  // namespace shmps::kernels::detail
