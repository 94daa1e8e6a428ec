// GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) computed on directly, built on first use by
// nanoserve/kernels/cpu_kernels.py (-march=native unless NANOSERVE_CPU_MARCH says otherwise).
//
// Two layouts. The GGUF blocks as they are (AVX2 and scalar builds): each 32-weight block is
// dequantized in registers with exactly the arithmetic of the gguf package's dequantize (Q4_0/Q8_0:
// d*q; Q4_1: d*q then + m, two roundings, no FMA), then FMA-ed against fp32 x, so a product differs
// from "dequantize, then F.linear in fp32" only in summation order (bf16 outputs: the weights rounded
// to bf16 first, as the prefill GEMM's bf16 copy holds them). And the packed layout (AVX-512 builds,
// see PACKED below), which the layer uses wherever the build has it. One code path per build, chosen
// by the compiler flags: AVX-512, else AVX2 + FMA + F16C, else scalar.
// ATen and pybind11's tensor casters, not <torch/extension.h>: that one brings torch's whole C++
// frontend (autograd, nn, optim) and took a third more compile time (30 s against 20 s a module)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include "simd_math.h"
#include "linear_entry.h"
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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


template <typename O> inline O to_out(float v) { return static_cast<O>(v); }

constexpr int TILE = 8;  // x rows per pass over a weight row

template <int QT, typename O>
void linear_impl(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, O* out, int64_t ldo) {
  constexpr bool RB = std::is_same_v<O, c10::BFloat16>;
  const int64_t nb = K / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float res[TILE];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = w + n * row_bytes;
      for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t nt = std::min<int64_t>(TILE, T - t0);
        const float* xt = x + t0 * K;
        switch (nt) {
          case 1: dot_rows<QT, RB, 1>(wrow, nb, xt, K, res); break;
          case 2: dot_rows<QT, RB, 2>(wrow, nb, xt, K, res); break;
          case 3: dot_rows<QT, RB, 3>(wrow, nb, xt, K, res); break;
          case 4: dot_rows<QT, RB, 4>(wrow, nb, xt, K, res); break;
          case 5: dot_rows<QT, RB, 5>(wrow, nb, xt, K, res); break;
          case 6: dot_rows<QT, RB, 6>(wrow, nb, xt, K, res); break;
          case 7: dot_rows<QT, RB, 7>(wrow, nb, xt, K, res); break;
          default: dot_rows<QT, RB, 8>(wrow, nb, xt, K, res); break;
        }
        for (int64_t t = 0; t < nt; ++t) out[(t0 + t) * ldo + n] = to_out<O>(res[t]);
      }
    }
  });
}

// ---- the packed layout: 16 rows interleaved ------------------------------------------------------
// quant_pack rearranges a block matrix (same bytes, same count, rows padded to a multiple of 16 with
// zero blocks) so that one vector holds 16 rows: a GEMV then needs no horizontal sums and no per-row
// scalar scale conversions, which is what held the block-layout kernel at about 13 G weights/s,
// compute bound, below what memory delivers. Per group of 16 rows and block b:
//   Q4_0: d[16] (fp16) | qs[4][16][4]       qs[c][r][i] = byte 4c+i of row r's block (weights 4c+i
//   Q4_1: d[16] | m[16] | qs[4][16][4]                    in its low nibble, 4c+i+16 in its high one)
//   Q8_0: d[16] | qs[8][16][4]              qs[c][r][i] = weight 4c+i of row r
// so that each 32-bit lane of a 64-byte vector holds four consecutive bytes of one row: what
// vpdpbusd multiplies against four int8 activations.
// Two ways to compute, by the activations' dtype:
// - fp32: exact products in FMAs, each block's sum scaled once: d * sum(q x) (+ m * sum(x) for
//   Q4_1), the same value as sum((d q + m) x) up to fp32 rounding and summation order;
// - bf16 (AVX512_VNNI): as llama.cpp does, each 32-activation block is rounded to int8 with its own
//   scale (absmax / 127) and meets the weights in integer dot products (exact), then one fp32 scaling
//   a block: the error is the activation rounding, at most half a step (absmax / 254) an element:
//   for the block's largest element about 2^-8 relative (bf16's own rounding: 2^-9), relatively
//   more for small elements beside an outlier.
constexpr int64_t PACKED = 256;  // qtype | PACKED names a packed matrix
constexpr int G = 16;            // rows per group

template <int QT> constexpr int qs_offset() { return QT == Q4_1 ? 64 : 32; }
// where byte j of row r's quants sits in a packed block
constexpr int qs_index(int j, int r) { return (j / 4) * 64 + r * 4 + (j % 4); }

// row `lane` of a packed group's block b back in GGUF block form (for dequantization)
template <int QT>
inline void unpack_block(const uint8_t* group, int64_t b, int lane, uint8_t* blk) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>(), nq = QT == Q8_0 ? 32 : 16;
  const uint8_t* src = group + b * G * bb;
  std::memcpy(blk, src + 2 * lane, 2);
  if constexpr (QT == Q4_1) std::memcpy(blk + 2, src + 32 + 2 * lane, 2);
  uint8_t* q = blk + (QT == Q4_1 ? 4 : 2);
  for (int c = 0; c < nq / 4; ++c) std::memcpy(q + 4 * c, src + qo + qs_index(4 * c, lane), 4);
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

// a packed group's block b back as the 16 rows' GGUF blocks, blk[r * block bytes ...]
template <int QT>
inline void unpack_group_block(const uint8_t* group, int64_t b, uint8_t* blk) {
  for (int r = 0; r < G; ++r) unpack_block<QT>(group, b, r, blk + r * block_bytes<QT>());
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
          for (int c = 0; c < nq / 4; ++c) std::memcpy(dst + qo + qs_index(4 * c, r), q + 4 * c, 4);
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
// Activations as the packed kernels read them, per x row and block: fp32 values and the block's sum
// (in `scale`: Q4_1's offset term), or (int8) the block rounded to int8, its scale and the sum of its
// int8 values (for Q4_0's -8, Q4_1's offset and Q8_0's unsigned shift); a row's values depend on
// that row alone (batch invariance)
struct PackedX {
  const float* f = nullptr;  // fp32 x: the caller's rows themselves, or `fbuf` (bf16 x without VNNI)
  std::vector<float> fbuf, scale;
  std::unique_ptr<int8_t[]> q;
  std::vector<int32_t> qsum;
  std::vector<float> msum;  // scale * qsum (Q4_1's offset term), once a block rather than once per row group
  int64_t nb = 0;
  bool int8 = false;
};

template <typename XT>
PackedX prepare_x(const XT* x, int64_t T, int64_t K, bool int8) {
  PackedX p;
  p.nb = K / QK;
  p.int8 = int8;
  if (!int8) {  // the values, and each block's sum (Q4_1's offset term) in a fixed order
    if constexpr (std::is_same_v<XT, float>) {
      p.f = x;
    } else {
      p.fbuf.resize(T * K);
      for (int64_t i = 0; i < T * K; ++i) p.fbuf[i] = static_cast<float>(x[i]);
      p.f = p.fbuf.data();
    }
    p.scale.resize(T * p.nb);
    for (int64_t i = 0; i < T * p.nb; ++i) {
      float s = 0.f;
      for (int k = 0; k < QK; ++k) s += p.f[i * QK + k];
      p.scale[i] = s;
    }
    return p;
  }
  TORCH_CHECK((std::is_same_v<XT, c10::BFloat16>), "int8 activations are rounded from bf16 ones");
  // not zero-filled: every byte is written below (a prefill step's activations are megabytes)
  p.q.reset(new int8_t[T * K]);
  p.scale.resize(T * p.nb);
  p.qsum.resize(T * p.nb);
  p.msum.resize(T * p.nb);
  // rows in parallel: each row's values are its own
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * p.nb; i < t1 * p.nb; ++i) {
      int32_t s[2];
      p.scale[i] = quantize_block32(reinterpret_cast<const uint16_t*>(x) + i * QK, p.q.get() + i * QK, s);
      p.qsum[i] = s[0] + s[1];
      p.msum[i] = p.scale[i] * static_cast<float>(p.qsum[i]);
    }
  });
  return p;
}

#if defined(__AVX512VNNI__)
// one group of 16 rows against NT int8 x rows: integer dot products a block (exact, so their order is
// free), then per row one fp32 step a block in a fixed order: tot += (d_w d_x) * dot (+ m_w * d_x * sum)
template <int QT, int NT>
inline void packed_group_int8(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>();
  const int64_t nb = x.nb, K = nb * QK;
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  auto xdword = [&](int t, int64_t b, int j) {  // four int8 activations j..j+3, broadcast
    int32_t v;
    std::memcpy(&v, x.q.get() + (t0 + t) * K + b * QK + j, 4);
    return _mm512_set1_epi32(v);
  };
  // the integer sums are exact, so their chains are free: one per x row when there are enough rows to
  // hide vpdpbusd's latency, two otherwise; each starts at the type's offset correction (Q4_0: the
  // weights' -8, Q8_0: the +128 of their unsigned reading, each times sum(x))
  constexpr int CH = NT >= 4 ? 1 : 2;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * G * bb;
    __m512i acc[NT][CH];
    for (int t = 0; t < NT; ++t) {
      const int32_t qs = x.qsum[(t0 + t) * nb + b];
      acc[t][0] = _mm512_set1_epi32(QT == Q4_0 ? -8 * qs : QT == Q8_0 ? -128 * qs : 0);
      if constexpr (CH == 2) acc[t][CH - 1] = _mm512_setzero_si512();
    }
    if constexpr (QT == Q8_0) {
      // vpdpbusd multiplies unsigned by signed bytes: the weights + 128 (their top bit flipped) times x
      for (int c = 0; c < 8; c += 2) {
        const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(blk + qo + c * 64), flip);
        const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(blk + qo + c * 64 + 64), flip);
        for (int t = 0; t < NT; ++t) {
          acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], w0, xdword(t, b, 4 * c));
          acc[t][CH - 1] = _mm512_dpbusd_epi32(acc[t][CH - 1], w1, xdword(t, b, 4 * c + 4));
        }
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + qo + c * 64);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int t = 0; t < NT; ++t) {
          acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], lo, xdword(t, b, 4 * c));
          acc[t][CH - 1] = _mm512_dpbusd_epi32(acc[t][CH - 1], hi, xdword(t, b, 4 * c + 16));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    const __m512 m = QT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32))) : d;
    for (int t = 0; t < NT; ++t) {
      const int64_t xi = (t0 + t) * nb + b;
      const __m512i dot = CH == 2 ? _mm512_add_epi32(acc[t][0], acc[t][CH - 1]) : acc[t][0];
      tot[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale[xi])), _mm512_cvtepi32_ps(dot), tot[t]);
      if constexpr (QT == Q4_1) tot[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.msum[xi]), tot[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}
#endif

// one group of 16 rows against NT fp32 x rows: res[t] = the 16 rows' results for x row t. Two
// accumulator chains per x row whatever NT is (a row's summation order is its own)
template <int QT, int NT>
inline void packed_group_f32(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>();
  const int64_t nb = x.nb, K = nb * QK;
  const __m512 tbl = QT == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * G * bb;
    __m512 acc[NT][2];
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int c = 0; c < (QT == Q8_0 ? 8 : 4); ++c) {
      const __m512i v = _mm512_loadu_si512(blk + qo + c * 64);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * c + i;
        __m512 w0, w1;  // weight j and (Q4) j + 16, or (Q8_0) weight j twice split over both chains
        if constexpr (QT == Q8_0) {
          w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24));
        } else {
          // vpermps reads the low 4 bits of each lane: the byte's low nibble, then its high one
          w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * i), tbl);
          w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * i + 4), tbl);
        }
        for (int t = 0; t < NT; ++t) {
          const float* xb = x.f + (t0 + t) * K + b * QK;
          if constexpr (QT == Q8_0) {
            acc[t][i & 1] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[j]), acc[t][i & 1]);
          } else {
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[j]), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[j + 16]), acc[t][1]);
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    for (int t = 0; t < NT; ++t) tot[t] = _mm512_fmadd_ps(d, _mm512_add_ps(acc[t][0], acc[t][1]), tot[t]);
    if constexpr (QT == Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
      for (int t = 0; t < NT; ++t) tot[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scale[(t0 + t) * nb + b]), tot[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}

template <int QT, int NT>
inline void packed_group(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
#if defined(__AVX512VNNI__)
  if (x.int8) return packed_group_int8<QT, NT>(group, x, t0, res);
#endif
  packed_group_f32<QT, NT>(group, x, t0, res);
}

constexpr int PTILE = 8;  // x rows per pass over a group: 3 vectors each, within the 32 registers

// out = x W^T, or with GLU (W = [gate; up], N/2 rows each, a multiple of 16) out = silu(x G^T) * (x U^T):
// the gate and up groups of the same output columns are computed back to back (store_tile combines them)
template <int QT, typename O, bool GLU>
void packed_linear_impl(const PackedX& x, int64_t T, const uint8_t* w, int64_t N, int64_t group_bytes, O* out, int64_t ldo) {
  const int64_t cols = GLU ? N / 2 : N, groups = (cols + G - 1) / G, up = GLU ? groups * group_bytes : 0;
  // prefill: the weights are swept once per XBLOCK x rows, whose activations then stay in L2 across
  // the groups (all of a 2048 x 8192 prompt's int8 activations are 16 MB)
  constexpr int64_t XBLOCK = 256;
  for (int64_t x0 = 0; x0 < T; x0 += XBLOCK) {
   const int64_t x1 = std::min<int64_t>(T, x0 + XBLOCK);
   at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    __m512 res[PTILE], res_up[GLU ? PTILE : 1];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * group_bytes;
      const int rows = static_cast<int>(std::min<int64_t>(G, cols - g * G));
      for (int64_t t0 = x0; t0 < x1; t0 += PTILE) {
        const int64_t nt = std::min<int64_t>(PTILE, x1 - t0);
        auto run = [&](const uint8_t* grp, __m512* r) {
          switch (nt) {
            case 1: packed_group<QT, 1>(grp, x, t0, r); break;
            case 2: packed_group<QT, 2>(grp, x, t0, r); break;
            case 3: packed_group<QT, 3>(grp, x, t0, r); break;
            case 4: packed_group<QT, 4>(grp, x, t0, r); break;
            case 5: packed_group<QT, 5>(grp, x, t0, r); break;
            case 6: packed_group<QT, 6>(grp, x, t0, r); break;
            case 7: packed_group<QT, 7>(grp, x, t0, r); break;
            default: packed_group<QT, 8>(grp, x, t0, r); break;
          }
        };
        run(group, res);
        if constexpr (GLU) run(group + up, res_up);
        store_tile<GLU>(res, res_up, nt, rows, out + t0 * ldo + g * G, ldo);
      }
    }
   });
  }
}
#endif

// dispatch (qtype, output dtype) to a template instance
template <template <int, typename> class F, typename... A>
void dispatch(int64_t qtype, const at::Tensor& out, A... args) {
  auto go = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    if (out.scalar_type() == at::kFloat) F<QT, float>::run(args..., out.data_ptr<float>());
    else if (out.scalar_type() == at::kBFloat16) F<QT, c10::BFloat16>::run(args..., out.data_ptr<c10::BFloat16>());
    else if (out.scalar_type() == at::kHalf) F<QT, c10::Half>::run(args..., out.data_ptr<c10::Half>());
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
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, int64_t N) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.stride(1) == 1, "weight: 2-D uint8 blocks, rows contiguous");
  TORCH_CHECK(K % QK == 0, "the input size must be a multiple of 32, got ", K);
  TORCH_CHECK(w.size(1) == row_bytes_of(qtype, K), "weight rows hold ", w.size(1), " bytes; type ", qtype, " with ", K,
              " inputs needs ", row_bytes_of(qtype, K));
  const int64_t want = qtype & PACKED ? (N + G - 1) / G : N;
  TORCH_CHECK(w.size(0) == want, "weight has ", w.size(0), " rows; ", N, " outputs need ", want);
}

void check_out(const at::Tensor& out, int64_t rows, int64_t cols) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == cols && out.stride(1) == 1,
              "out must be [", rows, ", ", cols, "] with unit column stride");
}

template <int QT, typename O> struct Linear {
  static void run(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t rb, int64_t ldo, O* out) {
    linear_impl<QT, O>(x, T, K, w, N, rb, out, ldo);
  }
};
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int QT, typename O> struct PackedLinear {
  static void run(const PackedX* x, int64_t T, const uint8_t* w, int64_t N, int64_t rb, int64_t ldo, bool glu, O* out) {
    if (glu) packed_linear_impl<QT, O, true>(*x, T, w, N, rb, out, ldo);
    else packed_linear_impl<QT, O, false>(*x, T, w, N, rb, out, ldo);
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
// write their columns). `glu` (packed only): W = [gate; up] and out = silu(x gate^T) * (x up^T).
static void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t T = x.size(0), K = x.size(1), N = out.dim() == 2 ? out.size(1) * (glu ? 2 : 1) : -1;
  check_weight(w, qtype, K, N);
  check_out(out, T, glu ? N / 2 : N);
  TORCH_CHECK(!glu || ((qtype & PACKED) && out.size(1) % G == 0), "quant_linear_glu: a packed [gate; up] matrix, "
              "each half a multiple of 16 rows");
  if (qtype & PACKED) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const at::Tensor xc = x.contiguous();
    // bf16 activations meet the weights as int8 where the CPU has VNNI; fp32 ones stay exact
#if defined(__AVX512VNNI__)
    const bool int8 = x.scalar_type() == at::kBFloat16;
#else
    const bool int8 = false;
#endif
    const at::Tensor xf = x.scalar_type() == at::kBFloat16 ? xc : xc.to(at::kFloat);  // outlives px
    const PackedX px = x.scalar_type() == at::kBFloat16 ? prepare_x(xc.data_ptr<c10::BFloat16>(), T, K, int8)
                                                            : prepare_x(xf.data_ptr<float>(), T, K, false);
    dispatch<PackedLinear>(qtype & ~PACKED, out, &px, T, w.data_ptr<uint8_t>(), N, w.size(1), out.stride(0), glu);
    return;
#else
    TORCH_CHECK(false, "packed matrices need an AVX-512 build (see packs())");
#endif
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  dispatch<Linear>(qtype, out, xf.data_ptr<float>(), T, K, w.data_ptr<uint8_t>(), N, w.size(1), out.stride(0));
}

void quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out) { linear(x, w, qtype, out, false); }
void quant_linear_glu(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out) { linear(x, w, qtype, out, true); }

// out[n, :] = the dequantized weight row n (prefill GEMMs)
void quant_dequantize(at::Tensor w, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  const int64_t N = out.size(0), K = out.size(1);
  check_weight(w, qtype, K, N);
  check_out(out, N, K);
  dispatch<Dequant>(qtype & ~PACKED, out, w.data_ptr<uint8_t>(), bool(qtype & PACKED), w.size(1),
                    static_cast<const int64_t*>(nullptr), N, K, out.stride(0));
}

// out[i, :] = the dequantized row ids[i] of an [N, K] matrix (embedding lookups: only those rows are read)
void quant_rows(at::Tensor w, int64_t qtype, int64_t N, at::Tensor ids, at::Tensor out) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: 1-D int64");
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  const int64_t K = out.size(1);
  check_weight(w, qtype, K, N);
  check_out(out, ids.size(0), K);
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id ", id[i], " out of [0, ", N, ")");
  dispatch<Dequant>(qtype & ~PACKED, out, w.data_ptr<uint8_t>(), bool(qtype & PACKED), w.size(1), id, ids.size(0), K,
                    out.stride(0));
}

// the packed form of a block matrix [N, row bytes]: [ceil(N / 16), 16 * row bytes] (see PACKED)
at::Tensor quant_pack(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(!(qtype & PACKED), "already packed");
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "weight: 2-D contiguous uint8 blocks");
  const int64_t N = w.size(0), rb = w.size(1);
  TORCH_CHECK(rb % (row_bytes_of(qtype, QK)) == 0, "weight rows of ", rb, " bytes are not whole blocks of type ", qtype);
  at::Tensor out = at::empty({(N + G - 1) / G, rb * G}, w.options());
  switch (qtype) {
    case Q4_0: Pack<Q4_0, float>::run(w.data_ptr<uint8_t>(), N, rb, out.data_ptr<uint8_t>()); break;
    case Q4_1: Pack<Q4_1, float>::run(w.data_ptr<uint8_t>(), N, rb, out.data_ptr<uint8_t>()); break;
    default: Pack<Q8_0, float>::run(w.data_ptr<uint8_t>(), N, rb, out.data_ptr<uint8_t>()); break;
  }
  return out;
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
  // whether prefill-sized steps should dequantize packed weights into a bf16 GEMM rather than take the
  // packed kernel: where oneDNN's bf16 GEMM has AMX tiles (not measured against the kernel; without
  // AMX the kernel was faster at every size measured, up to 2048 rows, fp32 and int8 alike)
  m.def("gemm_prefill", []() { return at::native::cpublas::could_pack(at::kBFloat16); });
  // whether bf16 activations meet packed weights as int8 (AVX512_VNNI), not exact (see PACKED)
  m.def("int8_activations", []() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
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
