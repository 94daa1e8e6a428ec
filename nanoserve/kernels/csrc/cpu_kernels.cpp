// nanoserve's C++ CPU kernels, built on first use by nanoserve/kernels/cpu_kernels.py
// (torch.utils.cpp_extension, -march=native; cached by a hash of this file, the CPU flags and torch).
// ATen and pybind11's tensor casters, not <torch/extension.h>: that one brings torch's whole C++
// frontend (autograd, nn, optim) and took a third more compile time (30 s against 20 s a module)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include "simd_math.h"
#include "linear_entry.h"
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <map>
#include <string>

// rows of K or V to fp32: bf16 is the high half of an fp32, a shift the compiler vectorizes
static inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}
static inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
static inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX512F__)
#include <immintrin.h>
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
static inline void store16(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_packed(v)); }
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <typename T> constexpr bool kVec16 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
#endif

// Per-phase time of the attention kernels, summed over threads: only in the build that
// the experiment bench/attention_phases.py (at c256b25) made with -DNS_PHASE_TIMES (a clock read per phase per tile).
#if defined(NS_PHASE_TIMES)
#include <chrono>
enum Phase { kPack, kQload, kQK, kSoftmax, kPV, kStore, kDecScores, kDecSoftmax, kDecPV, kPhases };
static std::atomic<int64_t> phase_ns[kPhases];
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
#include <immintrin.h>
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
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's sums of v[4k .. 4k+3]
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}
#endif

// exp for x <= 0 (fp32, ~1 ulp): 2^n * e^r with |r| <= ln2/2, degree-6 Taylor
static inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
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
    for (float c : {5.1989599e-2f, 0.24150880f, 0.69297428f, 1.0000053f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, x);
  } else {
    return exp2_16f(x);
  }
}
#endif

// One decode row of scores in place -> probabilities (fp32): n keys, all visible.
static inline void softmax_inplace(float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + t));
  mx = _mm512_reduce_max_ps(vm);
  for (int64_t u = t; u < n; ++u) mx = std::max(mx, x[u]);
  constexpr float log2e = 1.44269504088896341f;
  const __m512 l2e = _mm512_set1_ps(log2e), mneg = _mm512_set1_ps(-mx * log2e);
  __m512 vs = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp2_16<float>(_mm512_fmadd_ps(_mm512_loadu_ps(x + t), l2e, mneg));
    vs = _mm512_add_ps(vs, e);
    _mm512_storeu_ps(x + t, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vm = _mm256_set1_ps(mx);
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + t));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  mx = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  for (int64_t u = t; u < n; ++u) mx = std::max(mx, x[u]);
  constexpr float log2e = 1.44269504088896341f;
  const __m256 l2e = _mm256_set1_ps(log2e), mneg = _mm256_set1_ps(-mx * log2e);
  __m256 vs = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {  // the AVX-512 path's arithmetic, 8 lanes (exp2_8f)
    const __m256 e = exp2_8f(_mm256_fmadd_ps(_mm256_loadu_ps(x + t), l2e, mneg));
    vs = _mm256_add_ps(vs, e);
    _mm256_storeu_ps(x + t, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vs);
  for (float l : lanes) sum += l;
#else
  for (int64_t u = 0; u < n; ++u) mx = std::max(mx, x[u]);
#endif
  for (; t < n; ++t) {
    x[t] = exp_neg(x[t] - mx);
    sum += x[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t u = 0; u < n; ++u) x[u] *= inv;
}

// The decode kernels below are noinline: inlined into decode's lambdas, pv_pairs' accumulators went
// back to the stack (batch 1: 0.27 -> 0.33 ms a step), qk_lanes' fp32 Q.K lost ~8%.
// f(rows, next, t0, count) for each block of a sequence's context, in order: the block's first row, the
// next block's (the block itself for the last, so that prefetches stay in the sequence's own blocks),
// the block's first key and its key count. A plain loop a block: a row walker's per-key branches kept
// the kernels' accumulators on the stack
template <typename T, typename F>
static inline void for_blocks(const T* base, const int64_t* table, int64_t stride, int64_t bs, int64_t n, F&& f) {
  const int64_t blocks = (n + bs - 1) / bs;
  for (int64_t b = 0; b < blocks; ++b) {
    const T* rows = base + table[b] * stride;
    f(rows, b + 1 < blocks ? base + table[b + 1] * stride : rows, b * bs, std::min(bs, n - b * bs));
  }
}

// f(j0, std::integral_constant<int, G>()) for the heads [j0, j0 + G) of g, 8 at a time: for the kernels
// that keep G heads' accumulators in registers, which needs G at compile time
template <typename F>
static inline void by_head_chunks(int64_t g, F&& f) {
  for (int64_t j0 = 0; j0 < g; j0 += 8) {
    switch (std::min<int64_t>(8, g - j0)) {
      case 1: f(j0, std::integral_constant<int, 1>()); break;
      case 2: f(j0, std::integral_constant<int, 2>()); break;
      case 3: f(j0, std::integral_constant<int, 3>()); break;
      case 4: f(j0, std::integral_constant<int, 4>()); break;
      case 5: f(j0, std::integral_constant<int, 5>()); break;
      case 6: f(j0, std::integral_constant<int, 6>()); break;
      case 7: f(j0, std::integral_constant<int, 7>()); break;
      default: f(j0, std::integral_constant<int, 8>()); break;
    }
  }
}

#if defined(__AVX512BF16__)
// p.V of G query heads sharing a KV head, D dims in passes of WC 32-dim chunks (as many as 24
// accumulators allow; each pass reads its own part of every V row): two keys at a time in
// VDPBF16PS, their V rows interleaved word by word and the probabilities bf16 (pb[j * np + t]: the
// inputs of a bf16 P.V matmul, as flash attention feeds it). G and WC are compile-time so the 2 G WC
// accumulators live in registers: indexed by a runtime head count they sat on the stack, a store and a
// reload around every VDPBF16PS (1.6x slower in L3). acc [G][D] gets the fp32 sums.
template <int G, int64_t D>
__attribute__((noinline)) static void pv_pairs(const c10::BFloat16* vbase, const int64_t* table, int64_t stride, int64_t bs, int64_t n,
                     const uint16_t* pb, int64_t np, float* acc) {
  constexpr int W = D / 32, WC = G <= 3 && W % 4 == 0 ? 4 : G <= 6 && W % 2 == 0 ? 2 : 1;
  for (int c0 = 0; c0 < W; c0 += WC) {
    __m512 lo[G][WC], hi[G][WC];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < WC; ++c) lo[j][c] = hi[j][c] = _mm512_setzero_ps();
    // keys r0, r1 (r1 null: a lone key, paired with zeros) with their probabilities' words at p0
    auto step = [&](const c10::BFloat16* r0, const c10::BFloat16* r1, const uint16_t* p0) {
      __m512i vl[WC], vh[WC];
      for (int c = 0; c < WC; ++c) {  // words: (r0[k], r1[k]) for k of each 128-bit lane's low / high half
        const __m512i a = _mm512_loadu_si512(r0 + c * 32);
        const __m512i b = r1 ? _mm512_loadu_si512(r1 + c * 32) : _mm512_setzero_si512();
        vl[c] = _mm512_unpacklo_epi16(a, b);
        vh[c] = _mm512_unpackhi_epi16(a, b);
      }
      for (int j = 0; j < G; ++j) {
        uint32_t pair = p0[j * np];
        if (r1) pair |= static_cast<uint32_t>(p0[j * np + 1]) << 16;
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        for (int c = 0; c < WC; ++c) {
          lo[j][c] = _mm512_dpbf16_ps(lo[j][c], reinterpret_cast<__m512bh>(vl[c]), p);
          hi[j][c] = _mm512_dpbf16_ps(hi[j][c], reinterpret_cast<__m512bh>(vh[c]), p);
        }
      }
    };
    // pairs within a block, the next block's rows asked for a pair at a time (the hardware prefetcher
    // cannot guess where it is)
    for_blocks(vbase + 32 * c0, table, stride, bs, n, [&](const c10::BFloat16* rows, const c10::BFloat16* next,
                                                         int64_t t0, int64_t cnt) {
      int64_t u = 0;
      for (; u + 2 <= cnt; u += 2) {
        prefetch_row(next + u * D, WC * 64);
        prefetch_row(next + (u + 1) * D, WC * 64);
        step(rows + u * D, rows + (u + 1) * D, pb + t0 + u);
      }
      if (u < cnt) step(rows + u * D, nullptr, pb + t0 + u);
    });
    alignas(64) float lf[16], hf[16];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < WC; ++c) {  // lane m of lo is dim 8 (m / 4) + m % 4 of the chunk, of hi 4 more
        _mm512_store_ps(lf, lo[j][c]);
        _mm512_store_ps(hf, hi[j][c]);
        float* aj = acc + j * D + (c0 + c) * 32;
        for (int m = 0; m < 16; ++m) {
          aj[8 * (m / 4) + m % 4] = lf[m];
          aj[8 * (m / 4) + m % 4 + 4] = hf[m];
        }
      }
  }
}

// sc[j * width + t] = scale * q_j . k_t for g query heads sharing a KV head: bf16 dot products (VDPBF16PS,
// no conversion), 16 keys at a time, one hsum16 each. Block by block, K rows read where they are for each
// head (the 16 rows x D/32 vectors held in registers for all heads at once took all 32 and then some)
template <int64_t D>
__attribute__((noinline)) static void qk_heads(const c10::BFloat16* q, int64_t g, const c10::BFloat16* kbase, const int64_t* table,
                     int64_t stride, int64_t bs, int64_t n, float scale, float* sc, int64_t width) {
  constexpr int W = D / 32;
  const __m512 sv = _mm512_set1_ps(scale);
  for_blocks(kbase, table, stride, bs, n, [&](const c10::BFloat16* rows, const c10::BFloat16* next, int64_t t0,
                                              int64_t in_block) {
    for (int64_t u0 = 0; u0 < in_block; u0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, in_block - u0);
      const c10::BFloat16* ahead = u0 + 32 <= bs ? rows + (u0 + 16) * D : next;  // the next 16 keys, or near
      const c10::BFloat16* k[16];
      for (int u = 0; u < 16; ++u) {
        k[u] = rows + (u0 + std::min<int64_t>(u, cnt - 1)) * D;  // past the end: the last key again, dropped below
        prefetch_row(ahead + u * D, D * 2);
      }
      for (int64_t j = 0; j < g; ++j) {
        __m512bh qh[W];
        for (int c = 0; c < W; ++c) qh[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + j * D + c * 32));
        __m512 part[16];
        for (int u = 0; u < 16; ++u) {
          part[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[u])));
          for (int c = 1; c < W; ++c)
            part[u] = _mm512_dpbf16_ps(part[u], qh[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[u] + c * 32)));
        }
        _mm512_mask_storeu_ps(sc + j * width + t0 + u0, static_cast<__mmask16>((1u << cnt) - 1),
                              _mm512_mul_ps(hsum16(part), sv));
      }
    }
  });
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
  template <typename T> static V load(const T* p) { return load16(p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, V v, int64_t cnt) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << cnt) - 1), v); }
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
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
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
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit half: v0..v3 | v4..v7
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  }
};
#endif

#if defined(NS_LANES)
// sc[j * width + t] = q_j . k_t (q already scaled, fp32 [g, D]) for g query heads sharing a KV head:
// Lanes::N keys at a time, one horizontal-sum tree for all of them, blocks walked as qk_heads does
template <typename T, int64_t D>
__attribute__((noinline)) static void qk_lanes(const float* q, int64_t g, const T* kbase, const int64_t* table, int64_t stride, int64_t bs,
                     int64_t n, float* sc, int64_t width) {
  using L = Lanes;
  constexpr int N = L::N, C = D / N;
  for_blocks(kbase, table, stride, bs, n, [&](const T* rows, const T* next, int64_t t0, int64_t in_block) {
    for (int64_t u0 = 0; u0 < in_block; u0 += N) {
      const int64_t cnt = std::min<int64_t>(N, in_block - u0);
      const T* ahead = u0 + 2 * N <= bs ? rows + (u0 + N) * D : next;
      const T* k[N];
      for (int u = 0; u < N; ++u) k[u] = rows + (u0 + std::min<int64_t>(u, cnt - 1)) * D;  // past the end: the last key again, dropped below
      // the next N rows are asked for a few at a time, spread over every (head, chunk) step: all at
      // once (64 lines for fp32 rows) made q.k ~1.3x slower when the K/V come from memory (-DNS_PHASE_TIMES)
      const int64_t spread = g * C;
      for (int64_t j = 0; j < g; ++j) {
        typename L::V part[N];
        for (int c = 0; c < C; ++c) {
          for (int64_t u = j * C + c; u < N; u += spread) prefetch_row(ahead + u * D, D * sizeof(T));
          const typename L::V qc = L::load(q + j * D + c * N);
          for (int u = 0; u < N; ++u) part[u] = c ? L::fmadd(qc, L::load(k[u] + c * N), part[u]) : L::mul(qc, L::load(k[u]));
        }
        L::store_first(sc + j * width + t0 + u0, L::hsum(part), cnt);
      }
    }
  });
}

// acc[j, :] = sum_t p[j * pstride + t] V[t, :] for G heads (fp32 FMAs): G and the dims a pass are
// compile-time so the accumulators stay in registers (a runtime head count kept them on the stack),
// each pass reading its own part of every V row
template <typename T, int64_t D, int G>
__attribute__((noinline)) static void pv_lanes(const T* vbase, const int64_t* table, int64_t stride, int64_t bs, int64_t n, const float* p,
                     int64_t pstride, float* acc) {
  using L = Lanes;
  constexpr int N = L::N, C = D / N;
  constexpr int WC = (G + 1) * 8 + 1 <= L::REGS && C % 8 == 0 ? 8 : (G + 1) * 4 + 1 <= L::REGS && C % 4 == 0 ? 4
                     : (G + 1) * 2 + 1 <= L::REGS ? 2 : 1;
  for (int c0 = 0; c0 < C; c0 += WC) {
    typename L::V av[G][WC];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < WC; ++c) av[j][c] = L::zero();
    for_blocks(vbase + c0 * N, table, stride, bs, n, [&](const T* rows, const T* next, int64_t t0, int64_t in_block) {
      for (int64_t u = 0; u < in_block; ++u) {
        prefetch_row(next + u * D, WC * N * sizeof(T));
        typename L::V vr[WC];
        for (int c = 0; c < WC; ++c) vr[c] = L::load(rows + u * D + c * N);
        for (int j = 0; j < G; ++j) {
          const typename L::V pj = L::set1(p[j * pstride + t0 + u]);
          for (int c = 0; c < WC; ++c) av[j][c] = L::fmadd(pj, vr[c], av[j][c]);
        }
      }
    });
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < WC; ++c) L::store(acc + j * D + (c0 + c) * N, av[j][c]);
  }
}

#endif

// q [nd, h, d] (rows may be strided); cache [N, layers, 2, kh, bs, d] (contiguous); tables [nd,
// max_blocks]; ctx [nd]; the result goes to out (contiguous, q's shape)
template <typename T, int64_t d>
static void decode(const at::Tensor& q, const at::Tensor& out, const at::Tensor& cache, int64_t layer,
                   const at::Tensor& tables, const at::Tensor& ctx, float scale) {
  const int64_t nd = q.size(0), h = q.size(1);
  const int64_t layers = cache.size(1), kh = cache.size(3), bs = cache.size(4), g = h / kh;
  const int64_t max_blocks = tables.size(1), block_stride = layers * 2 * kh * bs * d;
  const int64_t layer_off = layer * 2 * kh * bs * d, v_off = kh * bs * d;
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const int64_t q_row = q.stride(0);
  const T* kv = cache.data_ptr<T>();
  const int64_t width = max_blocks * bs;
  // each row's first ctx entries are written by pass 1 and read by pass 2; the rest never
  auto scores = at::empty({nd * kh, g, width}, at::dtype(at::kFloat));
  float* sc = scores.data_ptr<float>();
  PhaseClock clock;
  at::parallel_for(0, nd * kh, 1, [&](int64_t begin, int64_t end) {  // pass 1: scaled q.k
    std::vector<float> qf(g * d);
#if !defined(NS_LANES)
    std::vector<float> blk(bs * d);  // the scalar fallback's rows in fp32
#endif
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / kh, hk = i % kh, n = lens[s];
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        qk_heads<d>(qp + s * q_row + hk * g * d, g, kv + layer_off + hk * bs * d, tab + s * max_blocks, block_stride,
                    bs, n, scale, sc + i * g * width, width);
      } else
#endif
      {
        to_float(qp + s * q_row + hk * g * d, qf.data(), g * d);
        for (int64_t x = 0; x < g * d; ++x) qf[x] *= scale;
#if defined(NS_LANES)
        qk_lanes<T, d>(qf.data(), g, kv + layer_off + hk * bs * d, tab + s * max_blocks, block_stride, bs, n,
                       sc + i * g * width, width);
#else
        for (int64_t b = 0; b * bs < n; ++b) {
          const int64_t cnt = std::min(bs, n - b * bs);
          to_float(kv + tab[s * max_blocks + b] * block_stride + layer_off + hk * bs * d, blk.data(), cnt * d);
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qf.data() + j * d;
            float* out = sc + (i * g + j) * width + b * bs;
            for (int64_t t = 0; t < cnt; ++t) {
              const float* k = blk.data() + t * d;
              float dot = 0.f;
#pragma omp simd reduction(+:dot)
              for (int64_t x = 0; x < d; ++x) dot += qj[x] * k[x];
              out[t] = dot;
            }
          }
        }
#endif
      }
    }
  });
  NS_LAP(clock, kDecScores);
  at::parallel_for(0, nd * kh * g, 16, [&](int64_t begin, int64_t end) {  // one row per (sequence, query head)
    for (int64_t r = begin; r < end; ++r) softmax_inplace(sc + r * width, lens[r / (kh * g)]);
  });
  NS_LAP(clock, kDecSoftmax);
  T* op = out.data_ptr<T>();
  at::parallel_for(0, nd * kh, 1, [&](int64_t begin, int64_t end) {  // pass 2: probabilities x V
    std::vector<float> acc(g * d);
#if !defined(NS_LANES)
    std::vector<float> blk(bs * d);
#endif
    std::vector<uint16_t> pb;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / kh, hk = i % kh, n = lens[s];
#if defined(__AVX512BF16__)
      // bf16: pv_pairs (two keys a VDPBF16PS, bf16 probabilities): half the instructions of widening V
      // to fp32 and an FMA per key, which made this pass 2/3 of the kernel
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const int64_t np = n;  // pv_pairs pairs keys within a block, so nothing past n is read
        pb.resize(g * np);
        for (int64_t j = 0; j < g; ++j) {
          const float* pr = sc + (i * g + j) * width;
          int64_t t = 0;
          for (; t + 16 <= n; t += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + j * np + t), bf16_packed(_mm512_loadu_ps(pr + t)));
          for (; t < n; ++t) pb[j * np + t] = c10::BFloat16(pr[t]).x;
        }
        by_head_chunks(g, [&](int64_t j0, auto G) {
          pv_pairs<decltype(G)::value, d>(kv + layer_off + v_off + hk * bs * d, tab + s * max_blocks, block_stride, bs, n,
                               pb.data() + j0 * np, np, acc.data() + j0 * d);
        });
      } else
#endif
      {
#if defined(NS_LANES)
        by_head_chunks(g, [&](int64_t j0, auto G) {
          pv_lanes<T, d, decltype(G)::value>(kv + layer_off + v_off + hk * bs * d, tab + s * max_blocks, block_stride, bs, n,
                                  sc + (i * g + j0) * width, width, acc.data() + j0 * d);
        });
#else
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t b = 0; b * bs < n; ++b) {
          const int64_t cnt = std::min(bs, n - b * bs);
          to_float(kv + tab[s * max_blocks + b] * block_stride + layer_off + v_off + hk * bs * d, blk.data(), cnt * d);
          for (int64_t j = 0; j < g; ++j) {
            const float* p = sc + (i * g + j) * width + b * bs;
            float* aj = acc.data() + j * d;
            for (int64_t t = 0; t < cnt; ++t) {
              const float pt = p[t];
              const float* v = blk.data() + t * d;
#pragma omp simd
              for (int64_t x = 0; x < d; ++x) aj[x] += pt * v[x];
            }
          }
        }
#endif
      }
      T* o = op + (s * h + hk * g) * d;
      for (int64_t x = 0; x < g * d; ++x) o[x] = static_cast<T>(acc[x]);
    }
  });
  NS_LAP(clock, kDecPV);
}

// q's rows may be strided (a view of the fused QKV output: no copy); the result goes to `out` when
// given (contiguous, q's shape; a view of the backend's output), else to a new tensor.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, int64_t layer, at::Tensor tables,
                                     at::Tensor ctx, double scale, c10::optional<at::Tensor> out_) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2));
  TORCH_CHECK(cache.is_contiguous() && tables.is_contiguous() && ctx.is_contiguous());
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && tables.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong);
  TORCH_CHECK(cache.dim() == 6 && cache.size(5) == q.size(2) && q.size(1) % cache.size(3) == 0 &&
              layer >= 0 && layer < cache.size(1) && tables.size(0) == q.size(0) && ctx.size(0) == q.size(0));
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "paged_decode_attention: head_dim 64 or 128 only");
  const at::Tensor out = out_.has_value() ? *out_ : at::empty(q.sizes(), q.options());
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type());
  const bool d64 = q.size(2) == 64;
  switch (q.scalar_type()) {
    case at::kBFloat16: d64 ? decode<c10::BFloat16, 64>(q, out, cache, layer, tables, ctx, scale)
                               : decode<c10::BFloat16, 128>(q, out, cache, layer, tables, ctx, scale); break;
    case at::kHalf: d64 ? decode<c10::Half, 64>(q, out, cache, layer, tables, ctx, scale)
                           : decode<c10::Half, 128>(q, out, cache, layer, tables, ctx, scale); break;
    case at::kFloat: d64 ? decode<float, 64>(q, out, cache, layer, tables, ctx, scale)
                            : decode<float, 128>(q, out, cache, layer, tables, ctx, scale); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype");
  }
  return out;
}

// residual += x in place (rounded to the model dtype, as the eager add), then HF's LlamaRMSNorm of
// it: w * (r / sqrt(mean(r^2) + eps)) rounded to the dtype before the weight. One pass instead of ~8 ops.
template <typename T>
static void add_rms_norm_rows(const T* x, T* res, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    for (int64_t i = begin; i < end; ++i) {
#if defined(__AVX512F__)
      if constexpr (kVec16<T>) {
        if (n % 16 == 0) {
          T* ri = res + i * n;
          __m512 ss = _mm512_setzero_ps();
          for (int64_t c = 0; c < n; c += 16) {
            __m512 v = load16(ri + c);
            if (x != nullptr) {
              v = round16(ri, _mm512_add_ps(v, load16(x + i * n + c)));
              store16(ri + c, v);
            }
            _mm512_storeu_ps(r.data() + c, v);
            ss = _mm512_fmadd_ps(v, v, ss);
          }
          const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
          T* oi = out + i * n;
          for (int64_t c = 0; c < n; c += 16)
            store16(oi + c, _mm512_mul_ps(load16(w + c), round16(oi, _mm512_mul_ps(_mm512_loadu_ps(r.data() + c), inv))));
          continue;
        }
      }
#endif
      T* ri = res + i * n;
      float ss = 0.f;
      if (x != nullptr) {
        const T* xi = x + i * n;
        for (int64_t c = 0; c < n; ++c) {
          const T v = static_cast<T>(static_cast<float>(ri[c]) + static_cast<float>(xi[c]));
          ri[c] = v;
        }
      }
      for (int64_t c = 0; c < n; ++c) { r[c] = static_cast<float>(ri[c]); }
#pragma omp simd reduction(+:ss)
      for (int64_t c = 0; c < n; ++c) ss += r[c] * r[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* oi = out + i * n;
      for (int64_t c = 0; c < n; ++c)
        oi[c] = static_cast<T>(static_cast<float>(w[c]) * static_cast<float>(static_cast<T>(r[c] * inv)));
    }
  });
}

// x may be undefined (no add: just the norm of residual)
at::Tensor add_rms_norm(c10::optional<at::Tensor> x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous() && residual.dim() == 2 &&
              weight.numel() == residual.size(1) && weight.scalar_type() == residual.scalar_type());
  if (x.has_value()) TORCH_CHECK(x->is_contiguous() && x->sizes() == residual.sizes() &&
                                 x->scalar_type() == residual.scalar_type());
  auto out = at::empty_like(residual);
  const int64_t rows = residual.size(0), n = residual.size(1);
  switch (residual.scalar_type()) {
#define NS_CASE(K, T) case K: add_rms_norm_rows<T>(x.has_value() ? x->data_ptr<T>() : nullptr, \
    residual.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), rows, n, static_cast<float>(eps)); break;
    NS_CASE(at::kBFloat16, c10::BFloat16)
    NS_CASE(at::kHalf, c10::Half)
    NS_CASE(at::kFloat, float)
#undef NS_CASE
    default: TORCH_CHECK(false, "add_rms_norm: unsupported dtype");
  }
  return out;
}

// Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, width] (Q and K
// heads, contiguous), with cos/sin [T, d/2]. Every product and sum is rounded to the dtype as the
// eager `x1*cos - x2*sin` would be, so it is bit-exact with the torch path.
template <typename T>
static void rope_rows(T* x, int64_t width, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* sn = sin + t * half;
      for (int64_t j = 0; j < heads; ++j) {
        T* p = x + t * width + j * d;
#if defined(__AVX512F__)
        if constexpr (kVec16<T>) {
          if (half % 16 == 0) {
            for (int64_t i = 0; i < half; i += 16) {
              const __m512 x1 = load16(p + i), x2 = load16(p + i + half), ci = load16(c + i), si = load16(sn + i);
              store16(p + i, _mm512_sub_ps(round16(p, _mm512_mul_ps(x1, ci)), round16(p, _mm512_mul_ps(x2, si))));
              store16(p + i + half, _mm512_add_ps(round16(p, _mm512_mul_ps(x2, ci)), round16(p, _mm512_mul_ps(x1, si))));
            }
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = p[i], x2 = p[i + half], ci = c[i], si = sn[i];
          const float a = static_cast<T>(x1 * ci), b = static_cast<T>(x2 * si);
          const float e = static_cast<T>(x2 * ci), f = static_cast<T>(x1 * si);
          p[i] = static_cast<T>(a - b);
          p[i + half] = static_cast<T>(e + f);
        }
      }
    }
  });
}

void rope_(at::Tensor qkv, int64_t heads, int64_t d, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && qkv.dim() == 2 &&
              heads * d <= qkv.size(1) && cos.numel() == qkv.size(0) * (d / 2) && sin.numel() == cos.numel() &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type());
  switch (qkv.scalar_type()) {
#define NS_CASE(K, T) case K: rope_rows<T>(qkv.data_ptr<T>(), qkv.size(1), cos.data_ptr<T>(), sin.data_ptr<T>(), \
    qkv.size(0), heads, d); break;
    NS_CASE(at::kBFloat16, c10::BFloat16)
    NS_CASE(at::kHalf, c10::Half)
    NS_CASE(at::kFloat, float)
#undef NS_CASE
    default: TORCH_CHECK(false, "rope_: unsupported dtype");
  }
}

// The step's new K and V rows [T, kh, d] (row stride free, heads contiguous) into their cache slots:
// one call instead of two index_put.
void write_kv(at::Tensor k, at::Tensor v, at::Tensor cache, int64_t layer, at::Tensor blocks,
              at::Tensor offsets) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 6 && blocks.is_contiguous() && offsets.is_contiguous() &&
              blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong);
  const int64_t n = k.size(0), kh = cache.size(3), bs = cache.size(4), d = cache.size(5);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == kh && k.size(2) == d && k.stride(2) == 1 && k.stride(1) == d &&
              v.stride(2) == 1 && v.stride(1) == d && blocks.numel() == n && offsets.numel() == n &&
              k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type() &&
              layer >= 0 && layer < cache.size(1));
  const int64_t es = cache.element_size(), row = d * es;
  const int64_t block_stride = cache.size(1) * 2 * kh * bs * d * es, layer_off = layer * 2 * kh * bs * d * es;
  const int64_t v_off = kh * bs * d * es, num_blocks = cache.size(0);
  char* base = static_cast<char*>(cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t* bl = blocks.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(bl[t] >= 0 && bl[t] < num_blocks && of[t] >= 0 && of[t] < bs, "write_kv: slot out of range");
    char* dst = base + bl[t] * block_stride + layer_off + of[t] * row;
    for (int64_t hh = 0; hh < kh; ++hh) {
      std::memcpy(dst + hh * bs * row, kp + (t * k.stride(0) + hh * d) * es, row);
      std::memcpy(dst + v_off + hh * bs * row, vp + (t * v.stride(0) + hh * d) * es, row);
    }
  }
}

// ---- prefill-sized GEMMs split by rows ----------------------------------------------------------
// One oneDNN matmul (a weight prepacked by mkldnn._reorder_linear_weight, epilogue `attr`, times
// `other` when given) with each of the threads computing its own rows against the whole weight, each
// call single-threaded (oneDNN runs serially inside a parallel region). oneDNN's own split of a
// bf16 AMX matmul over 2 threads is ~1.2x one thread's speed at 1024 rows, this one ~1.7x (the
// embedded model's four projections: 3.53 / 2.88 / 2.08 ms, experiment bench/linear_split.py at c256b25). With fewer or
// more rows, and in fp32, oneDNN's split measured faster: the caller (layers/linear.py) decides.
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
using LinearMulFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::string_view);
static const c10::TypedOperatorHandle<LinearFn>& mkldnn_linear() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearFn>();
  return op;
}
static const c10::TypedOperatorHandle<LinearMulFn>& mkldnn_linear_mul() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary").typed<LinearMulFn>();
  return op;
}

at::Tensor linear_rows(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n_out,
                          std::string attr, c10::optional<at::Tensor> other) {
  const auto& linear = mkldnn_linear();
  const auto& linear_mul = mkldnn_linear_mul();
  TORCH_CHECK(x.dim() == 2 && (!other || (other->dim() == 2 && other->size(0) == x.size(0) && other->size(1) == n_out)));
  const int64_t rows = x.size(0), parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  const int64_t per = (rows + parts - 1) / parts;
  at::Tensor out = at::empty({rows, n_out}, x.options());
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the pool's threads need it too
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);
    at::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i * per, n = std::min(per, rows - r0);
      if (n <= 0) continue;
      const at::Tensor xs = x.narrow(0, r0, n);
      out.narrow(0, r0, n).copy_(other ? linear_mul.call(xs, other->narrow(0, r0, n), packed, bias, attr)
                                       : linear.call(xs, packed, bias, attr, c10::List<std::optional<at::Scalar>>(), std::nullopt));
    }
  });
  return out;
}

// ---- prefill attention over the paged cache ----------------------------------------------------
// Flash-style. Phase 1 packs each (sequence, KV head)'s context once, KT keys at a time, from its
// blocks into GEMM-ready tiles (K^T and V; VNNI-packed for AMX): every query tile of that head
// reuses them. Phase 2, per (sequence, KV head, query tile) task: the tile's query rows of the
// whole head group (GQA without repeating K/V) against the packed tiles up to the causal edge,
// online softmax in fp32. Both products are GEMMs: with AMX, bf16 tiles through ATen's brgemm
// (oneDNN's JIT micro-kernels); with AVX512_BF16 but no AMX, bf16 tiles through VDPBF16PS (qk_bf16,
// pv_bf16: 1.79x the fp32 tiles, 2048 tokens, SmolLM2 heads, one thread); elsewhere fp32 through
// ATen's brgemm (tiles converted while packed; oneDNN's AVX2/AVX-512 kernels, or ATen's gemm).
constexpr int64_t KT = 64;  // keys per tile (oneDNN's AMX packing takes at most 64 columns)


template <typename C, typename T> static inline C as(T x) { return static_cast<C>(static_cast<float>(x)); }
template <> inline c10::BFloat16 as<c10::BFloat16, c10::BFloat16>(c10::BFloat16 x) { return x; }
template <> inline float as<float, float>(float x) { return x; }

// One row of scores s[n] (unscaled; n a multiple of 16) -> probabilities p[n] in C, for keys
// [0, valid) (the rest 0); updates the row's running max and sum, returns the factor its accumulator
// must be scaled by.
template <typename C>
static inline float softmax_row(const float* s, C* p, int64_t n, int64_t valid, float scale, float& mx, float& sum) {
  float rmax = mx;
  float rsum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  if constexpr (kVec16<C>) {
    // the max as 16 lanes: a scalar max chain costs its latency per key (~4x the whole exp)
    auto live = [valid](int64_t t) -> __mmask16 {
      return t >= valid ? 0 : t + 16 <= valid ? 0xFFFF : (1u << (valid - t)) - 1;
    };
    // whole vectors of visible keys unmasked; the causal edge's vector and the rest masked
    const int64_t full = std::clamp<int64_t>(valid, 0, n) / 16 * 16;
    __m512 vmax[2] = {_mm512_set1_ps(-std::numeric_limits<float>::infinity()), _mm512_set1_ps(-std::numeric_limits<float>::infinity())};
    for (int64_t u = 0; u < full; u += 16) vmax[u / 16 % 2] = _mm512_max_ps(vmax[u / 16 % 2], _mm512_loadu_ps(s + u));
    if (full < valid) vmax[0] = _mm512_mask_max_ps(vmax[0], live(full), vmax[0], _mm512_loadu_ps(s + full));
    rmax = std::max(rmax, _mm512_reduce_max_ps(_mm512_max_ps(vmax[0], vmax[1])) * scale);  // scale > 0
    // e^(s * scale - max) as 2^x: one FMA to x, then 2^x by exp2_16; two vectors per step (two
    // independent sums, and one VCVTNE2PS2BF16 rounds both to bf16)
    constexpr float log2e = 1.44269504088896341f;
    const __m512 sc = _mm512_set1_ps(scale * log2e), mneg = _mm512_set1_ps(-rmax * log2e);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    auto exp16 = [&](int64_t t) {
      const __m512 e = exp2_16<C>(_mm512_fmadd_ps(_mm512_loadu_ps(s + t), sc, mneg));
      return t >= full ? _mm512_maskz_mov_ps(live(t), e) : e;
    };
    for (; t + 32 <= n; t += 32) {
      const __m512 e0 = exp16(t), e1 = exp16(t + 16);
      acc[0] = _mm512_add_ps(acc[0], e0);
      acc[1] = _mm512_add_ps(acc[1], e1);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<C, c10::BFloat16>) {
        _mm512_storeu_si512(p + t, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
        continue;
      }
#endif
      store16(p + t, e0);
      store16(p + t + 16, e1);
    }
    if (t < n) {  // n is a multiple of 16
      const __m512 e0 = exp16(t);
      acc[0] = _mm512_add_ps(acc[0], e0);
      store16(p + t, e0);
      t = n;
    }
    acc[0] = _mm512_add_ps(acc[0], acc[1]);
    rsum = _mm512_reduce_add_ps(acc[0]);
  }
#endif
  if (t < n)
    for (int64_t u = 0; u < valid; ++u) rmax = std::max(rmax, s[u] * scale);
  for (; t < n; ++t) {
    const float e = t < valid ? exp_neg(s[t] * scale - rmax) : 0.f;
    rsum += e;
    p[t] = as<C>(e);
  }
  const float alpha = mx == rmax ? 1.f : exp_neg(mx - rmax);  // exp(-inf) -> 0 on the first tile
  sum = sum * alpha + rsum;
  mx = rmax;
  return alpha;
}

// T: storage dtype; C: GEMM input dtype (T itself with AMX packing, else float).
// Keys go in tiles of KS: one softmax pass per row and one PV GEMM per tile (K = the tile's keys:
// with AMX a longer accumulation per C tile load/store), QK^T in KT-key GEMMs (the packing limit).
constexpr int64_t KS = 4 * KT;

#if defined(__AVX512BF16__)
// bf16 tiles on AVX512_BF16 without AMX, where ATen's brgemm has no fast bf16 kernel (unpacked bf16
// tiles measured slower than its fp32 GEMM: 66.4 vs 54.7 ms a layer, 2048 tokens, SmolLM2 heads, one
// thread). VDPBF16PS takes pairs: K is packed per 16 keys as [d / 2][16 keys][2 dims] and V as
// [keys / 2][d][2 keys], so one vector op adds two products to 16 fp32 results.
// The micro-kernel of both products: rows [r0, r0 + MR) of C [., NV * 16] (+)= A B over `pairs` pairs,
// A's row r holding its pairs at a + r * lda, B's vector c of pair i at b + i * b_pair + c * b_vec.
// MR x NV accumulators stay in registers for the whole pass; each B vector serves the MR rows.
template <int MR, int NV>
static inline void pair_tile(int64_t r0, int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                             int64_t b_pair, int64_t b_vec, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + (r0 + r) * ldc + v * 16) : _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + i * b_pair + v * b_vec));
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + (r0 + r) * lda + 2 * i, 4);
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + (r0 + r) * ldc + v * 16, acc[r][v]);
}

// rows [0, m) in MR-row passes, then the tail one row at a time (a runtime row bound inside the pass
// kept the accumulators out of registers: PV 19.7 vs 11.3 ms a layer)
template <int MR, int NV>
static inline void pair_rows(int64_t m, int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                             int64_t b_pair, int64_t b_vec, float* c, int64_t ldc, bool accumulate) {
  int64_t r0 = 0;
  for (; r0 + MR <= m; r0 += MR) pair_tile<MR, NV>(r0, pairs, a, lda, b, b_pair, b_vec, c, ldc, accumulate);
  for (; r0 < m; ++r0) pair_tile<1, NV>(r0, pairs, a, lda, b, b_pair, b_vec, c, ldc, accumulate);
}

// sc[r, t] = q[r] . k[t] for rows [0, m), keys [0, kk) (a multiple of 64): 64 keys (four 16-key groups
// of d / 2 pair vectors) a pass
static void qk_bf16(int64_t m, int64_t kk, int64_t d, const c10::BFloat16* qb, const c10::BFloat16* kt,
                    float* sc, int64_t ldc) {
  for (int64_t t0 = 0; t0 < kk; t0 += 64)
    pair_rows<6, 4>(m, d / 2, qb, d, kt + t0 * d, 32, 16 * d, sc + t0, ldc, false);
}

// acc[r, :] += p[r, :kk] V[:kk, :] for rows [0, m), kk even, D = d (64 or 128)
template <int64_t D>
static void pv_bf16(int64_t m, int64_t kk, const c10::BFloat16* pb, int64_t ldp, const c10::BFloat16* vt, float* acc) {
  constexpr int NV = D / 16, MR = NV == 4 ? 6 : 2;  // MR x NV accumulators within the 32 registers
  pair_rows<MR, NV>(m, kk / 2, pb, ldp, vt, 2 * D, 32, acc, D, true);
}
#endif

// Mode: how the tiles are multiplied. Fp32: tiles converted to fp32, ATen's brgemm; Amx: bf16 tiles
// packed for oneDNN's AMX brgemm; Vnni: bf16 tiles in VDPBF16PS pairs, qk_bf16 / pv_bf16 above.
enum class Tiles { Fp32, Amx, Vnni };
template <typename T, typename C, Tiles mode = std::is_same_v<C, float> ? Tiles::Fp32 : Tiles::Amx>
static void prefill(const T* q, int64_t q_row, T* out, const T* kv, int64_t h, int64_t kh, int64_t bs, int64_t d,
                    int64_t block_stride, int64_t layer_off, const int64_t* tab, int64_t max_blocks,
                    const int64_t* start, const int64_t* len, const int64_t* ctx, int64_t seqs, float scale) {
  constexpr bool amx = mode == Tiles::Amx, vnni = mode == Tiles::Vnni;
  constexpr auto dt = c10::CppTypeToScalarType<C>::value;
  const int64_t g = h / kh, qt = std::max<int64_t>(1, 128 / g), v_off = kh * bs * d, tile = KS * d;
  // phase 1: pack. tile0[s]: index of sequence s's first tile; its head hk's tiles follow at hk * ntiles.
  // A tile: K^T as KS / KT blocks [d, KT] (each VNNI-packed with AMX), then V [KS, d] (packed per 64 columns)
  std::vector<int64_t> tile0(seqs + 1, 0);
  for (int64_t s = 0; s < seqs; ++s) tile0[s + 1] = tile0[s] + kh * ((ctx[s] + KS - 1) / KS);
  const at::Tensor kbuf = at::empty({tile0[seqs], tile}, at::dtype(dt));
  const at::Tensor vbuf = at::empty({tile0[seqs], tile}, at::dtype(dt));
  C* kp = kbuf.data_ptr<C>();
  C* vp = vbuf.data_ptr<C>();
  at::parallel_for(0, tile0[seqs], 1, [&](int64_t begin, int64_t end) {
    PhaseClock clock;
    std::vector<C> kt(tile), vt(tile);
    int64_t s = 0;
    for (int64_t i = begin; i < end; ++i) {
      while (tile0[s + 1] <= i) ++s;
      const int64_t nt = (ctx[s] + KS - 1) / KS, hk = (i - tile0[s]) / nt, k0 = (i - tile0[s]) % nt * KS;
      const int64_t cnt = std::min(KS, ctx[s] - k0);
      C* kd = amx ? kt.data() : kp + i * tile;  // K^T blocks and V [KS, d], zero past the end
      C* vd = amx ? vt.data() : vp + i * tile;
      if constexpr (vnni) {  // K [KS / 16][d / 2][16][2], V [KS / 2][d][2]; zero past the end
        for (int64_t t = 0; t < KS; ++t) {
          C* kb = kd + (t / 16 * d / 2 * 16 + t % 16) * 2;
          C* vb = vd + t % 2;
          const int64_t tok = k0 + t;
          const T* kr = t < cnt ? kv + tab[s * max_blocks + tok / bs] * block_stride + layer_off + (hk * bs + tok % bs) * d
                                : nullptr;
          for (int64_t x = 0; x < d; ++x) {
            kb[x / 2 * 32 + x % 2] = kr ? as<C>(kr[x]) : C(0);
            vb[(t / 2 * d + x) * 2] = kr ? as<C>(kr[v_off + x]) : C(0);
          }
        }
        continue;
      }
      for (int64_t t = 0; t < KS; ++t) {
        C* kb = kd + t / KT * KT * d + t % KT;  // column t % KT of block t / KT
        if (t < cnt) {
          const int64_t tok = k0 + t;
          const T* kr = kv + tab[s * max_blocks + tok / bs] * block_stride + layer_off + (hk * bs + tok % bs) * d;
          for (int64_t x = 0; x < d; ++x) { kb[x * KT] = as<C>(kr[x]); vd[t * d + x] = as<C>(kr[v_off + x]); }
        } else {
          for (int64_t x = 0; x < d; ++x) { kb[x * KT] = C(0); vd[t * d + x] = C(0); }
        }
      }
      if constexpr (amx) {
        for (int64_t b = 0; b < KS; b += KT)
          at::native::cpublas::pack(d, KT, KT, KT, dt, dt, kt.data() + b * d, kp + i * tile + b * d);
        for (int64_t c0 = 0; c0 < d; c0 += 64)  // at most 64 columns per packed block
          at::native::cpublas::pack(KS, 64, d, 64, dt, dt, vt.data() + c0, vp + i * tile + c0 * KS);
      }
    }
    NS_LAP(clock, kPack);
  });
  // phase 2: attend
  struct Task { int64_t s, hk, r0, r1, work; };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t r0 = 0; r0 < len[s]; r0 += qt) {
      const int64_t r1 = std::min(len[s], r0 + qt), keys = ctx[s] - len[s] + r1;
      for (int64_t hk = 0; hk < kh; ++hk) tasks.push_back({s, hk, r0, r1, keys * (r1 - r0)});
    }
  // heaviest first, handed out one at a time: causal tiles differ in cost by up to the context/tile ratio
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.work > b.work; });
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    const int64_t mmax = (qt * g + 15) / 16 * 16;
    std::vector<C> qb(mmax * d), pb(mmax * KS);
    std::vector<float> sc(mmax * KS), acc(mmax * d), mx(mmax), sum(mmax);
    std::vector<int64_t> pos(mmax);
    PhaseClock clock;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& w = tasks[i];
      const int64_t off = ctx[w.s] - len[w.s], rows = (w.r1 - w.r0) * g, m = (rows + 15) / 16 * 16;
      for (int64_t r = 0; r < m; ++r) {  // row r: query token r0 + r / g, head hk * g + r % g
        C* dst = qb.data() + r * d;
        if (r < rows) {
          const T* src = q + (start[w.s] + w.r0 + r / g) * q_row + (w.hk * g + r % g) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = as<C>(src[x]);
          pos[r] = off + w.r0 + r / g;
        } else {  // padding rows (to whole AMX tiles): zeros that see every key, output dropped
          std::fill(dst, dst + d, C(0));
          pos[r] = std::numeric_limits<int64_t>::max() / 2;
        }
      }
      std::fill(acc.begin(), acc.begin() + m * d, 0.f);
      std::fill(mx.begin(), mx.begin() + m, -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.begin() + m, 0.f);
      const int64_t nt = (ctx[w.s] + KS - 1) / KS, first = tile0[w.s] + w.hk * nt;
      NS_LAP(clock, kQload);
      for (int64_t j = 0, k0 = 0; k0 < off + w.r1; ++j, k0 += KS) {
        const int64_t cnt = std::min(KS, off + w.r1 - k0), kk = (cnt + KT - 1) / KT * KT;  // keys any row sees
        const C* kt = kp + (first + j) * tile;
        if constexpr (vnni) {
          qk_bf16(m, kk, d, qb.data(), kt, sc.data(), KS);
        } else {
          for (int64_t b = 0; b < kk; b += KT)
            at::native::cpublas::brgemm(m, KT, d, d, KT, KS, false, qb.data(), kt + b * d, sc.data() + b, amx);
        }
        NS_LAP(clock, kQK);
        for (int64_t r = 0; r < m; ++r) {  // keys k0 .. pos[r] are visible to row r (causal)
          const float alpha = softmax_row(sc.data() + r * KS, pb.data() + r * KS, kk, std::min(cnt, pos[r] - k0 + 1),
                                          scale, mx[r], sum[r]);
          if (alpha != 1.f) {
            float* a = acc.data() + r * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) a[x] *= alpha;
          }
        }
        NS_LAP(clock, kSoftmax);
        const C* vt = vp + (first + j) * tile;
        if constexpr (vnni) {
          if (d == 64) pv_bf16<64>(m, kk, pb.data(), KS, vt, acc.data());
          else pv_bf16<128>(m, kk, pb.data(), KS, vt, acc.data());
        } else if constexpr (amx) {  // the first kk rows of each packed column block
          for (int64_t c0 = 0; c0 < d; c0 += 64)
            at::native::cpublas::brgemm(m, 64, kk, KS, 64, d, true, pb.data(), vt + c0 * KS, acc.data() + c0, true);
        } else {
          at::native::cpublas::brgemm(m, d, kk, KS, d, d, true, pb.data(), vt, acc.data(), false);
        }
        NS_LAP(clock, kPV);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + ((start[w.s] + w.r0 + r / g) * h + w.hk * g + r % g) * d;
        const float inv = 1.f / sum[r];
        for (int64_t x = 0; x < d; ++x) o[x] = static_cast<T>(acc[r * d + x] * inv);
      }
      NS_LAP(clock, kStore);
    }
    if constexpr (amx) at::native::cpublas::brgemm_release(true);
  });
}

// q [T, h, d]: the step's prefill rows; sequence i's are q[start[i] : start[i] + len[i]], the last
// len[i] of its ctx[i] tokens, whose K/V (the new ones included) are in the cache at tables[i].
// q's rows may be strided (a view of the fused QKV output: no copy); the result goes to `out`
// (contiguous, q's shape).
void paged_prefill_attention(at::Tensor q, at::Tensor out, at::Tensor cache, int64_t layer, at::Tensor tables,
                                      at::Tensor start, at::Tensor len, at::Tensor ctx, double scale,
                                      bool allow_amx) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2) &&
              out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type());
  TORCH_CHECK(cache.is_contiguous() && tables.is_contiguous() && start.is_contiguous() &&
              len.is_contiguous() && ctx.is_contiguous() && q.dim() == 3 && cache.dim() == 6);
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && tables.scalar_type() == at::kLong &&
              start.scalar_type() == at::kLong && len.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong);
  const int64_t seqs = tables.size(0), h = q.size(1), d = q.size(2), kh = cache.size(3), bs = cache.size(4);
  TORCH_CHECK(cache.size(5) == d && h % kh == 0 && layer >= 0 && layer < cache.size(1) && start.numel() == seqs &&
              len.numel() == seqs && ctx.numel() == seqs);
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* ln = len.data_ptr<int64_t>();
  const int64_t* cx = ctx.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < seqs; ++i) {  // every row and block the kernel will touch is in range
    TORCH_CHECK(ln[i] >= 1 && ln[i] <= cx[i] && st[i] >= 0 && st[i] + ln[i] <= q.size(0) &&
                (cx[i] + bs - 1) / bs <= tables.size(1), "paged_prefill_attention: bad sequence ", i);
    for (int64_t b = 0; b < (cx[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tab[i * tables.size(1) + b] >= 0 && tab[i * tables.size(1) + b] < cache.size(0),
                  "paged_prefill_attention: block out of range");
  }
  const int64_t block_stride = cache.size(1) * 2 * kh * bs * d, layer_off = layer * 2 * kh * bs * d;
#define NS_ARGS(T) q.data_ptr<T>(), q.stride(0), out.data_ptr<T>(), cache.data_ptr<T>(), h, kh, bs, d, block_stride, layer_off, \
    tab, tables.size(1), st, ln, cx, seqs, static_cast<float>(scale)
  switch (q.scalar_type()) {
    case at::kBFloat16:
      if (allow_amx && at::native::cpublas::could_pack(at::kBFloat16)) prefill<c10::BFloat16, c10::BFloat16>(NS_ARGS(c10::BFloat16));
#if defined(__AVX512BF16__)
      else if (allow_amx) prefill<c10::BFloat16, c10::BFloat16, Tiles::Vnni>(NS_ARGS(c10::BFloat16));
#endif
      else prefill<c10::BFloat16, float>(NS_ARGS(c10::BFloat16));
      break;
    case at::kHalf: prefill<c10::Half, float>(NS_ARGS(c10::Half)); break;
    case at::kFloat: prefill<float, float>(NS_ARGS(float)); break;
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype");
  }
#undef NS_ARGS
}

// ---- the decoder layers of a step in one call ----------------------------------------------------
// A step of a small model is as much per-call overhead as math: the Python layer loop cost ~1.2 ms of
// a 4.5 ms batch-1 decode step of the embedded model, all of it on the main thread while the other
// core waited. DecoderStack makes the same calls in the same order (the same kernels, so the same
// bits) as LlamaModel._layers for models whose projections are kept quantized (QuantLinear) or dense
// with oneDNN-packed weights (Linear); LlamaModel.forward takes it where the step qualifies.
struct QuantPart {
  at::Tensor w;
  int64_t qtype, start, rows;  // the kernels' type id; the output columns [start, start + rows) it writes
  QuantLinearFn fn;
};

static QuantLinearFn linear_fn(const py::capsule& c) {
  TORCH_CHECK(c.name() != nullptr && std::strcmp(c.name(), kQuantLinearCapsule) == 0, "not a quant_linear entry point");
  return reinterpret_cast<QuantLinearFn>(c.get_pointer());
}

// One projection as its Python layer computes it: QuantLinear's kernel path (steps within its kernel
// row limit), or Linear's oneDNN call on the packed weight, by rows over the threads (linear_rows)
// where Linear._split would take that
class Projection {
 public:
  // from QuantLinear.kernel_plan(): ([(w, qtype, start, rows, entry)], out_features, bias, glu entry),
  // or Linear.kernel_plan(): (packed, bias, out_features, (split rows from, to, threads) or None)
  explicit Projection(const py::tuple& plan) {
    if (py::isinstance<py::list>(plan[0])) {
      for (const py::handle part : plan[0].cast<py::list>()) {
        const py::tuple t = part.cast<py::tuple>();
        parts_.push_back({t[0].cast<at::Tensor>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
                          linear_fn(t[4].cast<py::capsule>())});
      }
      out_features_ = plan[1].cast<int64_t>();
      if (!plan[2].is_none()) bias_ = plan[2].cast<at::Tensor>();
      if (!plan[3].is_none()) glu_ = linear_fn(plan[3].cast<py::capsule>());
      TORCH_CHECK(!parts_.empty() && (glu_ == nullptr || parts_.size() == 1), "bad projection plan");
    } else {
      packed_ = plan[0].cast<at::Tensor>();
      if (!plan[1].is_none()) bias_ = plan[1].cast<at::Tensor>();
      out_features_ = plan[2].cast<int64_t>();
      if (!plan[3].is_none()) {
        const py::tuple split = plan[3].cast<py::tuple>();
        split_ = {split[0].cast<int64_t>(), split[1].cast<int64_t>(), split[2].cast<int64_t>()};
      }
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (packed_.defined()) return dense(x, "none", nullptr);
    at::Tensor out = at::empty({x.size(0), out_features_}, x.options());
    for (const QuantPart& p : parts_)
      p.fn(x, p.w, p.qtype, parts_.size() == 1 ? out : out.narrow(1, p.start, p.rows));
    return bias_ ? out.add_(*bias_) : out;
  }
  // QuantLinear.silu_mul: silu(gate) * up of a [gate; up] projection
  at::Tensor silu_mul(const at::Tensor& x) const {
    if (glu_ == nullptr) {
      const std::vector<at::Tensor> gate_up = (*this)(x).chunk(2, -1);
      return at::silu(gate_up[0]) * gate_up[1];
    }
    at::Tensor out = at::empty({x.size(0), out_features_ / 2}, x.options());
    glu_(x, parts_[0].w, parts_[0].qtype, out);
    return out;
  }
  // Linear.silu and Linear.times (dense only: oneDNN's epilogues)
  at::Tensor silu(const at::Tensor& x) const { return dense(x, "swish", nullptr); }
  at::Tensor times(const at::Tensor& x, const at::Tensor& other) const { return dense(x, "mul", &other); }

 private:
  at::Tensor dense(const at::Tensor& x, const char* attr, const at::Tensor* other) const {
    TORCH_CHECK(packed_.defined(), "a quantized projection has no oneDNN epilogue");
    const int64_t rows = x.size(0);
    if (split_[2] && rows >= split_[0] && rows < split_[1] && at::get_num_threads() == split_[2])
      return linear_rows(x, packed_, bias_, out_features_, attr, other ? c10::optional<at::Tensor>(*other) : c10::nullopt);
    if (other) return mkldnn_linear_mul().call(x, *other, packed_, bias_, attr);
    return mkldnn_linear().call(x, packed_, bias_, attr, c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  }

  std::vector<QuantPart> parts_;
  at::Tensor packed_;  // defined: dense
  c10::optional<at::Tensor> bias_;
  int64_t out_features_ = 0;
  QuantLinearFn glu_ = nullptr;  // silu(gate) * up in one call, where the layer's kernel fuses it
  std::array<int64_t, 3> split_{0, 0, 0};  // rows [from, to) on this many threads go through linear_rows
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;  // dense layers: gate_up is the gate alone, up its partner
  c10::optional<Projection> up;
};

class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  // gate_up: a [gate; up] projection (up None), or the gate alone with its oneDNN partner `up`
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, py::tuple qkv, py::tuple o, py::tuple gate_up,
                 c10::optional<py::tuple> up, py::tuple down) {
    layers_.push_back({input_norm, post_norm, Projection(qkv), Projection(o), Projection(gate_up), Projection(down),
                       up ? c10::optional<Projection>(Projection(*up)) : c10::nullopt});
  }

  // residual: the embedded tokens [T, hidden], updated in place to the last layer's output (the
  // caller's final norm reads it). The attention arguments are TorchAttention's of this step:
  // decodes (the first num_decodes tokens) and prefill chunks (`prefill`: tables, starts, lens, ctxs)
  at::Tensor forward(at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor cache, at::Tensor slot_blocks,
                     at::Tensor slot_offsets, int64_t num_decodes, c10::optional<at::Tensor> dec_table,
                     c10::optional<at::Tensor> dec_ctx, c10::optional<std::vector<at::Tensor>> prefill, double scale,
                     bool amx) {
    const int64_t T = residual.size(0), h = heads_, hk = kv_heads_, d = head_dim_, nd = num_decodes;
    TORCH_CHECK(cache.size(1) == static_cast<int64_t>(layers_.size()) && (nd == 0 || (dec_table && dec_ctx)) &&
                (nd == T || (prefill && prefill->size() == 4)), "decoder stack: step arguments do not match");
    c10::optional<at::Tensor> delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& L = layers_[i];
      const at::Tensor x = add_rms_norm(delta, residual, L.input_norm, eps_);
      const at::Tensor qkv = L.qkv(x);
      rope_(qkv, h + hk, d, cos, sin);
      const at::Tensor q = qkv.narrow(1, 0, h * d).view({T, h, d});
      const at::Tensor k = qkv.narrow(1, h * d, hk * d).view({T, hk, d});
      const at::Tensor v = qkv.narrow(1, (h + hk) * d, hk * d).view({T, hk, d});
      const at::Tensor o = at::empty(q.sizes(), q.options());
      write_kv(k, v, cache, i, slot_blocks, slot_offsets);
      if (nd) paged_decode_attention(q.narrow(0, 0, nd), cache, i, *dec_table, *dec_ctx, scale, o.narrow(0, 0, nd));
      if (nd < T) {
        const std::vector<at::Tensor>& p = *prefill;
        paged_prefill_attention(q.narrow(0, nd, T - nd), o.narrow(0, nd, T - nd), cache, i, p[0], p[1], p[2], p[3],
                                scale, amx);
      }
      const at::Tensor x2 = add_rms_norm(L.o(o.view({T, h * d})), residual, L.post_norm, eps_);
      delta = L.down(L.up ? L.up->times(x2, L.gate_up.silu(x2)) : L.gate_up.silu_mul(x2));
    }
    if (delta) residual.add_(*delta);
    return residual;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<StackLayer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(NS_PHASE_TIMES)
  m.def("phase_times", []() {  // {phase: seconds} since the last call, summed over threads
    std::map<std::string, double> r;
    const char* names[kPhases] = {"pack K/V", "load Q", "QK^T GEMM", "softmax", "PV GEMM", "store O",
                                  "decode q.k", "decode softmax", "decode p.V"};
    for (int p = 0; p < kPhases; ++p) r[names[p]] = phase_ns[p].exchange(0) * 1e-9;
    return r;
  });
#endif
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("amx", []() { return at::native::cpublas::could_pack(at::kBFloat16); });
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("cache"), py::arg("layer"),
        py::arg("tables"), py::arg("ctx"), py::arg("scale"), py::arg("out") = py::none());
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_", &rope_);
  m.def("write_kv", &write_kv);
  m.def("linear_rows", &linear_rows);
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("eps"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
#if defined(__AVX512F__)
  m.attr("vectorized") = true;   // the norm and RoPE kernels run 16 lanes at a time (bf16, fp32)
#else
  m.attr("vectorized") = false;  // element by element: only worth it on decode-sized batches
#endif
}
