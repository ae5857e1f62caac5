#include "quant.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pycomm {
namespace {

// The scale of a block, and the factor that maps it onto codes.
struct BlockScale {
  float scale;    // value = scale * code
  float to_code;  // code = round(x * to_code)
};

BlockScale block_scale(const float* x, size_t n) {
  float absmax = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && std::isfinite(a);
    absmax = a > absmax ? a : absmax;
  }
  if (!finite) return {std::nanf(""), 0.0f};
  if (absmax == 0.0f) return {0.0f, 0.0f};
  return {absmax / 127.0f, 127.0f / absmax};
}

}  // namespace

void cpu_quantize_int8(void* dst, const float* src, size_t count, size_t block, float* err) {
  const size_t blocks = ceil_div(count, block);
  char* scales = static_cast<char*>(dst);
  int8_t* codes = reinterpret_cast<int8_t*>(scales + blocks * sizeof(float));
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, n = count - lo < block ? count - lo : block;
    const BlockScale s = block_scale(src + lo, n);
    std::memcpy(scales + b * sizeof(float), &s.scale, sizeof(float));
    const bool nan_block = std::isnan(s.scale);
    for (size_t i = lo; i < lo + n; ++i) {
      // ties to even (the default rounding mode); a NaN block's codes are 0
      float q = nan_block ? 0.0f : std::nearbyint(src[i] * s.to_code);
      q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
      codes[i] = static_cast<int8_t>(q);
      if (err) err[i] = nan_block ? 0.0f : src[i] - s.scale * q;
    }
  }
}

void cpu_dequantize_int8(float* dst, const void* src, size_t count, size_t block, bool add) {
  const size_t blocks = ceil_div(count, block);
  const char* scales = static_cast<const char*>(src);
  const int8_t* codes = reinterpret_cast<const int8_t*>(scales + blocks * sizeof(float));
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, n = count - lo < block ? count - lo : block;
    float scale;
    std::memcpy(&scale, scales + b * sizeof(float), sizeof(float));
    for (size_t i = lo; i < lo + n; ++i) {
      const float v = scale * static_cast<float>(codes[i]);
      dst[i] = add ? dst[i] + v : v;
    }
  }
}

}  // namespace pycomm
