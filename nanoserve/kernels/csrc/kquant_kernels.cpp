// GGUF K-quant weights (Q4_K, Q6_K: the types of the usual Q4_K_M files) computed on directly, built
// on first use by nanoserve/kernels/cpu_kernels.py (-march=native unless NANOSERVE_CPU_MARCH says
// otherwise). Same interface and contract as quant_kernels.cpp, for 256-weight super-blocks:
//
// Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks of 32), 128
//   bytes of nibbles (bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c+1 in the high ones);
//   w = (d*sc)*q - dmin*m, each product and the difference rounded to fp32 (no FMA), as gguf does.
// Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per
//   16 weights), fp16 d; w = (d*scale) * (q - 32).
//
// Two layouts, as quant_kernels.cpp. The GGUF blocks as they are (AVX2 and scalar builds, and the
// reference): each super-block is dequantized in registers with exactly that arithmetic, one vector
// at a time, and FMA-ed against x in fp32 (bf16 x is widened once per call): a product differs from
// "dequantize, then matmul in fp32" only in summation order, whatever the output dtype (it is rounded
// to once, at the end). And on AVX-512 the packed layout (see PACKED): 16 rows interleaved, bf16 x as
// int8 on vpdpbusd where the CPU has VNNI. A row's result depends only on its own x row (batch
// invariance). Code paths by compiler flags: AVX-512, else AVX2 + FMA + F16C, else scalar.
#include <ATen/ATen.h>  // not torch/extension.h: see quant_kernels.cpp
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#include "simd_math.h"
#include "linear_entry.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 256;  // weights per super-block
enum QType : int64_t { Q4_K = 12, Q6_K = 14 };  // GGML's type ids

template <int QT> constexpr int64_t block_bytes() { return QT == Q4_K ? 144 : 210; }

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Q4_K sub-block j's (d * scale, dmin * min), as gguf's get_scale_min unpacks the 12 bytes
inline void q4k_scale_min(const uint8_t* b, int j, float& dsc, float& dm) {
  const uint8_t* s = b + 4;
  int sc, m;
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
  dsc = h2f(b) * static_cast<float>(sc);
  dm = h2f(b + 2) * static_cast<float>(m);
}

#if defined(__AVX2__) && defined(__F16C__)
// All 8 of Q4_K's (d * scale) and (dmin * min) at once: the 12 bytes unpacked with 32-bit masks (as
// llama.cpp does) into 8 scale bytes then 8 min bytes, widened and multiplied in one vector each
inline void q4k_scales_mins(const uint8_t* b, float* dsc, float* dm) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);  // mins 4-7
  const uint32_t mins_lo = u[1] & m6;                     // mins 0-3
  u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);         // scales 4-7
  u[2] = mins_lo;
  u[0] &= m6;                                             // scales 0-3
  const __m128i v = _mm_loadu_si128((const __m128i*)u);
  _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(h2f(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
  _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(h2f(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
}
#endif

// Q6_K weight e's 6-bit value minus 32 (the llama.cpp layout gguf's reshapes spell out)
inline int q6k_value(const uint8_t* b, int e) {
  const int h = e / 128, r = e % 128;
  const int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 15;
  const int hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
  return (lo | (hi << 4)) - 32;
}

inline float q6k_scale(const uint8_t* b, int g) {  // d * scale of weights 16g..16g+15
  return h2f(b + 208) * static_cast<float>(static_cast<int8_t>(b[192 + g]));
}

// ---- one super-block -> fp32 vectors, in order, per instruction set: f(i, v) gets weights
// [i*W, (i+1)*W) -------------------------------------------------------------------------------------
#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int W = 16, TILE = 8;  // lanes; x rows per pass (2 accumulators each: 16 zmm)
  static const char* name() { return "avx512"; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // rounded to nearest even as c10's conversions round (the dequantized values are never subnormal)
  static void store(c10::Half* p, V v) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(c10::BFloat16* p, V v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i b = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));  // NaN as c10's
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  template <int QT, typename F> static void superblock(const uint8_t* b, F&& f) {
    if constexpr (QT == Q4_K) {
      // a sub-block's 32 weights take one of 16 values: compute them (the reference's arithmetic)
      // and look each weight up by its nibble (vpermps reads the low 4 bits of each lane)
      const V lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      alignas(32) float dsc[8], dm[8];
      q4k_scales_mins(b, dsc, dm);
#pragma GCC unroll 4  // constant vector indices: each accumulator stays in its register
      for (int c = 0; c < 4; ++c) {
        const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 + 32 * c)));
        const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 + 32 * c + 16)));
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
          const V t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dsc[j]), lanes), _mm512_set1_ps(dm[j]));
          f(4 * c + 2 * h, _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q0, 4) : q0, t));
          f(4 * c + 2 * h + 1, _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q1, 4) : q1, t));
        }
      }
    } else {
      // d * scale of each 16 weights, one lane each (the reference's fp32 products)
      alignas(64) float dsc[16];
      _mm512_store_ps(dsc, _mm512_mul_ps(_mm512_set1_ps(h2f(b + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192))))));
      const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
      alignas(64) int8_t q[QK];  // the 6-bit values minus 32, widened from memory below (no lane extracts)
      for (int h = 0; h < 2; ++h) {
        // 128 weights as bytes: r < 64 take the low nibbles of ql, r >= 64 the high ones; the 2 high
        // bits are qh's bits 0-1, 2-3, 4-5, 6-7 for r in quarters (16-bit shifts leak bits across
        // bytes only above the ones masked)
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
        const __m512i qhx = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        _mm512_store_si512(q + 128 * h, _mm512_sub_epi8(
            _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qhx, m3), 4)), k32));
        _mm512_store_si512(q + 128 * h + 64, _mm512_sub_epi8(
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhx, 4), m3), 4)), k32));
      }
#pragma GCC unroll 16  // constant vector indices: each accumulator stays in its register
      for (int i = 0; i < QK / W; ++i)
        f(i, _mm512_mul_ps(_mm512_set1_ps(dsc[i]),
                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(q + 16 * i))))));
    }
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Simd {
  using V = __m256;
  static constexpr int W = 8, TILE = 4;  // 2 accumulators per x row: 8 of the 16 ymm
  static const char* name() { return "avx2"; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store(c10::Half* p, V v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(c10::BFloat16* p, V v) {  // nearest even, NaN as c10's
    const __m256i b = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                     _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  template <int QT, typename F> static void superblock(const uint8_t* b, F&& f) {
    if constexpr (QT == Q4_K) {
      alignas(32) float dsc[8], dm[8];
      q4k_scales_mins(b, dsc, dm);
#pragma GCC unroll 8  // constant vector indices: each accumulator stays in its register
      for (int j = 0; j < 8; ++j) {
        const V vd = _mm256_set1_ps(dsc[j]), vm = _mm256_set1_ps(dm[j]);
        const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m256i q = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + 16 + 32 * (j / 2) + 8 * k), shift),
                                             _mm256_set1_epi32(15));
          const V w = _mm256_sub_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(q)), vm);
          f(4 * j + k, w);
        }
      }
    } else {
#pragma GCC unroll 32
      for (int i = 0; i < QK / W; ++i) {
        const int h = i / 16, r = 8 * (i % 16);
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + h * 64 + r % 64), _mm_cvtsi32_si128(4 * (r / 64))),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + 128 + h * 32 + r % 32), _mm_cvtsi32_si128(2 * (r / 32))),
                                            _mm256_set1_epi32(3));
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        const V w = _mm256_mul_ps(_mm256_set1_ps(q6k_scale(b, i / 2)), _mm256_cvtepi32_ps(q));
        f(i, w);
      }
    }
  }
};
#else
struct Simd {
  using V = float;
  static constexpr int W = 1, TILE = 4;
  static const char* name() { return "scalar"; }
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  template <typename O> static void store(O* p, V v) { *p = static_cast<O>(v); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static float sum(V v) { return v; }
  template <int QT, typename F> static void superblock(const uint8_t* b, F&& f) {
    for (int j = 0; j < QK / 32; ++j) {
      float dsc = 0.f, dm = 0.f;
      if constexpr (QT == Q4_K) q4k_scale_min(b, j, dsc, dm);
      for (int i = 32 * j; i < 32 * j + 32; ++i) {
        float w;
        if constexpr (QT == Q4_K) {
          w = dsc * static_cast<float>((b[16 + 32 * (j / 2) + i % 32] >> (4 * (j % 2))) & 15) - dm;
        } else {
          w = q6k_scale(b, i / 16) * static_cast<float>(q6k_value(b, i));
        }
        f(i, w);
      }
    }
  }
};
#endif

using V = Simd::V;
constexpr int NA = 2;  // accumulators per x row (alternating vectors), so consecutive FMAs do not wait

// res[t] = dot(weight row, x row t) for NT rows of x: each super-block is dequantized once per NT rows.
// A row's sequence of operations is the same whatever NT is (batch invariance).
template <int QT, int NT>
inline void dot_rows(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, float* res) {
  V acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = Simd::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    Simd::superblock<QT>(wrow + b * block_bytes<QT>(), [&](int i, V w) {
      for (int t = 0; t < NT; ++t) acc[t][i % NA] = Simd::fma(w, Simd::load(xb + t * ldx + i * Simd::W), acc[t][i % NA]);
    });
  }
  for (int t = 0; t < NT; ++t) res[t] = Simd::sum(Simd::add(acc[t][0], acc[t][1]));
}

template <int QT, int NT>
inline void tile(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, int64_t nt, float* res) {
  if constexpr (NT > 1) {
    if (nt < NT) return tile<QT, NT - 1>(wrow, nb, x, ldx, nt, res);
  }
  dot_rows<QT, NT>(wrow, nb, x, ldx, res);
}

template <int QT, typename O>
void linear_impl(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t ldw, O* out, int64_t ldo) {
  const int64_t nb = K / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float res[Simd::TILE];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = w + n * ldw;
      for (int64_t t0 = 0; t0 < T; t0 += Simd::TILE) {
        const int64_t nt = std::min<int64_t>(Simd::TILE, T - t0);
        tile<QT, Simd::TILE>(wrow, nb, x + t0 * K, K, nt, res);
        for (int64_t t = 0; t < nt; ++t) out[(t0 + t) * ldo + n] = static_cast<O>(res[t]);
      }
    }
  });
}

template <int QT, typename O>
void dequant_impl(const uint8_t* w, int64_t N, int64_t K, int64_t ldw, O* out, int64_t ldo) {
  const int64_t nb = K / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        O* ob = out + n * ldo + b * QK;
        Simd::superblock<QT>(w + n * ldw + b * block_bytes<QT>(), [&](int i, V v) { Simd::store(ob + i * Simd::W, v); });
      }
    }
  });
}

// ---- the packed layout (AVX-512 builds): 16 rows interleaved ---------------------------------------
// As quant_kernels.cpp's PACKED: one 64-byte vector holds four consecutive quant bytes of each of 16
// rows (qs_index), so a GEMV needs no horizontal sums and vpdpbusd multiplies 16 rows at once. Per
// group of 16 rows and super-block (rows padded to a multiple of 16 with zero blocks):
//   Q4_K (2368 bytes = 16 x 148, 0.578 bytes a weight): d[16] fp16 | dmin[16] fp16 | sc[8][16] |
//     m[8][16] (the 6-bit scales and mins unpacked, a byte each, sub-block-major) | qs[32][16][4]
//     with qs[c][r][i] = byte 4c+i of row r's 128 nibble bytes (the GGUF nibble order: byte 32p+k
//     holds weight 64p+k in its low nibble, 64p+32+k in its high one)
//   Q6_K (3360 bytes = 16 x 210, as GGUF: 0.820 bytes a weight): d[16] fp16 | sc[16][16] int8 |
//     per 32 weights a: ql[4][16][4] | qh[2][16][4]: ql byte (c, r, i) holds the low 4 bits of weight
//     32a+4c+i (low nibble) and 32a+16+4c+i (high nibble); qh byte (h, r, i) the high 2 bits of
//     32a+8h+i, 32a+16+8h+i, 32a+8h+4+i, 32a+16+8h+4+i in bits 0-1, 2-3, 4-5, 6-7
// Two ways to compute, as in quant_kernels.cpp, by the activations' dtype:
// - fp32: exact products in FMAs; Q4_K: per sub-block (d sc) * sum(q x) - (dmin m) * sum(x), Q6_K:
//   per 16 weights (d sc) * sum((q - 32) x): the reference's value up to fp32 rounding and order;
// - bf16 (AVX512_VNNI): each 32-activation block rounded to int8 with its own scale (absmax / 127,
//   round to nearest even: at most absmax / 254 off an element, exactly quant_kernels.cpp's rounding),
//   integer dot products per sub-block (Q4_K: 32 weights) or per 16 weights (Q6_K: q - 32 via the
//   block's int8 sum, times the int8 scale, exact in int32), then fp32 scaling in a fixed order.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t PACKED = 256;  // qtype | PACKED names a packed matrix
constexpr int G = 16;            // rows per group
constexpr int XB = 32;           // activations per int8 block
template <int QT> constexpr int64_t packed_bytes() { return QT == Q4_K ? 2368 : 3360; }
constexpr int qs_index(int j, int r) { return (j / 4) * 64 + r * 4 + (j % 4); }
constexpr int Q6_QL = 288, Q6_A = 384;  // Q6_K: where the quants start; bytes per 32 weights
// Q6_K: a super-block's 256 6-bit values (0..63), as q6k_value reads them, 32 bytes of each at a time
inline void q6_values(const uint8_t* b, uint8_t* q) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t *ql = b + 64 * h + l, qh = b[128 + 32 * h + l];
      q[128 * h + l] = (ql[0] & 15) | ((qh & 3) << 4);
      q[128 * h + l + 32] = (ql[32] & 15) | (((qh >> 2) & 3) << 4);
      q[128 * h + l + 64] = (ql[0] >> 4) | (((qh >> 4) & 3) << 4);
      q[128 * h + l + 96] = (ql[32] >> 4) | (((qh >> 6) & 3) << 4);
    }
}

// row r's GGUF super-block -> its place in a packed group's super-block, and back
template <int QT>
void pack_superblock(const uint8_t* b, int r, uint8_t* p) {
  if constexpr (QT == Q4_K) {
    std::memcpy(p + 2 * r, b, 2);
    std::memcpy(p + 32 + 2 * r, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* s = b + 4;
      p[64 + 16 * j + r] = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
      p[192 + 16 * j + r] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
    for (int c = 0; c < 32; ++c) std::memcpy(p + 320 + qs_index(4 * c, r), b + 16 + 4 * c, 4);
  } else {
    std::memcpy(p + 2 * r, b + 208, 2);
    for (int g = 0; g < 16; ++g) p[32 + 16 * g + r] = b[192 + g];
    uint8_t q[QK];
    q6_values(b, q);
    for (int a = 0; a < 8; ++a) {
      uint8_t* blk = p + Q6_QL + Q6_A * a;
      const uint8_t* qa = q + 32 * a;
      for (int k = 0; k < 16; ++k) blk[qs_index(k, r)] = (qa[k] & 15) | ((qa[k + 16] & 15) << 4);
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i)
          blk[256 + 64 * h + 4 * r + i] = (qa[8 * h + i] >> 4) | (qa[16 + 8 * h + i] >> 4 << 2) |
                                          (qa[8 * h + 4 + i] >> 4 << 4) | (qa[16 + 8 * h + 4 + i] >> 4 << 6);
    }
  }
}

template <int QT>
void unpack_superblock(const uint8_t* p, int r, uint8_t* b) {
  std::memset(b, 0, block_bytes<QT>());
  if constexpr (QT == Q4_K) {
    std::memcpy(b, p + 2 * r, 2);
    std::memcpy(b + 2, p + 32 + 2 * r, 2);
    uint8_t sc[8], m[8], *s = b + 4;
    for (int j = 0; j < 8; ++j) sc[j] = p[64 + 16 * j + r], m[j] = p[192 + 16 * j + r];
    for (int j = 0; j < 4; ++j) {  // get_scale_min's packing, inverted: all 96 bits are used
      s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
      s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
      s[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    for (int c = 0; c < 32; ++c) std::memcpy(b + 16 + 4 * c, p + 320 + qs_index(4 * c, r), 4);
  } else {
    std::memcpy(b + 208, p + 2 * r, 2);
    for (int g = 0; g < 16; ++g) b[192 + g] = p[32 + 16 * g + r];
    uint8_t q[QK];
    for (int a = 0; a < 8; ++a) {
      const uint8_t* blk = p + Q6_QL + Q6_A * a;
      for (int k = 0; k < 32; ++k) {
        const int h = (k % 16) / 8, shift = 4 * ((k % 8) / 4) + 2 * (k / 16);
        q[32 * a + k] = ((blk[qs_index(k % 16, r)] >> (4 * (k / 16))) & 15) | (((blk[256 + 64 * h + 4 * r + k % 4] >> shift) & 3) << 4);
      }
    }
    for (int h = 0; h < 2; ++h)  // GGUF's order (q6k_value), byte by byte
      for (int l = 0; l < 32; ++l) {
        const uint8_t* qh = q + 128 * h + l;
        b[64 * h + l] = (qh[0] & 15) | ((qh[64] & 15) << 4);
        b[64 * h + l + 32] = (qh[32] & 15) | ((qh[96] & 15) << 4);
        b[128 + 32 * h + l] = (qh[0] >> 4) | (qh[32] >> 4 << 2) | (qh[64] >> 4 << 4) | (qh[96] >> 4 << 6);
      }
  }
}

template <int QT>
void pack_impl(const uint8_t* w, int64_t N, int64_t nb, uint8_t* out) {
  constexpr int64_t pb = packed_bytes<QT>(), bb = block_bytes<QT>();
  at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t s = 0; s < nb; ++s) {
        uint8_t* dst = out + (g * nb + s) * pb;
        std::memset(dst, 0, pb);
        for (int r = 0; r < G && g * G + r < N; ++r) pack_superblock<QT>(w + (g * G + r) * nb * bb + s * bb, r, dst);
      }
  });
}

// Activations as the packed kernels read them, per x row: fp32 values and each 32-block's sum (Q4_K's
// min term), or (int8) each 32-block rounded to int8, its scale, the block's sum as the int8 values
// give it (Q4_K) and 32 * the int8 sums of its two halves (Q6_K); a row's values depend on that row
// alone (batch invariance)
struct PackedX {
  const float* f = nullptr;
  std::vector<float> fbuf, scale;
  std::unique_ptr<int8_t[]> q;
  std::vector<float> sum;      // [T * K / 32] fp32 x: the block's sum; int8: scale * the int8 values' sum
  std::vector<int32_t> qsum;  // [T * K / 16] 32 * the int8 values' sum of each 16 (Q6_K's offset)
  int64_t K = 0;
  bool int8 = false;
};

PackedX prepare_x(const at::Tensor& x, bool int8) {
  PackedX p;
  const int64_t T = x.size(0), K = x.size(1), nb = K / XB;
  p.K = K;
  p.int8 = int8;
  p.sum.resize(T * nb);
  if (!int8) {
    if (x.scalar_type() == at::kFloat) {
      p.f = x.data_ptr<float>();
    } else {
      p.fbuf.resize(T * K);
      const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < T * K; ++i) p.fbuf[i] = static_cast<float>(xb[i]);
      p.f = p.fbuf.data();
    }
    for (int64_t i = 0; i < T * nb; ++i) {
      float s = 0.f;
      for (int k = 0; k < XB; ++k) s += p.f[i * XB + k];
      p.sum[i] = s;
    }
    return p;
  }
  p.q.reset(new int8_t[T * K]);  // every byte written below
  p.qsum.resize(T * K / 16);
  p.scale.resize(T * nb);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {  // rows in parallel, as quant_kernels.cpp
    for (int64_t i = t0 * nb; i < t1 * nb; ++i) {  // quant_kernels.cpp's rounding (quantize_block32)
      int32_t s[2];
      p.scale[i] = quantize_block32(xp + i * XB, p.q.get() + i * XB, s);
      p.sum[i] = p.scale[i] * static_cast<float>(s[0] + s[1]);
      p.qsum[2 * i] = 32 * s[0];
      p.qsum[2 * i + 1] = 32 * s[1];
    }
  });
  return p;
}

inline __m512 load_h(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m512i load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }

// Q6_K: the 6-bit values of 32a+4c+i (lo) and 32a+16+4c+i (hi) of 16 rows, a byte each
inline void q6_bytes(const uint8_t* blk, int c, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i ql = _mm512_loadu_si512(blk + 64 * c), qh = _mm512_loadu_si512(blk + 256 + 64 * (c / 2));
  // the high bits moved to bits 4-5, the rest cleared
#if defined(__GFNI__)
  // one affine map a byte: output bit i is the parity of (matrix byte 7-i & input), so bits 4 and 5
  // take input bits s and s+1
  auto bits45 = [&](int s) {
    return _mm512_gf2p8affine_epi64_epi8(qh, _mm512_set1_epi64((int64_t{1} << s << 24) | (int64_t{2} << s << 16)), 0);
  };
  const __m512i hlo = bits45(4 * (c % 2)), hhi = bits45(4 * (c % 2) + 2);
  (void)m30;
#else  // 16-bit shifts: the bits kept come from the same byte
  const __m512i hlo = _mm512_and_si512(c % 2 ? qh : _mm512_slli_epi16(qh, 4), m30);
  const __m512i hhi = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(qh, 2) : _mm512_slli_epi16(qh, 2), m30);
#endif
  lo = _mm512_ternarylogic_epi32(ql, hlo, m4, 0xE4);  // m4 ? ql : h, bit by bit
  hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hhi, m4, 0xE4);
}

// out[i, :] = weight row rows[i] (all rows when null) of a packed matrix, the reference's values bit
// for bit. Row lookups: each super-block back in GGUF form, then the block layout's dequantization. A
// whole matrix (prefill GEMMs): a group at a time, the 16 rows' quants moved back to row order (4
// bytes a row a vector) and scaled with Simd::superblock's arithmetic: Q4_K (d sc) * q - (dmin m) by
// a 16-value table, Q6_K (d sc) * (q - 32)
template <int QT, typename O>
void dequant_packed_impl(const uint8_t* w, int64_t ldw, const int64_t* rows, int64_t n_out, int64_t K, O* out, int64_t ldo) {
  const int64_t nb = K / QK;
  if (rows) {
    at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
      alignas(64) uint8_t blk[block_bytes<QT>()];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = rows ? rows[i] : i;
        for (int64_t s = 0; s < nb; ++s) {
          unpack_superblock<QT>(w + n / G * ldw + s * packed_bytes<QT>(), static_cast<int>(n % G), blk);
          O* ob = out + i * ldo + s * QK;
          Simd::superblock<QT>(blk, [&](int j, V v) { Simd::store(ob + j * Simd::W, v); });
        }
      }
    });
    return;
  }
  at::parallel_for(0, (n_out + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t q[G][QK], tmp[2][64];
    alignas(64) float d[G], dmin[G];
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = begin; g < end; ++g) {
      const int nr = static_cast<int>(std::min<int64_t>(G, n_out - g * G));
      for (int64_t s = 0; s < nb; ++s) {
        const uint8_t* p = w + g * ldw + s * packed_bytes<QT>();
        _mm512_store_ps(d, load_h(p));
        if constexpr (QT == Q4_K) {  // q[r] = row r's 128 nibble bytes
          _mm512_store_ps(dmin, load_h(p + 32));
          for (int c = 0; c < 32; ++c)
            for (int r = 0; r < G; ++r) std::memcpy(&q[r][4 * c], p + 320 + 64 * c + 4 * r, 4);
          for (int r = 0; r < nr; ++r) {
            O* ob = out + (g * G + r) * ldo + s * QK;
            for (int j = 0; j < 8; ++j) {
              const float dsc = d[r] * static_cast<float>(p[64 + 16 * j + r]), dm = dmin[r] * static_cast<float>(p[192 + 16 * j + r]);
              const __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dsc), lanes), _mm512_set1_ps(dm));
              for (int h = 0; h < 2; ++h) {
                const __m512i nib = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)&q[r][32 * (j / 2) + 16 * h]));
                Simd::store(ob + 32 * j + 16 * h, _mm512_permutexvar_ps(j % 2 ? _mm512_srli_epi32(nib, 4) : nib, t));
              }
            }
          }
          continue;
        }
        for (int a = 0; a < 8; ++a)
          for (int c = 0; c < 4; ++c) {
            __m512i lo, hi;
            q6_bytes(p + Q6_QL + Q6_A * a, c, lo, hi);
            _mm512_store_si512(tmp[0], lo);
            _mm512_store_si512(tmp[1], hi);
            for (int r = 0; r < G; ++r) {
              std::memcpy(&q[r][32 * a + 4 * c], tmp[0] + 4 * r, 4);
              std::memcpy(&q[r][32 * a + 16 + 4 * c], tmp[1] + 4 * r, 4);
            }
          }
        for (int r = 0; r < nr; ++r) {
          O* ob = out + (g * G + r) * ldo + s * QK;
          for (int k = 0; k < 16; ++k) {
            const float dsc = d[r] * static_cast<float>(static_cast<int8_t>(p[32 + 16 * k + r]));
            const __m512i qv = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)&q[r][16 * k])), _mm512_set1_epi32(32));
            Simd::store(ob + 16 * k, _mm512_mul_ps(_mm512_set1_ps(dsc), _mm512_cvtepi32_ps(qv)));
          }
        }
      }
    }
  });
}

#if defined(__AVX512VNNI__)
// one group of 16 rows against NT int8 x rows; integer sums per sub-block are exact (their order and
// NA, the chains per row, are free), the fp32 steps per row fixed
template <int QT, int NT>
inline void group_int8(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  constexpr int NA = NT <= 2 ? 2 : 1;
  const int64_t K = x.K, nsb = K / QK;
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  auto xd = [&](int t, int64_t k) {  // four int8 activations k..k+3, broadcast
    int32_t v;
    std::memcpy(&v, x.q.get() + (t0 + t) * K + k, 4);
    return _mm512_set1_epi32(v);
  };
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * packed_bytes<QT>();
    const __m512 d = load_h(p);
    if constexpr (QT == Q4_K) {
      const __m512 dmin = load_h(p + 32);
      const __m512i m4 = _mm512_set1_epi8(0x0F);
      for (int pp = 0; pp < 4; ++pp) {
        __m512i acc[NT][2][NA];
        for (int t = 0; t < NT; ++t)
          for (int a = 0; a < NA; ++a) acc[t][0][a] = acc[t][1][a] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
          const __m512i wv = _mm512_loadu_si512(p + 320 + (8 * pp + v) * 64);
          const __m512i lo = _mm512_and_si512(wv, m4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
          for (int t = 0; t < NT; ++t) {
            const int64_t k = s * QK + 64 * pp + 4 * v;
            acc[t][0][v % NA] = _mm512_dpbusd_epi32(acc[t][0][v % NA], lo, xd(t, k));
            acc[t][1][v % NA] = _mm512_dpbusd_epi32(acc[t][1][v % NA], hi, xd(t, k + 32));
          }
        }
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * pp + h;
          const __m512 dsc = _mm512_mul_ps(d, load_u8(p + 64 + 16 * j)), dm = _mm512_mul_ps(dmin, load_u8(p + 192 + 16 * j));
          for (int t = 0; t < NT; ++t) {
            const int64_t xi = (t0 + t) * (K / XB) + s * 8 + j;
            __m512i dot = acc[t][h][0];
            if constexpr (NA == 2) dot = _mm512_add_epi32(dot, acc[t][h][NA - 1]);
            const float dx = x.scale[xi];
            tot[t] = _mm512_fmadd_ps(_mm512_mul_ps(dsc, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(dot), tot[t]);
            tot[t] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(x.sum[xi]), tot[t]);
          }
        }
      }
    } else {
      for (int a = 0; a < 8; ++a) {
        const uint8_t* blk = p + Q6_QL + Q6_A * a;
        __m512i acc[NT][2];
        for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          __m512i lo, hi;
          q6_bytes(blk, c, lo, hi);
          for (int t = 0; t < NT; ++t) {
            const int64_t k = s * QK + 32 * a + 4 * c;
            acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], lo, xd(t, k));
            acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], hi, xd(t, k + 16));
          }
        }
        const __m512i sc0 = load_i8(p + 32 + 16 * (2 * a)), sc1 = load_i8(p + 32 + 16 * (2 * a + 1));
        for (int t = 0; t < NT; ++t) {
          const int64_t xi = (t0 + t) * (K / XB) + s * 8 + a;
          // sc * (sum q x - 32 sum x) per 16 weights, in int32 (|.| < 2^24 each)
          const __m512i v = _mm512_add_epi32(
              _mm512_mullo_epi32(sc0, _mm512_sub_epi32(acc[t][0], _mm512_set1_epi32(x.qsum[2 * xi]))),
              _mm512_mullo_epi32(sc1, _mm512_sub_epi32(acc[t][1], _mm512_set1_epi32(x.qsum[2 * xi + 1]))));
          tot[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale[xi])), _mm512_cvtepi32_ps(v), tot[t]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}
#endif

// fp32 path: the 16 rows' weights 4c+i (lo) and kh+4c+i (hi) of unit u (Q4_K: a sub-block pair, q;
// Q6_K: 32 weights, q - 32) of a packed super-block, as fp32 vectors
constexpr int F32_UNITS = 8 * 4;  // (u, c) a super-block, both types
template <int QT>
inline void f32_weights(const uint8_t* p, int u, int c, __m512* wl, __m512* wh) {
  __m512i lo, hi;
  if constexpr (QT == Q4_K) {
    lo = _mm512_loadu_si512(p + 320 + (8 * u + c) * 64);
    hi = _mm512_srli_epi32(lo, 4);
  } else {
    q6_bytes(p + Q6_QL + Q6_A * u, c, lo, hi);
    lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(32));
    hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(32));
  }
  const __m512 tbl = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    if constexpr (QT == Q4_K) {  // vpermps reads the low 4 bits of each lane
      wl[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 8 * i), tbl);
      wh[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(hi, 8 * i), tbl);
    } else {
      wl[i] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lo, 24 - 8 * i), 24));
      wh[i] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(hi, 24 - 8 * i), 24));
    }
  }
}

// a group's weights as f32_weights gives them, all super-blocks (buf: K/256 * F32_UNITS * 8 vectors)
template <int QT>
void f32_fill(const uint8_t* group, int64_t nsb, __m512* buf) {
  for (int64_t s = 0; s < nsb; ++s)
    for (int uc = 0; uc < F32_UNITS; ++uc) {
      __m512* b = buf + (s * F32_UNITS + uc) * 8;
      const int nc = QT == Q4_K ? 8 : 4;
      f32_weights<QT>(group + s * packed_bytes<QT>(), uc / nc, uc % nc, b, b + 4);
    }
}

// one group of 16 rows against NT fp32 x rows: two FMA chains per x row and scale (by weight parity).
// The weights converted here, or (buf) read from f32_fill's buffer: the same values, so the same bits
template <int QT, int NT, bool BUF>
inline void group_f32(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res, const __m512* buf) {
  const int64_t K = x.K, nsb = K / QK;
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * packed_bytes<QT>();
    const __m512 d = load_h(p);
    for (int u = 0; u < (QT == Q4_K ? 4 : 8); ++u) {  // Q4_K: sub-block pairs; Q6_K: 32-weight blocks
      __m512 acc[NT][2][2];
      for (int t = 0; t < NT; ++t) acc[t][0][0] = acc[t][0][1] = acc[t][1][0] = acc[t][1][1] = _mm512_setzero_ps();
      const int64_t k0 = s * QK + (QT == Q4_K ? 64 : 32) * u, kh = QT == Q4_K ? 32 : 16;  // x of lo / hi weights
      constexpr int nc = QT == Q4_K ? 8 : 4;
      for (int c = 0; c < nc; ++c) {
        __m512 wv[8];
        if constexpr (!BUF) f32_weights<QT>(p, u, c, wv, wv + 4);
        const __m512* w8 = BUF ? buf + (s * F32_UNITS + u * nc + c) * 8 : wv;
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          for (int t = 0; t < NT; ++t) {
            const float* xb = x.f + (t0 + t) * K + k0 + 4 * c + i;
            acc[t][0][i & 1] = _mm512_fmadd_ps(w8[i], _mm512_set1_ps(xb[0]), acc[t][0][i & 1]);
            acc[t][1][i & 1] = _mm512_fmadd_ps(w8[4 + i], _mm512_set1_ps(xb[kh]), acc[t][1][i & 1]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        if constexpr (QT == Q4_K) {
          const int j = 2 * u + h;
          const __m512 dsc = _mm512_mul_ps(d, load_u8(p + 64 + 16 * j)), dm = _mm512_mul_ps(load_h(p + 32), load_u8(p + 192 + 16 * j));
          for (int t = 0; t < NT; ++t) {
            tot[t] = _mm512_fmadd_ps(dsc, _mm512_add_ps(acc[t][h][0], acc[t][h][1]), tot[t]);
            tot[t] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(x.sum[(t0 + t) * (K / XB) + s * 8 + j]), tot[t]);
          }
        } else {
          const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_i8(p + 32 + 16 * (2 * u + h))));
          for (int t = 0; t < NT; ++t) tot[t] = _mm512_fmadd_ps(dsc, _mm512_add_ps(acc[t][h][0], acc[t][h][1]), tot[t]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}

template <int QT, int NT>
inline void group_tile(const uint8_t* group, const PackedX& x, int64_t t0, int64_t nt, __m512* res, const __m512* buf) {
  if constexpr (NT > 1) {
    if (nt < NT) return group_tile<QT, NT - 1>(group, x, t0, nt, res, buf);
  }
#if defined(__AVX512VNNI__)
  if (x.int8) return group_int8<QT, NT>(group, x, t0, res);
#endif
  if constexpr (NT <= 4) {
    if (buf) group_f32<QT, NT, true>(group, x, t0, res, buf);
    else group_f32<QT, NT, false>(group, x, t0, res, buf);
  }
  else for (int64_t t = 0; t < NT; t += 4) group_tile<QT, 4>(group, x, t0 + t, std::min<int64_t>(4, NT - t), res + t, buf);
}

constexpr int PTILE = 8;  // x rows per pass over a group (fp32: in passes of 4)

// out = x W^T, or with GLU (W = [gate; up], N/2 rows each, a multiple of 16) silu(x gate^T) * (x up^T),
// combined in fp32 and rounded once, as quant_kernels.cpp's
template <int QT, bool GLU = false, typename O>
void packed_linear_impl(const PackedX& x, int64_t T, const uint8_t* w, int64_t N, int64_t ldw, O* out, int64_t ldo) {
  const int64_t cols = GLU ? N / 2 : N, groups = (cols + G - 1) / G, up = GLU ? groups * ldw : 0;
  constexpr int64_t XBLOCK = 256;  // prefill: the weights swept once per 256 x rows (theirs stay in L2)
  for (int64_t x0 = 0; x0 < T; x0 += XBLOCK) {
    const int64_t x1 = std::min<int64_t>(T, x0 + XBLOCK);
    // fp32 Q6_K prefill: each group's weights converted once per sweep, not once per pass of 4 x rows
    // (1 thread, 2048x2048 at 1024 rows: 110 -> 86 ms; Q4_K's conversion is too cheap to gain)
    const bool buffered = QT == Q6_K && !x.int8 && x1 - x0 > 16;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      __m512 res[PTILE], res_up[GLU ? PTILE : 1];
      const int64_t units = x.K / QK * F32_UNITS * 8;
      std::vector<__m512> buf(buffered ? units * (GLU ? 2 : 1) : 0);
      for (int64_t g = begin; g < end; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(G, cols - g * G));
        if (buffered) f32_fill<QT>(w + g * ldw, x.K / QK, buf.data());
        if (buffered && GLU) f32_fill<QT>(w + up + g * ldw, x.K / QK, buf.data() + units);
        for (int64_t t0 = x0; t0 < x1; t0 += PTILE) {
          const int64_t nt = std::min<int64_t>(PTILE, x1 - t0);
          group_tile<QT, PTILE>(w + g * ldw, x, t0, nt, res, buffered ? buf.data() : nullptr);
          if constexpr (GLU) group_tile<QT, PTILE>(w + up + g * ldw, x, t0, nt, res_up, buffered ? buf.data() + units : nullptr);
          store_tile<GLU>(res, res_up, nt, rows, out + t0 * ldo + g * G, ldo);
        }
      }
    });
  }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__))
constexpr int64_t PACKED = 256;
constexpr int G = 16;
#endif

// bytes a [N, K] matrix's row (block layout) or group of 16 rows (packed) holds per super-block
int64_t block_bytes_of(int64_t qtype) {
  const int64_t base = qtype & ~PACKED;
  TORCH_CHECK((base == Q4_K || base == Q6_K) && (qtype == base || qtype == (base | PACKED)), "quantized type ", qtype,
              " has no K-quant kernel (Q4_K=12, Q6_K=14, each + 256 packed)");
  if (qtype & PACKED) return base == Q4_K ? 2368 : 3360;
  return base == Q4_K ? 144 : 210;
}

// a block matrix [N, K/256 * block bytes], or a packed one [ceil(N / 16), K/256 * packed bytes]
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, int64_t N) {
  const int64_t bb = block_bytes_of(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.dtype() == at::kByte && w.dim() == 2 && w.stride(1) == 1,
              "weight: 2-D uint8 CPU blocks, rows contiguous");
  TORCH_CHECK(K % QK == 0, "the input size must be a multiple of 256 for K-quants, got ", K);
  TORCH_CHECK(w.size(1) == K / QK * bb, "weight rows hold ", w.size(1), " bytes; type ", qtype, " with ", K,
              " inputs needs ", K / QK * bb);
  const int64_t want = qtype & PACKED ? (N + G - 1) / G : N;
  TORCH_CHECK(w.size(0) == want, "weight has ", w.size(0), " rows; ", N, " outputs need ", want);
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
  TORCH_CHECK(!(qtype & PACKED), "packed matrices need an AVX-512 build (see packs())");
#endif
}

void check_out(const at::Tensor& out, int64_t rows, int64_t cols) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == rows && out.size(1) == cols &&
              (out.stride(1) == 1 || cols <= 1),
              "out must be a CPU [", rows, ", ", cols, "] tensor with unit column stride");
}

// (qtype, output dtype) -> a template instance
template <typename Run>
void dispatch(int64_t qtype, const at::Tensor& out, Run&& run) {
  auto by_out = [&](auto qt) {
    switch (out.scalar_type()) {
      case at::kFloat: run(qt, out.data_ptr<float>()); break;
      case at::kBFloat16: run(qt, out.data_ptr<c10::BFloat16>()); break;
      case at::kHalf: run(qt, out.data_ptr<c10::Half>()); break;
      default: TORCH_CHECK(false, "output dtype must be float32, bfloat16 or float16, got ", out.scalar_type());
    }
  };
  if ((qtype & ~PACKED) == Q4_K) by_out(std::integral_constant<int, Q4_K>());
  else by_out(std::integral_constant<int, Q6_K>());
}

}  // namespace

// out[t, n] = sum_k x[t, k] * W[n, k], W given as K-quant super-blocks [N, K/256 * block bytes] or
// packed (qtype + 256, see PACKED); `out` may be a column slice of a wider tensor (fused parts of
// different types each write their columns).
static void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(!glu || ((qtype & PACKED) && out.size(-1) % G == 0), "quant_linear_glu: a packed [gate; up] matrix, "
              "each half a multiple of 16 rows");
  const int64_t T = x.size(0), K = x.size(1), N = qtype & PACKED ? out.size(-1) * (glu ? 2 : 1) : w.size(0);
  check_weight(w, qtype, K, N);
  check_out(out, T, glu ? N / 2 : N);
  if (T == 0 || N == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldw = w.stride(0), ldo = out.stride(0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (qtype & PACKED) {
    // bf16 activations meet the weights as int8 where the CPU has VNNI; fp32 ones stay exact
#if defined(__AVX512VNNI__)
    const bool int8 = x.scalar_type() == at::kBFloat16;
#else
    const bool int8 = false;
#endif
    const at::Tensor xc = x.scalar_type() == at::kHalf ? x.to(at::kFloat).contiguous() : x.contiguous();
    const PackedX px = prepare_x(xc, int8);
    dispatch(qtype, out, [&](auto qt, auto* o) {
      if (glu) packed_linear_impl<decltype(qt)::value, true>(px, T, wp, N, ldw, o, ldo);
      else packed_linear_impl<decltype(qt)::value, false>(px, T, wp, N, ldw, o, ldo);
    });
    return;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 / fp16 widen exactly, once per call
  const float* xp = xf.data_ptr<float>();
  dispatch(qtype, out, [&](auto qt, auto* o) {
    linear_impl<decltype(qt)::value>(xp, T, K, wp, N, ldw, o, ldo);
  });
}

void quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out) { linear(x, w, qtype, out, false); }
void quant_linear_glu(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out) { linear(x, w, qtype, out, true); }

// out[i, :] = the dequantized weight row ids[i] (all rows when ids is null), bit for bit gguf's
void dequantize_rows(const at::Tensor& w, int64_t qtype, int64_t N, const int64_t* ids, int64_t n, at::Tensor& out) {
  const int64_t K = out.size(1);
  check_weight(w, qtype, K, N);
  check_out(out, n, K);
  if (n == 0 || K == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldw = w.stride(0), ldo = out.stride(0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (qtype & PACKED) {
    dispatch(qtype, out, [&](auto qt, auto* o) { dequant_packed_impl<decltype(qt)::value>(wp, ldw, ids, n, K, o, ldo); });
    return;
  }
#endif
  TORCH_CHECK(!ids, "row lookups of a block-layout matrix: index_select its rows, then quant_dequantize");
  dispatch(qtype, out, [&](auto qt, auto* o) { dequant_impl<decltype(qt)::value>(wp, n, K, ldw, o, ldo); });
}

// out[n, :] = the dequantized weight row n, bit for bit gguf's (prefill GEMMs, embedding rows)
void quant_dequantize(at::Tensor w, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  dequantize_rows(w, qtype, qtype & PACKED ? out.size(0) : w.size(0), nullptr, out.size(0), out);
}

// out[i, :] = the dequantized row ids[i] of a packed [N, K] matrix (embedding lookups read only those)
void quant_rows(at::Tensor w, int64_t qtype, int64_t N, at::Tensor ids, at::Tensor out) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: 1-D int64");
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  TORCH_CHECK(qtype & PACKED, "quant_rows reads packed matrices");
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id ", id[i], " out of [0, ", N, ")");
  dequantize_rows(w, qtype, N, id, ids.size(0), out);
}

// the packed form of a block matrix [N, K/256 * block bytes]: [ceil(N / 16), K/256 * packed bytes]
at::Tensor quant_pack(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(!(qtype & PACKED), "already packed");
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "weight: 2-D contiguous uint8 blocks");
  const int64_t N = w.size(0), bb = block_bytes_of(qtype);
  TORCH_CHECK(w.size(1) % bb == 0, "weight rows of ", w.size(1), " bytes are not whole super-blocks of type ", qtype);
  const int64_t nb = w.size(1) / bb;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  at::Tensor out = at::empty({(N + G - 1) / G, nb * block_bytes_of(qtype | PACKED)}, w.options());
  if (qtype == Q4_K) pack_impl<Q4_K>(w.data_ptr<uint8_t>(), N, nb, out.data_ptr<uint8_t>());
  else pack_impl<Q6_K>(w.data_ptr<uint8_t>(), N, nb, out.data_ptr<uint8_t>());
  return out;
#else
  TORCH_CHECK(false, "packed matrices need an AVX-512 build (see packs())");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("quant_linear_glu", &quant_linear_glu, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("quant_dequantize", &quant_dequantize, py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("quant_rows", &quant_rows, py::arg("w"), py::arg("qtype"), py::arg("rows"), py::arg("ids"), py::arg("out"));
  m.def("quant_pack", &quant_pack, py::arg("w"), py::arg("qtype"));
  // (linear, glu) as C function pointers for cpu_kernels.cpp's decoder stack (linear_entry.h)
  m.def("entry_points", []() { return entry_capsules(&quant_linear, &quant_linear_glu); });
  // whether quant_linear takes packed matrices (the layer packs its weights at load where it does)
  m.def("packs", []() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return true;
#else
    return false;
#endif
  });
  // whether bf16 activations meet packed weights as int8 (AVX512_VNNI), not exact (see PACKED)
  m.def("int8_activations", []() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return true;
#else
    return false;
#endif
  });
  m.def("isa", []() { return std::string(Simd::name()); });
}
