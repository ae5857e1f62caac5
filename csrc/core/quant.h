// Block-scaled 8-bit quantization of float32 (all_reduce(wire_dtype=int8,
// float8_e4m3fn or float8_e5m2)).
//
// A quantized run of `count` values in blocks of `block` elements (the last
// block may be shorter) is ceil(count / block) float32 scales followed by
// `count` one-byte codes: quant_bytes(count, block) bytes, 4 / block more
// than one byte an element, whatever the format.
//
// Every format is symmetric per block, with the format's largest code value
// M (int8: 127, float8_e4m3fn: 448, float8_e5m2: 57344): scale = absmax / M,
// y = x * (M / absmax) (both float32 divisions, then one multiply), and
// value = scale * decode(code) (exact decode, one multiply):
//
//   int8         code = y rounded to the nearest integer, ties to even,
//                clamped to [-127, 127]
//   float8_*     code = y clamped to [-M, M], then rounded to the format
//                (nearest, ties to even: torch's x.to(torch.float8_*)), so
//                that rounding at the top saturates instead of giving inf
//                or NaN
//
// An all-zero block has scale 0 and codes 0 (float8: -0 for -0.0), and so
// has a block whose M / absmax overflows float32 (absmax below M / FLT_MAX,
// ~1e-34: its values, all but zero, go whole into the error). A block that holds a NaN or an
// infinity gets scale NaN and codes 0: every value of it reads back as NaN,
// on every rank (no finite value would be right, and a NaN cannot go
// unnoticed), and its quantization error counts as 0, so that error feedback
// does not carry the NaN into later steps.
#pragma once

#include <cstddef>
#include <cstdint>

#include "types.h"

namespace pycomm {

// The code format of a quantized wire. The order is the binding's contract
// (_C.quantize's `format`, and AlgoKind::kQuantInt8 + format).
enum class QuantFormat : int {
  kInt8 = 0,
  kFp8E4M3 = 1,  // float8_e4m3fn: max 448, no infinity, NaN = 0x7f / 0xff
  kFp8E5M2 = 2,  // float8_e5m2: max 57344, IEEE-like (infinities, NaNs)
};
constexpr int kNumQuantFormats = 3;
// "int8", "float8_e4m3fn", "float8_e5m2" (torch's dtype names).
const char* quant_format_name(QuantFormat f);

inline size_t quant_bytes(size_t count, size_t block) {
  return ceil_div(count, block) * sizeof(float) + count;
}

// dst (quant_bytes(count, block) bytes) = quantized src; err, when not null,
// receives src - value (error feedback's residual), elementwise. dst may not
// overlap src or err.
void cpu_quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                  float* err);
// dst = the values of quantized src (add: dst += them).
void cpu_dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                    bool add);

// One float8 code of a float32 (nearest, ties to even; NaN to the format's
// NaN; beyond the format's range: e4m3fn NaN, e5m2 infinity, as torch does;
// quantize clamps before it never gets there), and a code's exact value.
uint8_t fp8_encode(QuantFormat f, float x);
float fp8_decode(QuantFormat f, uint8_t code);

}  // namespace pycomm
