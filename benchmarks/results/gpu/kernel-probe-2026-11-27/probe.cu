// Kernel-variant probe (issue 36 item 7): which launch shape brings the
// reduction kernel to torch add_'s speed. Same combine functor as
// csrc/cuda/reduce_kernels.cu; each variant checked bitwise against V0.
// nvcc -O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -arch=sm_90a -Xptxas -v probe.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "../../../../csrc/core/elementwise.h"
using namespace pycomm;

#define CK(x) do { cudaError_t ck_ = (x); if (ck_ != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(ck_), __LINE__); exit(1);} } while (0)

template <class T> struct alignas(16) Pack { static constexpr int N = 16 / sizeof(T); T v[N]; };
template <class T> struct Op { __device__ __forceinline__ T operator()(T x, T y) const { return combine(x, y, SumFn{}); } };

// A: grid-stride, unroll U, nthreads stride between a thread's packs (today's).
template <class T, int TH, int MINB, int U>
__global__ void __launch_bounds__(TH, MINB) kA(T* d, const T* a, const T* b, size_t np) {
  using P = Pack<T>; constexpr int N = P::N; Op<T> f;
  const size_t tid = (size_t)blockIdx.x * TH + threadIdx.x, nt = (size_t)gridDim.x * TH;
  P* pd = (P*)d; const P* pa = (const P*)a; const P* pb = (const P*)b;
  size_t p = tid;
  for (; p + (U - 1) * nt < np; p += U * nt) {
    P x[U], y[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { x[u] = pa[p + u * nt]; y[u] = pb[p + u * nt]; }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int e = 0; e < N; ++e) x[u].v[e] = f(x[u].v[e], y[u].v[e]);
      pd[p + u * nt] = x[u];
    }
  }
  for (; p < np; p += nt) { P x = pa[p], y = pb[p];
#pragma unroll
    for (int e = 0; e < N; ++e) x.v[e] = f(x.v[e], y.v[e]);
    pd[p] = x; }
}

// B: block-contiguous tiles of U*TH packs (torch's vectorized shape), one
// tile per block, grid covers everything (no grid stride).
template <class T, int TH, int U>
__global__ void __launch_bounds__(TH) kB(T* d, const T* a, const T* b, size_t np) {
  using P = Pack<T>; constexpr int N = P::N; Op<T> f;
  P* pd = (P*)d; const P* pa = (const P*)a; const P* pb = (const P*)b;
  const size_t base = (size_t)blockIdx.x * (U * TH) + threadIdx.x;
  P x[U], y[U];
#pragma unroll
  for (int u = 0; u < U; ++u) { size_t i = base + u * TH; if (i < np) { x[u] = pa[i]; y[u] = pb[i]; } }
#pragma unroll
  for (int u = 0; u < U; ++u) { size_t i = base + u * TH; if (i < np) {
#pragma unroll
    for (int e = 0; e < N; ++e) x[u].v[e] = f(x[u].v[e], y[u].v[e]);
    pd[i] = x[u]; } }
}

// C: grid-stride over block-contiguous tiles (B's access shape, bounded grid).
template <class T, int TH, int MINB, int U>
__global__ void __launch_bounds__(TH, MINB) kC(T* d, const T* a, const T* b, size_t np) {
  using P = Pack<T>; constexpr int N = P::N; Op<T> f;
  P* pd = (P*)d; const P* pa = (const P*)a; const P* pb = (const P*)b;
  const size_t tile = (size_t)U * TH;
  for (size_t t0 = (size_t)blockIdx.x * tile; t0 < np; t0 += (size_t)gridDim.x * tile) {
    P x[U], y[U];
    const size_t base = t0 + threadIdx.x;
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t i = base + u * TH; if (i < np) { x[u] = pa[i]; y[u] = pb[i]; } }
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t i = base + u * TH; if (i < np) {
#pragma unroll
      for (int e = 0; e < N; ++e) x[u].v[e] = f(x[u].v[e], y[u].v[e]);
      pd[i] = x[u]; } }
  }
}

static int g_sms;
template <class T> struct Bench {
  size_t n, np, bytes; T *d, *a, *b, *r;
  float time(void (*launch)(T*, const T*, const T*, size_t), bool inplace) {
    cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
    T* dst = inplace ? d : r; const T* src1 = inplace ? d : a;
    for (int i = 0; i < 3; ++i) launch(dst, src1, b, np);
    CK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
      cudaEventRecord(s); for (int i = 0; i < 30; ++i) launch(dst, src1, b, np); cudaEventRecord(e);
      CK(cudaEventSynchronize(e)); float ms; cudaEventElapsedTime(&ms, s, e); if (ms < best) best = ms;
    }
    return best / 30;
  }
};

#define GRIDA(T, TH, MINB) (unsigned)(g_sms * (MINB))
template <class T, int TH, int MINB, int U> void LA(T* d, const T* a, const T* b, size_t np) { kA<T, TH, MINB, U><<<g_sms * MINB, TH>>>(d, a, b, np); }
template <class T, int TH, int MINB, int U> void LA2(T* d, const T* a, const T* b, size_t np) { kA<T, TH, MINB, U><<<g_sms * MINB * 2, TH>>>(d, a, b, np); }
template <class T, int TH, int U> void LB(T* d, const T* a, const T* b, size_t np) { kB<T, TH, U><<<(unsigned)((np + U * TH - 1) / (U * TH)), TH>>>(d, a, b, np); }
template <class T, int TH, int MINB, int U> void LC(T* d, const T* a, const T* b, size_t np) { kC<T, TH, MINB, U><<<g_sms * MINB, TH>>>(d, a, b, np); }
// today's kernel: 512 threads, launch_bounds(512) only, 4 blocks/SM, U=4
template <class T, int TH, int MINB, int U>
__global__ void __launch_bounds__(TH) kA0(T* d, const T* a, const T* b, size_t np) { /* same body as kA without minblocks */
  using P = Pack<T>; constexpr int N = P::N; Op<T> f;
  const size_t tid = (size_t)blockIdx.x * TH + threadIdx.x, nt = (size_t)gridDim.x * TH;
  P* pd = (P*)d; const P* pa = (const P*)a; const P* pb = (const P*)b;
  size_t p = tid;
  for (; p + (U - 1) * nt < np; p += U * nt) {
    P x[U], y[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { x[u] = pa[p + u * nt]; y[u] = pb[p + u * nt]; }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int e = 0; e < N; ++e) x[u].v[e] = f(x[u].v[e], y[u].v[e]);
      pd[p + u * nt] = x[u];
    }
  }
  for (; p < np; p += nt) { P x = pa[p], y = pb[p];
#pragma unroll
    for (int e = 0; e < N; ++e) x.v[e] = f(x.v[e], y.v[e]);
    pd[p] = x; }
}
template <class T> void L0(T* d, const T* a, const T* b, size_t np) { kA0<T, 512, 4, 4><<<g_sms * 4, 512>>>(d, a, b, np); }

template <class T> void run(const char* name) {
  Bench<T> B; B.bytes = 256u << 20; B.n = B.bytes / sizeof(T); B.np = B.n / Pack<T>::N;
  CK(cudaMalloc(&B.d, B.bytes)); CK(cudaMalloc(&B.a, B.bytes)); CK(cudaMalloc(&B.b, B.bytes)); CK(cudaMalloc(&B.r, B.bytes));
  std::vector<uint16_t> h(B.bytes / 2); srand(1);
  for (auto& v : h) v = (uint16_t)(0x3000 + rand() % 0x0c00);  // small positive finite values in all 3 dtypes
  CK(cudaMemcpy(B.a, h.data(), B.bytes, cudaMemcpyHostToDevice));
  for (auto& v : h) v = (uint16_t)(0x3000 + rand() % 0x0c00);
  CK(cudaMemcpy(B.b, h.data(), B.bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(B.d, B.a, B.bytes, cudaMemcpyDeviceToDevice));
  // copy bound
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
  float cbest = 1e30f;
  for (int rep = 0; rep < 3; ++rep) { cudaEventRecord(s); for (int i = 0; i < 30; ++i) cudaMemcpyAsync(B.r, B.a, B.bytes, cudaMemcpyDeviceToDevice); cudaEventRecord(e); CK(cudaEventSynchronize(e)); float ms; cudaEventElapsedTime(&ms, s, e); cbest = std::min(cbest, ms / 30); }
  const double copy = 2.0 * B.bytes / (cbest * 1e-3) / 1e9;
  // reference result (today's kernel, out of place)
  std::vector<char> ref(B.bytes), got(B.bytes);
  L0<T>(B.r, B.a, B.b, B.np); CK(cudaDeviceSynchronize()); CK(cudaMemcpy(ref.data(), B.r, B.bytes, cudaMemcpyDeviceToHost));
  struct V { const char* name; void (*f)(T*, const T*, const T*, size_t); };
  V vs[] = {
    {"today A 512x4/SM U4 lb(512)", L0<T>},
    {"A 512x4/SM U4 lb(512,4)", LA<T, 512, 4, 4>},
    {"A 256x8/SM U4 lb(256,8)", LA<T, 256, 8, 4>},
    {"A 512x4/SM U2 lb(512,4)", LA<T, 512, 4, 2>},
    {"A 256x8/SM U2 x2 grid", LA2<T, 256, 8, 2>},
    {"B torch-like 128 U4", LB<T, 128, 4>},
    {"B 256 U4", LB<T, 256, 4>},
    {"B 128 U8", LB<T, 128, 8>},
    {"C 256x8/SM U4", LC<T, 256, 8, 4>},
    {"C 128x16/SM U4", LC<T, 128, 16, 4>},
    {"C 512x4/SM U2", LC<T, 512, 4, 2>},
  };
  printf("%s copy %.1f GB/s\n", name, copy);
  for (auto& v : vs) {
    CK(cudaMemset(B.r, 0, B.bytes));
    v.f(B.r, B.a, B.b, B.np); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(got.data(), B.r, B.bytes, cudaMemcpyDeviceToHost));
    const bool same = memcmp(got.data(), ref.data(), B.bytes) == 0;
    CK(cudaMemcpy(B.d, B.a, B.bytes, cudaMemcpyDeviceToDevice));
    const float ms_in = B.time(v.f, true), ms_out = B.time(v.f, false);
    const double bw_in = 3.0 * B.bytes / (ms_in * 1e-3) / 1e9, bw_out = 3.0 * B.bytes / (ms_out * 1e-3) / 1e9;
    printf("%s  %-30s inplace %7.1f GB/s (%.3f of copy)  outofplace %7.1f (%.3f)  %s\n", name, v.name, bw_in, bw_in / copy, bw_out, bw_out / copy, same ? "bitwise-ok" : "MISMATCH");
  }
  cudaFree(B.d); cudaFree(B.a); cudaFree(B.b); cudaFree(B.r);
}

int main() {
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp p; cudaGetDeviceProperties(&p, 0); printf("%s, %d SMs\n", p.name, g_sms);
  run<float>("float32"); run<BFloat16>("bfloat16"); run<Half>("float16");
  return 0;
}
