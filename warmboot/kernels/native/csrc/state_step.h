// What the state layers' decode steps (state_step.cpp, conv_step.cpp) share.
#pragma once

#include <ATen/ATen.h>

namespace warmboot {

// slots: one int64 state row per batch row, each inside the cache's `capacity` rows.
inline void check_slots(const at::Tensor& slots, int64_t rows, int64_t capacity, const char* op) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == rows && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              op, ": one int64 slot per row, got ", slots.sizes());
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < capacity, op, ": slot ", s[i], " outside ", capacity);
  }
}

}  // namespace warmboot
