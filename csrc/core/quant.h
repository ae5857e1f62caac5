// Block-scaled 8-bit quantization of float32 (all_reduce(wire_dtype=int8)).
//
// A quantized run of `count` values in blocks of `block` elements (the last
// block may be shorter) is ceil(count / block) float32 scales followed by
// `count` int8 codes: quant_bytes(count, block) bytes, 4 / block more than
// one byte an element.
//
// int8 is symmetric per block: scale = absmax / 127, code = x * (127 /
// absmax) rounded to nearest, ties to even (so |code| <= 127), value =
// scale * code. An all-zero block has scale 0 and codes 0. A block that
// holds a NaN or an infinity gets scale NaN and codes 0: every value of it
// reads back as NaN, on every rank (no finite value would be right, and a
// NaN cannot go unnoticed), and its quantization error counts as 0, so that
// error feedback does not carry the NaN into later steps.
#pragma once

#include <cstddef>

#include "types.h"

namespace pycomm {

inline size_t quant_bytes(size_t count, size_t block) {
  return ceil_div(count, block) * sizeof(float) + count;
}

// dst (quant_bytes(count, block) bytes) = quantized src; err, when not null,
// receives src - value (error feedback's residual), elementwise. dst may not
// overlap src or err.
void cpu_quantize_int8(void* dst, const float* src, size_t count, size_t block, float* err);
// dst = the values of quantized src (add: dst += them).
void cpu_dequantize_int8(float* dst, const void* src, size_t count, size_t block, bool add);

}  // namespace pycomm
