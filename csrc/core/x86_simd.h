// Whether this build can compile the x86 vector paths (reduce.cc, quant.cc):
// PYCOMM_X86_SIMD is 1 with GCC or Clang on x86, where the AVX2 functions
// carry their own target attribute and run only if the CPU has AVX2
// (cpu_uses_avx2); the build itself targets baseline x86-64.
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define PYCOMM_X86_SIMD 1
#include <immintrin.h>
#else
#define PYCOMM_X86_SIMD 0
#endif
