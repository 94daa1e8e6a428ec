// GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) computed on directly, built on first use by
// nanoserve/layers/cpu_kernels.py (-march=native unless NANOSERVE_CPU_MARCH says otherwise).
//
// Activations stay in fp32: each 32-weight block is dequantized in registers with exactly the
// arithmetic of the gguf package's dequantize (Q4_0/Q8_0: d*q; Q4_1: d*q then + m, two roundings, no
// FMA), then FMA-ed against x. So a product here differs from "dequantize, then F.linear in fp32"
// only in summation order. (llama.cpp instead rounds x to int8 per block and uses integer dot
// products: faster on VNNI, but not exact.) One code path per build, chosen by the compiler flags:
// AVX-512, else AVX2 + FMA + F16C, else scalar. With AVX512_BF16 and bf16 activations the block is
// instead rounded to bf16 (as the bf16 prefill GEMM's copy holds it) and meets x, read as bf16, in
// vdpbf16ps: the products are exact either way (bf16 x bf16 fits fp32), so only the summation differs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;  // weights per block, all three types
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGML's type ids

template <int QT> constexpr int64_t block_bytes() { return QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34; }

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; c10's portable conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// ---- one block of 32 weights -> fp32 lanes, per instruction set ----------------------------------
#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int W = 16, N = QK / W;  // lanes, vectors per block
  static const char* name() { return "avx512"; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // to the nearest bf16 (ties to even) and back: what a bf16 copy of the weight holds
  static V bf16(V v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // the 16 values a 4-bit weight can take, by nibble (the reference's own arithmetic, so the same floats)
  template <int QT> static V table(const uint8_t* b) {
    const V d = _mm512_set1_ps(h2f(b));
    if constexpr (QT == Q4_0) return _mm512_mul_ps(d, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    return _mm512_add_ps(_mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                         _mm512_set1_ps(h2f(b + 2)));
  }
  template <int QT, bool RB = false> static void block(const uint8_t* b, V* w) {
    if constexpr (QT == Q8_0) {
      const V d = _mm512_set1_ps(h2f(b));
      for (int i = 0; i < N; ++i) {
        w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2 + 16 * i)))));
        if constexpr (RB) w[i] = bf16(w[i]);
      }
    } else {
      // A 4-bit weight is one of 16 values: compute those once per block and look each weight up
      // by its nibble (vpermps reads the low 4 bits of each lane: the low nibble as is, the high one
      // after a shift)
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + (QT == Q4_1 ? 4 : 2))));
      V t = table<QT>(b);
      if constexpr (RB) t = bf16(t);
      w[0] = _mm512_permutexvar_ps(q, t);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t);
    }
  }
#if defined(__AVX512BF16__)
  // the block as 32 bf16, in order; vcvtne(2)ps2bf16 rounds to nearest even, as bf16() does (the
  // values are multiples of 2^-24, never fp32 subnormals, so its flushing of those never applies)
  template <int QT> static __m512bh block_bf16(const uint8_t* b) {
    if constexpr (QT == Q8_0) {
      V w[N];
      block<QT>(b, w);
      return _mm512_cvtne2ps_pbh(w[1], w[0]);
    } else {
      // the table in bf16 and one 16-bit lookup (vpermw) per block: weights 0-15 are the low
      // nibbles of the 16 bytes, 16-31 the high ones
      const __m512i t = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(table<QT>(b)));
      const __m128i q = _mm_loadu_si128((const __m128i*)(b + (QT == Q4_1 ? 4 : 2))), m4 = _mm_set1_epi8(0x0F);
      const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
      return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nib), t);
    }
  }
#endif
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Simd {
  using V = __m256;
  static constexpr int W = 8, N = QK / W;
  static const char* name() { return "avx2"; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static V bf16(V v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  template <int QT, bool RB = false> static void block(const uint8_t* b, V* w) {
    const V d = _mm256_set1_ps(h2f(b));
    if constexpr (QT == Q8_0) {
      for (int i = 0; i < N; ++i)
        w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * i)))));
    } else {
      const __m128i q = _mm_loadu_si128((const __m128i*)(b + (QT == Q4_1 ? 4 : 2))), m4 = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int i = 0; i < N; ++i) {
        __m256i v = _mm256_cvtepu8_epi32(parts[i]);
        if constexpr (QT == Q4_0) {
          w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))));
        } else {
          w[i] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(v)), _mm256_set1_ps(h2f(b + 2)));
        }
      }
    }
    if constexpr (RB)
      for (int i = 0; i < N; ++i) w[i] = bf16(w[i]);
  }
};
#else
struct Simd {
  using V = float;
  static constexpr int W = 1, N = QK;
  static const char* name() { return "scalar"; }
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float sum(V v) { return v; }
  static V bf16(V v) { return static_cast<float>(c10::BFloat16(v)); }
  template <int QT, bool RB = false> static void block(const uint8_t* b, V* w) {
    const float d = h2f(b);
    if constexpr (QT == Q8_0) {
      for (int i = 0; i < QK; ++i) w[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
    } else {
      const uint8_t* qs = b + (QT == Q4_1 ? 4 : 2);
      const float m = QT == Q4_1 ? h2f(b + 2) : 0.f;
      for (int i = 0; i < 16; ++i) {
        const int lo = qs[i] & 15, hi = qs[i] >> 4;
        w[i] = QT == Q4_0 ? d * static_cast<float>(lo - 8) : d * static_cast<float>(lo) + m;
        w[i + 16] = QT == Q4_0 ? d * static_cast<float>(hi - 8) : d * static_cast<float>(hi) + m;
      }
    }
    if constexpr (RB)
      for (int i = 0; i < QK; ++i) w[i] = bf16(w[i]);
  }
};
#endif

using V = Simd::V;

// res[t] = dot(weight row, x row t) for NT rows of x at once: the row's blocks are dequantized once
// per NT rows. Accumulators: one per vector of a block, so consecutive FMAs do not wait on each other.
// RB (bf16 activations): the weights rounded to bf16 first, as the prefill path's bf16 copy holds
// them, so a token's result does not depend on which path its step took beyond summation order
template <int QT, bool RB, int NT>
inline void dot_rows(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, float* res) {
  constexpr int NA = Simd::N < 4 ? Simd::N : 4;
  V acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = Simd::zero();
  V w[Simd::N];
  for (int64_t b = 0; b < nb; ++b) {
    Simd::block<QT, RB>(wrow + b * block_bytes<QT>(), w);
    for (int t = 0; t < NT; ++t) {
      const float* xb = x + t * ldx + b * QK;
      for (int i = 0; i < Simd::N; ++i) acc[t][i % NA] = Simd::fma(w[i], Simd::load(xb + i * Simd::W), acc[t][i % NA]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    V s = acc[t][0];
    for (int a = 1; a < NA; ++a) s = s + acc[t][a];
    res[t] = Simd::sum(s);
  }
}

#if defined(__AVX512BF16__)
// dot_rows for bf16 x: one vdpbf16ps per block and row. Two accumulators, even and odd blocks, so
// consecutive dot products of a row do not wait on each other; a row's order of operations is the
// same whatever NT is (batch invariance)
template <int QT, int NT>
inline void dot_rows_bf16(const uint8_t* wrow, int64_t nb, const c10::BFloat16* x, int64_t ldx, float* res) {
  __m512 even[NT], odd[NT];
  for (int t = 0; t < NT; ++t) even[t] = odd[t] = _mm512_setzero_ps();
  auto xblock = [&](int t, int64_t b) { return (__m512bh)_mm512_loadu_si512(x + t * ldx + b * QK); };
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const __m512bh w0 = Simd::block_bf16<QT>(wrow + b * block_bytes<QT>());
    const __m512bh w1 = Simd::block_bf16<QT>(wrow + (b + 1) * block_bytes<QT>());
    for (int t = 0; t < NT; ++t) {
      even[t] = _mm512_dpbf16_ps(even[t], w0, xblock(t, b));
      odd[t] = _mm512_dpbf16_ps(odd[t], w1, xblock(t, b + 1));
    }
  }
  if (b < nb) {
    const __m512bh w0 = Simd::block_bf16<QT>(wrow + b * block_bytes<QT>());
    for (int t = 0; t < NT; ++t) even[t] = _mm512_dpbf16_ps(even[t], w0, xblock(t, b));
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(_mm512_add_ps(even[t], odd[t]));
}
#endif

// NT rows of x against one weight row, by x's dtype (bf16 x reaches here only with AVX512_BF16)
template <int QT, bool RB, int NT, typename XT>
inline void tile_rows(const uint8_t* wrow, int64_t nb, const XT* x, int64_t ldx, float* res) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<XT, c10::BFloat16>) {
    dot_rows_bf16<QT, NT>(wrow, nb, x, ldx, res);
    return;
  }
#endif
  if constexpr (std::is_same_v<XT, float>) dot_rows<QT, RB, NT>(wrow, nb, x, ldx, res);
}

template <typename O> inline O to_out(float v) { return static_cast<O>(v); }

constexpr int TILE = 8;  // x rows per pass over a weight row

template <int QT, typename O, typename XT>
void linear_impl(const XT* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, O* out, int64_t ldo) {
  constexpr bool RB = std::is_same_v<O, c10::BFloat16>;
  const int64_t nb = K / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float res[TILE];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = w + n * row_bytes;
      for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t nt = std::min<int64_t>(TILE, T - t0);
        const XT* xt = x + t0 * K;
        switch (nt) {
          case 1: tile_rows<QT, RB, 1>(wrow, nb, xt, K, res); break;
          case 2: tile_rows<QT, RB, 2>(wrow, nb, xt, K, res); break;
          case 3: tile_rows<QT, RB, 3>(wrow, nb, xt, K, res); break;
          case 4: tile_rows<QT, RB, 4>(wrow, nb, xt, K, res); break;
          case 5: tile_rows<QT, RB, 5>(wrow, nb, xt, K, res); break;
          case 6: tile_rows<QT, RB, 6>(wrow, nb, xt, K, res); break;
          case 7: tile_rows<QT, RB, 7>(wrow, nb, xt, K, res); break;
          default: tile_rows<QT, RB, 8>(wrow, nb, xt, K, res); break;
        }
        for (int64_t t = 0; t < nt; ++t) out[(t0 + t) * ldo + n] = to_out<O>(res[t]);
      }
    }
  });
}

// ---- the packed layout: 16 rows interleaved ------------------------------------------------------
// quant_pack rearranges a block matrix (same bytes, same count, rows padded to a multiple of 16 with
// zero blocks) so that one vector holds the same weight of 16 rows: a GEMV then needs no horizontal
// sums and no per-row scalar scale conversions, which is what held the block-layout kernel at about
// 13 G weights/s, compute bound, below what memory delivers. Per group of 16 rows and block b:
//   Q4_0: d[16] (fp16) | qs[16][16]         qs[j][r] = byte j of row r's block: weights j and j+16
//   Q4_1: d[16] | m[16] | qs[16][16]
//   Q8_0: d[16] | qs[32][16]                qs[k][r] = weight k of row r
// The products are exact (4-bit values and bf16 activations meet in vdpbf16ps; int8 values and fp32
// activations in FMAs) and each block's sum is scaled once: d * sum(q x) (+ m * sum(x) for Q4_1), the
// same value as sum((d q + m) x) up to fp32 rounding and summation order.
constexpr int64_t PACKED = 256;  // qtype | PACKED names a packed matrix
constexpr int G = 16;            // rows per group

template <int QT> constexpr int qs_offset() { return QT == Q4_1 ? 64 : 32; }

// row `lane` of a packed group's block b back in GGUF block form (for dequantization)
template <int QT>
inline void unpack_block(const uint8_t* group, int64_t b, int lane, uint8_t* blk) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>(), nq = QT == Q8_0 ? 32 : 16;
  const uint8_t* src = group + b * G * bb;
  std::memcpy(blk, src + 2 * lane, 2);
  if constexpr (QT == Q4_1) std::memcpy(blk + 2, src + 32 + 2 * lane, 2);
  uint8_t* q = blk + (QT == Q4_1 ? 4 : 2);
  for (int j = 0; j < nq; ++j) q[j] = src[qo + j * G + lane];
}

// a dequantized block (Simd::N vectors of fp32) stored as 32 values of O: bf16 in one vcvtneps2bf16
// per 16 (round to nearest even like c10's conversion; the values are never fp32 subnormals, which
// it would flush), else through a buffer
template <typename O>
inline void store_block(O* o, const V* v) {
  if constexpr (std::is_same_v<O, float>) {
    for (int j = 0; j < Simd::N; ++j) Simd::store(o + j * Simd::W, v[j]);
#if defined(__AVX512BF16__)
  } else if constexpr (std::is_same_v<O, c10::BFloat16>) {
    for (int j = 0; j < Simd::N; ++j) _mm256_storeu_si256((__m256i*)(o + j * Simd::W), (__m256i)_mm512_cvtneps_pbh(v[j]));
#endif
  } else {
    alignas(64) float buf[QK];
    for (int j = 0; j < Simd::N; ++j) Simd::store(buf + j * Simd::W, v[j]);
    for (int j = 0; j < QK; ++j) o[j] = static_cast<O>(buf[j]);
  }
}

// a packed group's block b back as the 16 rows' GGUF blocks, blk[r * block bytes ...]: the 16x16
// byte transpose that quant_pack applied, undone with SSE unpacks (64 ops for up to 512 weights,
// where a byte-by-byte gather would take 256 loads)
template <int QT>
inline void unpack_group_block(const uint8_t* group, int64_t b, uint8_t* blk) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>(), q0 = QT == Q4_1 ? 4 : 2;
  const uint8_t* src = group + b * G * bb;
  for (int r = 0; r < G; ++r) {
    std::memcpy(blk + r * bb, src + 2 * r, 2);
    if constexpr (QT == Q4_1) std::memcpy(blk + r * bb + 2, src + 32 + 2 * r, 2);
  }
  for (int half = 0; half < (QT == Q8_0 ? 2 : 1); ++half) {
#if defined(__SSE2__)
    __m128i m[16], t[16];
    for (int j = 0; j < 16; ++j) m[j] = _mm_loadu_si128((const __m128i*)(src + qo + (half * 16 + j) * G));
    // four rounds of interleaving: after them, m[r] holds bytes j = 0..15 of row r
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm_unpacklo_epi8(m[2 * i], m[2 * i + 1]);
      t[2 * i + 1] = _mm_unpackhi_epi8(m[2 * i], m[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 2; ++k) {
        m[4 * i + k] = _mm_unpacklo_epi16(t[4 * i + k], t[4 * i + k + 2]);
        m[4 * i + k + 2] = _mm_unpackhi_epi16(t[4 * i + k], t[4 * i + k + 2]);
      }
    for (int i = 0; i < 2; ++i)
      for (int k = 0; k < 4; ++k) {
        t[8 * i + k] = _mm_unpacklo_epi32(m[8 * i + k], m[8 * i + k + 4]);
        t[8 * i + k + 4] = _mm_unpackhi_epi32(m[8 * i + k], m[8 * i + k + 4]);
      }
    for (int k = 0; k < 8; ++k) {
      m[k] = _mm_unpacklo_epi64(t[k], t[k + 8]);
      m[k + 8] = _mm_unpackhi_epi64(t[k], t[k + 8]);
    }
    // m[k] now holds rows in the order the rounds produced: row = bit-reversal-like map, computed once
    static constexpr int order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    for (int k = 0; k < 16; ++k) _mm_storeu_si128((__m128i*)(blk + order[k] * bb + q0 + half * 16), m[k]);
#else
    for (int r = 0; r < G; ++r)
      for (int j = 0; j < 16; ++j) blk[r * bb + q0 + half * 16 + j] = src[qo + (half * 16 + j) * G + r];
#endif
  }
}

template <int QT>
void pack_impl(const uint8_t* w, int64_t N, int64_t row_bytes, uint8_t* out) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>(), nq = QT == Q8_0 ? 32 : 16;
  const int64_t nb = row_bytes / bb, groups = (N + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = out + (g * nb + b) * G * bb;
        std::memset(dst, 0, G * bb);
        for (int r = 0; r < G && g * G + r < N; ++r) {
          const uint8_t* src = w + (g * G + r) * row_bytes + b * bb;
          std::memcpy(dst + 2 * r, src, 2);
          if constexpr (QT == Q4_1) std::memcpy(dst + 32 + 2 * r, src + 2, 2);
          const uint8_t* q = src + (QT == Q4_1 ? 4 : 2);
          for (int j = 0; j < nq; ++j) dst[qo + j * G + r] = q[j];
        }
      }
  });
}

// out[i, :] = the dequantized weight row rows[i] (all rows when `rows` is null), the block-layout
// or the packed matrix alike, with the reference's arithmetic (Simd::block)
// the whole packed matrix dequantized, a group at a time (prefill GEMMs)
template <int QT, typename O>
void dequant_packed_impl(const uint8_t* w, int64_t group_bytes, int64_t N, int64_t K, O* out, int64_t ldo) {
  constexpr int bb = block_bytes<QT>();
  const int64_t nb = K / QK;
  at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t blk[G * bb];
    V v[Simd::N];
    for (int64_t g = begin; g < end; ++g) {
      const int rows = static_cast<int>(std::min<int64_t>(G, N - g * G));
      for (int64_t b = 0; b < nb; ++b) {
        unpack_group_block<QT>(w + g * group_bytes, b, blk);
        for (int r = 0; r < rows; ++r) {
          Simd::block<QT>(blk + r * bb, v);
          store_block(out + (g * G + r) * ldo + b * QK, v);
        }
      }
    }
  });
}

template <int QT, typename O>
void dequant_impl(const uint8_t* w, bool packed, int64_t row_bytes, const int64_t* rows, int64_t n_out, int64_t K,
                  O* out, int64_t ldo) {
  constexpr int bb = block_bytes<QT>();
  const int64_t nb = K / QK;
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    uint8_t blk[block_bytes<QT>()];
    V v[Simd::N];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = rows ? rows[i] : i;
      O* orow = out + i * ldo;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* src = w + n * row_bytes + b * bb;
        if (packed) {
          unpack_block<QT>(w + n / G * row_bytes, b, static_cast<int>(n % G), blk);
          src = blk;
        }
        Simd::block<QT>(src, v);
        store_block(orow + b * QK, v);
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Activations as the packed kernels read them, per x row: fp32 values (Q8_0, and Q4 without
// AVX512_BF16) or bf16 pairs (x[j], x[j + 16]) of each block as one 32-bit word (Q4 with bf16 x), and
// each block's sum (Q4: the offset's term), in a fixed order per row so a row's bits do not depend on
// its batch
struct PackedX {
  std::vector<float> f, sums;
  std::vector<uint32_t> pairs;
  int64_t nb = 0;
  bool bf16 = false;
};

template <typename XT>
PackedX prepare_x(const XT* x, int64_t T, int64_t K, bool pairs) {
  PackedX p;
  p.nb = K / QK;
  p.bf16 = pairs;
  p.sums.resize(T * p.nb);
  if (pairs) p.pairs.resize(T * p.nb * 16); else p.f.resize(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < p.nb; ++b) {
      const XT* xb = x + t * K + b * QK;
      float s = 0.f;
      for (int i = 0; i < QK; ++i) s += static_cast<float>(xb[i]);
      p.sums[t * p.nb + b] = s;
      if (pairs) {
        for (int j = 0; j < 16; ++j) {
          const uint16_t lo = c10::BFloat16(xb[j]).x, hi = c10::BFloat16(xb[j + 16]).x;
          p.pairs[(t * p.nb + b) * 16 + j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
      } else {
        for (int i = 0; i < QK; ++i) p.f[t * K + b * QK + i] = static_cast<float>(xb[i]);
      }
    }
  return p;
}

// one group of 16 rows against NT x rows: res[t] = the 16 rows' results for x row t. Two
// accumulators per x row (even and odd steps) so consecutive products do not wait on each other; a
// row's operations are the same whatever NT is
template <int QT, int NT>
inline void packed_group(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>();
  // two accumulator chains per x row, whatever NT is (the summation order is a row's own: batch
  // invariance; four chains at NT = 1 measured no faster). Inner loops over c are fully unrolled
  // (fixed indices keep the accumulators in registers)
  constexpr int NC = 2;
  const int64_t nb = x.nb, K = nb * QK;
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * G * bb;
    __m512 acc[NT][NC];
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < NC; ++c) acc[t][c] = _mm512_setzero_ps();
    auto bytes = [&](int j) { return _mm_loadu_si128((const __m128i*)(blk + qo + j * G)); };
    if constexpr (QT == Q8_0) {
      for (int k = 0; k < QK; k += NC) {
        __m512 w[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(k + c)));
        for (int t = 0; t < NT; ++t) {
          const float* xb = x.f.data() + (t0 + t) * K + b * QK + k;
#pragma GCC unroll 4
          for (int c = 0; c < NC; ++c) acc[t][c] = _mm512_fmadd_ps(w[c], _mm512_set1_ps(xb[c]), acc[t][c]);
        }
      }
    } else {
#if defined(__AVX512BF16__)
      if (x.bf16) {
        // a lane's byte v as (bf16(q_lo), bf16(q_hi)): v | v << 12 puts the low nibble in the low
        // word's index bits and the high nibble in the high word's; vpermw reads 5 index bits, so the
        // table repeats its 16 values
        const __m512i tbl = QT == Q4_0 ? _mm512_set_epi16(0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
                                                          (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080,
                                                          (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100,
                                                          0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
                                                          (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080,
                                                          (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100)
                                       : _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                                                          0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
                                                          0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                                                          0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
        const uint32_t* xp = x.pairs.data() + b * 16;
        for (int j = 0; j < 16; j += NC) {
          __m512bh w[NC];
#pragma GCC unroll 4
          for (int c = 0; c < NC; ++c) {
            const __m512i v = _mm512_cvtepu8_epi32(bytes(j + c));
            w[c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), tbl);
          }
          for (int t = 0; t < NT; ++t) {
            const uint32_t* xt = xp + (t0 + t) * nb * 16 + j;
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c)
              acc[t][c] = _mm512_dpbf16_ps(acc[t][c], w[c], (__m512bh)_mm512_set1_epi32((int)xt[c]));
          }
        }
      } else
#endif
      {
        const __m512 tbl = QT == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                      : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int j = 0; j < 16; j += NC / 2) {
          __m512 w[NC];  // the low nibbles' weights (j + c) then the high ones' (j + c + 16)
#pragma GCC unroll 4
          for (int c = 0; c < NC / 2; ++c) {
            const __m512i v = _mm512_cvtepu8_epi32(bytes(j + c));
            w[2 * c] = _mm512_permutexvar_ps(v, tbl);
            w[2 * c + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
          }
          for (int t = 0; t < NT; ++t) {
            const float* xb = x.f.data() + (t0 + t) * K + b * QK + j;
#pragma GCC unroll 4
            for (int c = 0; c < NC / 2; ++c) {
              acc[t][2 * c] = _mm512_fmadd_ps(w[2 * c], _mm512_set1_ps(xb[c]), acc[t][2 * c]);
              acc[t][2 * c + 1] = _mm512_fmadd_ps(w[2 * c + 1], _mm512_set1_ps(xb[c + 16]), acc[t][2 * c + 1]);
            }
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    for (int t = 0; t < NT; ++t) {
      __m512 sum = acc[t][0];
#pragma GCC unroll 4
      for (int c = 1; c < NC; ++c) sum = _mm512_add_ps(sum, acc[t][c]);
      tot[t] = _mm512_fmadd_ps(d, sum, tot[t]);
    }
    if constexpr (QT == Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
      for (int t = 0; t < NT; ++t) tot[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[(t0 + t) * nb + b]), tot[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}

constexpr int PTILE = 8;  // x rows per pass over a group: 3 vectors each, within the 32 registers

template <int QT, typename O>
void packed_linear_impl(const PackedX& x, int64_t T, const uint8_t* w, int64_t N, int64_t group_bytes, O* out, int64_t ldo) {
  const int64_t groups = (N + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    __m512 res[PTILE];
    alignas(64) float lane[G];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * group_bytes;
      const int rows = static_cast<int>(std::min<int64_t>(G, N - g * G));
      for (int64_t t0 = 0; t0 < T; t0 += PTILE) {
        const int64_t nt = std::min<int64_t>(PTILE, T - t0);
        switch (nt) {
          case 1: packed_group<QT, 1>(group, x, t0, res); break;
          case 2: packed_group<QT, 2>(group, x, t0, res); break;
          case 3: packed_group<QT, 3>(group, x, t0, res); break;
          case 4: packed_group<QT, 4>(group, x, t0, res); break;
          case 5: packed_group<QT, 5>(group, x, t0, res); break;
          case 6: packed_group<QT, 6>(group, x, t0, res); break;
          case 7: packed_group<QT, 7>(group, x, t0, res); break;
          default: packed_group<QT, 8>(group, x, t0, res); break;
        }
        for (int64_t t = 0; t < nt; ++t) {
          _mm512_store_ps(lane, res[t]);
          O* o = out + (t0 + t) * ldo + g * G;
          for (int r = 0; r < rows; ++r) o[r] = to_out<O>(lane[r]);
        }
      }
    }
  });
}
#endif

template <int QT> constexpr bool known() { return QT == Q4_0 || QT == Q4_1 || QT == Q8_0; }

// dispatch (qtype, output dtype) to a template instance
template <template <int, typename> class F, typename... A>
void dispatch(int64_t qtype, const torch::Tensor& out, A... args) {
  auto go = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    if (out.scalar_type() == torch::kFloat) F<QT, float>::run(args..., out.data_ptr<float>());
    else if (out.scalar_type() == torch::kBFloat16) F<QT, c10::BFloat16>::run(args..., out.data_ptr<c10::BFloat16>());
    else if (out.scalar_type() == torch::kHalf) F<QT, c10::Half>::run(args..., out.data_ptr<c10::Half>());
    else TORCH_CHECK(false, "output dtype must be float32, bfloat16 or float16");
  };
  switch (qtype) {
    case Q4_0: go(std::integral_constant<int, Q4_0>()); break;
    case Q4_1: go(std::integral_constant<int, Q4_1>()); break;
    case Q8_0: go(std::integral_constant<int, Q8_0>()); break;
    default: TORCH_CHECK(false, "quantized type ", qtype, " has no kernel (Q4_0=2, Q4_1=3, Q8_0=8)");
  }
}

int64_t row_bytes_of(int64_t qtype, int64_t K) {
  const int64_t base = qtype & ~PACKED;
  const int64_t bb = base == Q4_0 ? 18 : base == Q4_1 ? 20 : base == Q8_0 ? 34 : 0;
  TORCH_CHECK(bb && (qtype == base || qtype == (base | PACKED)), "quantized type ", qtype,
              " has no kernel (Q4_0=2, Q4_1=3, Q8_0=8, each + 256 packed)");
  return K / QK * bb * (qtype & PACKED ? G : 1);
}

// a block matrix [N, row bytes], or a packed one [ceil(N / 16), 16 * row bytes]
void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K, int64_t N) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.stride(1) == 1, "weight: 2-D uint8 blocks, rows contiguous");
  TORCH_CHECK(K % QK == 0, "the input size must be a multiple of 32, got ", K);
  TORCH_CHECK(w.size(1) == row_bytes_of(qtype, K), "weight rows hold ", w.size(1), " bytes; type ", qtype, " with ", K,
              " inputs needs ", row_bytes_of(qtype, K));
  const int64_t want = qtype & PACKED ? (N + G - 1) / G : N;
  TORCH_CHECK(w.size(0) == want, "weight has ", w.size(0), " rows; ", N, " outputs need ", want);
}

void check_out(const torch::Tensor& out, int64_t rows, int64_t cols) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == cols && out.stride(1) == 1,
              "out must be [", rows, ", ", cols, "] with unit column stride");
}

template <int QT, typename O> struct Linear {
  template <typename XT>
  static void run(const XT* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t rb, int64_t ldo, O* out) {
    linear_impl<QT, O>(x, T, K, w, N, rb, out, ldo);
  }
};
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int QT, typename O> struct PackedLinear {
  static void run(const PackedX* x, int64_t T, const uint8_t* w, int64_t N, int64_t rb, int64_t ldo, O* out) {
    packed_linear_impl<QT, O>(*x, T, w, N, rb, out, ldo);
  }
};
#endif
template <int QT, typename O> struct Dequant {
  static void run(const uint8_t* w, bool packed, int64_t rb, const int64_t* rows, int64_t n, int64_t K, int64_t ldo, O* out) {
    if (packed && !rows) dequant_packed_impl<QT, O>(w, rb, n, K, out, ldo);
    else dequant_impl<QT, O>(w, packed, rb, rows, n, K, out, ldo);
  }
};
template <int QT, typename O> struct Pack {
  static void run(const uint8_t* w, int64_t N, int64_t rb, uint8_t* out) { pack_impl<QT>(w, N, rb, out); }
};

}  // namespace

// out[t, n] = sum_k x[t, k] * W[n, k], W given as GGUF blocks [N, row_bytes] or packed (qtype + 256);
// `out` may be a column slice of a wider tensor (fused QKV / gate-up parts of different types each
// write their columns).
void quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t T = x.size(0), K = x.size(1), N = out.dim() == 2 ? out.size(1) : -1;
  check_weight(w, qtype, K, N);
  check_out(out, T, N);
  if (qtype & PACKED) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const torch::Tensor xc = x.contiguous();
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
#if defined(__AVX512BF16__)
    const bool pairs = bf16 && (qtype & ~PACKED) != Q8_0;  // Q8_0 meets x in fp32 FMAs
#else
    const bool pairs = false;
#endif
    const PackedX px = bf16 ? prepare_x(xc.data_ptr<c10::BFloat16>(), T, K, pairs)
                            : prepare_x(xc.to(torch::kFloat).data_ptr<float>(), T, K, false);
    dispatch<PackedLinear>(qtype & ~PACKED, out, &px, T, w.data_ptr<uint8_t>(), N, w.size(1), out.stride(0));
    return;
#else
    TORCH_CHECK(false, "packed matrices need an AVX-512 build (see packs())");
#endif
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16) {
    const torch::Tensor xb = x.contiguous();
    dispatch<Linear>(qtype, out, static_cast<const c10::BFloat16*>(xb.data_ptr<c10::BFloat16>()), T, K,
                     w.data_ptr<uint8_t>(), N, w.size(1), out.stride(0));
    return;
  }
#endif
  const torch::Tensor xf = x.to(torch::kFloat).contiguous();
  dispatch<Linear>(qtype, out, xf.data_ptr<float>(), T, K, w.data_ptr<uint8_t>(), N, w.size(1), out.stride(0));
}

// out[n, :] = the dequantized weight row n (prefill GEMMs)
void quant_dequantize(torch::Tensor w, int64_t qtype, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  const int64_t N = out.size(0), K = out.size(1);
  check_weight(w, qtype, K, N);
  check_out(out, N, K);
  dispatch<Dequant>(qtype & ~PACKED, out, w.data_ptr<uint8_t>(), bool(qtype & PACKED), w.size(1),
                    static_cast<const int64_t*>(nullptr), N, K, out.stride(0));
}

// out[i, :] = the dequantized row ids[i] of an [N, K] matrix (embedding lookups: only those rows are read)
void quant_rows(torch::Tensor w, int64_t qtype, int64_t N, torch::Tensor ids, torch::Tensor out) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "ids: 1-D int64");
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  const int64_t K = out.size(1);
  check_weight(w, qtype, K, N);
  check_out(out, ids.size(0), K);
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id ", id[i], " out of [0, ", N, ")");
  dispatch<Dequant>(qtype & ~PACKED, out, w.data_ptr<uint8_t>(), bool(qtype & PACKED), w.size(1), id, ids.size(0), K,
                    out.stride(0));
}

// the packed form of a block matrix [N, row bytes]: [ceil(N / 16), 16 * row bytes] (see PACKED)
torch::Tensor quant_pack(torch::Tensor w, int64_t qtype) {
  TORCH_CHECK(!(qtype & PACKED), "already packed");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "weight: 2-D contiguous uint8 blocks");
  const int64_t N = w.size(0), rb = w.size(1);
  TORCH_CHECK(rb % (row_bytes_of(qtype, QK)) == 0, "weight rows of ", rb, " bytes are not whole blocks of type ", qtype);
  torch::Tensor out = torch::empty({(N + G - 1) / G, rb * G}, w.options());
  switch (qtype) {
    case Q4_0: Pack<Q4_0, float>::run(w.data_ptr<uint8_t>(), N, rb, out.data_ptr<uint8_t>()); break;
    case Q4_1: Pack<Q4_1, float>::run(w.data_ptr<uint8_t>(), N, rb, out.data_ptr<uint8_t>()); break;
    default: Pack<Q8_0, float>::run(w.data_ptr<uint8_t>(), N, rb, out.data_ptr<uint8_t>()); break;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("quant_dequantize", &quant_dequantize, py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("quant_rows", &quant_rows, py::arg("w"), py::arg("qtype"), py::arg("rows"), py::arg("ids"), py::arg("out"));
  m.def("quant_pack", &quant_pack, py::arg("w"), py::arg("qtype"));
  // whether quant_linear takes packed matrices (the layer packs its weights at load where it does)
  m.def("packs", []() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return true;
#else
    return false;
#endif
  });
  m.def("isa", []() {
#if defined(__AVX512BF16__)
    return std::string(Simd::name()) + "+bf16";
#else
    return std::string(Simd::name());
#endif
  });
}
