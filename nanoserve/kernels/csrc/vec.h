// Vector pieces of the attention and elementwise kernels (decode_attention.cpp, prefill_attention.cpp,
// elementwise.cpp): dtype conversions, the fp32 lanes of the widest vectors a build has, exp, prefetch,
// and the per-phase clock of the experiment build (-DNS_PHASE_TIMES)
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include "simd_math.h"

// rows of K or V to fp32: bf16 is the high half of an fp32, a shift the compiler vectorizes
static inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}
static inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
static inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX512F__)
// 16 elements to fp32 lanes
static inline __m512 load16(const c10::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp32 lanes rounded to bf16 (nearest-even, NaN kept quiet: c10's rule), as 32-bit patterns
static inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
}
#if defined(__AVX512BF16__)
// the same rounding in one instruction (VCVTNEPS2BF16: nearest-even; it flushes fp32 denormals,
// which activations never are)
static inline __m256i bf16_packed(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#else
static inline __m256i bf16_packed(__m512 v) { return _mm512_cvtepi32_epi16(bf16_bits(v)); }
#endif
// round to the storage dtype and back: what an eager op's result holds
static inline __m512 round16(c10::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_packed(v)), 16));
}
static inline __m512 round16(float*, __m512 v) { return v; }
static inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_packed(v));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <typename T>
constexpr bool kVec16 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
#endif

// Per-phase time of the attention kernels, summed over threads: only in the experiment build made with
// -DNS_PHASE_TIMES (a clock read per phase per tile); the module's phase_times() reads and resets it
#if defined(NS_PHASE_TIMES)
#include <chrono>
enum Phase { kPack, kQload, kQK, kSoftmax, kPV, kStore, kDecScores, kDecSoftmax, kDecPV, kPhases };
inline std::atomic<int64_t> phase_ns[kPhases];
struct PhaseClock {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(Phase p) {
    const auto now = std::chrono::steady_clock::now();
    phase_ns[p] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - t).count();
    t = now;
  }
};
#define NS_LAP(clock, phase) clock.lap(phase)
#else
struct PhaseClock {};
#define NS_LAP(clock, phase) (void)clock
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// Blocks sit anywhere in the cache, so the hardware prefetcher cannot run ahead across them: the
// attention loops ask for the row 16 keys ahead themselves.
static inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}
#endif
#if defined(__AVX512F__)
// lane i = the sum of v[i]'s 16 lanes: 16 horizontal sums in 15 adds and 30 shuffles (16 separate
// reductions take ~4 shuffles each, all on the one shuffle port)
static inline __m512 hsum16(const __m512* v) {
  __m512 a[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's sums of v[4k .. 4k+3]
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    c[k] =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}
#endif

// exp for x <= 0 (fp32, ~1 ulp): 2^n * e^r with |r| <= ln2/2, degree-6 Taylor
static inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
#if defined(__AVX512F__)
// 2^x for finite x <= 0, 16 lanes. For fp32 probabilities 2^round(x) * 2^r, |r| <= 1/2, by Cephes'
// degree-6 exp2f polynomial (~1 ulp). For bf16 ones (rounded to 8 bits next) 2^floor(x) * 2^r with
// r = x - floor(x) in [0, 1) from one VREDUCEPS, a degree-4 fit of 2^r (relative error <= 5.3e-6), and
// VSCALEFPS by x itself (it takes the floor): no rounding, subtraction or integer step.
template <typename C>
static inline __m512 exp2_16(__m512 x) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
#if defined(__AVX512DQ__)
    const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
    const __m512 r = _mm512_sub_ps(x, _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
    __m512 p = _mm512_set1_ps(1.3511545e-2f);
    for (float c : {5.1989599e-2f, 0.24150880f, 0.69297428f, 1.0000053f})
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, x);
  } else {
    return exp2_16f(x);
  }
}
#endif

// fp32 lanes of the widest vectors the build has, for the decode kernels' fp32 arithmetic (fp32 caches;
// bf16 ones where the CPU has no AVX512_BF16; fp16 ones): AVX-512 (16 lanes) or AVX2 + FMA + F16C (8)
#if defined(__AVX512F__)
#define NS_LANES 1
struct Lanes {
  using V = __m512;
  static constexpr int N = 16, REGS = 32;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  template <typename T>
  static V load(const T* p) {
    return load16(p);
  }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, V v, int64_t cnt) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << cnt) - 1), v);
  }
  static V hsum(const V* v) { return hsum16(v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NS_LANES 1
struct Lanes {
  using V = __m256;
  static constexpr int N = 8, REGS = 16;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {  // bf16 is the high half of an fp32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, V v, int64_t cnt) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)), idx), v);
  }
  static V hsum(const V* v) {  // lane i = the sum of v[i]'s 8 lanes
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1),
                 b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit half: v0..v3 | v4..v7
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  }
};
#endif

// One layer of the paged KV cache [blocks, layers, 2, kv heads, block size, head dim], as the attention
// kernels walk it: K of block b, head hk at k + b * block_stride + hk * bs * d, its V v_off further
template <typename T>
struct PagedLayer {
  const T* k;
  int64_t block_stride, v_off, kh, bs, d;
};
