// What the quantized-weight kernels share: the GGUF block families' entry points (quant_blocks.cpp and
// quant_packed.cpp: Q4_0, Q4_1, Q5_0, Q8_0; kquants.cpp and kquant_layout.cpp: Q4_K, Q6_K), fp16 scales,
// the fp32 vector operations of each instruction set, and on AVX-512 the packed layout's activations
// (PackedX) and output tiles.
//
// Both families keep a matrix in one of two layouts. The GGUF blocks as they are (AVX2 and scalar builds):
// each block is dequantized in registers with exactly the gguf package's arithmetic, then FMA-ed against
// fp32 x, so a product differs from "dequantize, then matmul in fp32" only in summation order. And the
// packed layout (AVX-512 builds), which the layer uses wherever the build has it: 16 rows interleaved, so
// that one vector holds one weight of 16 rows (no horizontal sums, no per-row scalar scale conversions),
// each 32-bit lane four consecutive quant bytes of one row, what vpdpbusd multiplies against four int8
// activations. Two ways to compute on it, by the activations' dtype:
// - fp32: exact products in FMAs, each block's (or sub-block's) sum scaled once: the reference's value up
//   to fp32 rounding and summation order;
// - bf16 (AVX512_VNNI): as llama.cpp does, each 32-activation block is rounded to int8 with its own scale
//   (absmax / 127) and meets the weights in integer dot products (exact), then fp32 scaling in a fixed
//   order: the error is the activation rounding, at most half a step (absmax / 254) an element.
// A row's result depends only on its own x row (batch invariance). One code path per build, chosen by
// the compiler flags: AVX-512, else AVX2 + FMA + F16C, else scalar.
#pragma once
#include <ATen/core/Tensor.h>
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

constexpr int64_t PACKED = 256;  // qtype | PACKED names a packed matrix
constexpr int G = 16;            // rows per group of the packed layout
constexpr int XB = 32;           // activations per int8 block
// where byte j of row r's quants sits in a packed block
constexpr int qs_index(int j, int r) { return (j / 4) * 64 + r * 4 + (j % 4); }

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; c10's portable conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// ---- fp32 vectors of the build's widest kind, as the dequantizing kernels use them --------------------
#if defined(__AVX512F__)
struct QSimd {
  using V = __m512;
  static constexpr int W = 16;  // lanes
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
    __m512i r = _mm512_add_epi32(
        b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                            _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC00000));  // NaN as c10's
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // to the nearest bf16 (ties to even) and back: what a bf16 copy of the weight holds
  static V bf16(V v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct QSimd {
  using V = __m256;
  static constexpr int W = 8;
  static const char* name() { return "avx2"; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store(c10::Half* p, V v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(c10::BFloat16* p, V v) {  // nearest even, NaN as c10's
    const __m256i b = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(
        b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                            _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    _mm_storeu_si128((__m128i*)p,
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
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
};
#else
struct QSimd {
  using V = float;
  static constexpr int W = 1;
  static const char* name() { return "scalar"; }
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  template <typename O>
  static void store(O* p, V v) {
    *p = static_cast<O>(v);
  }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static float sum(V v) { return v; }
  static V bf16(V v) { return static_cast<float>(c10::BFloat16(v)); }
};
#endif
using V = QSimd::V;

// f(out's data) for out's dtype: float32, bfloat16 or float16
template <typename F>
void by_out_dtype(const at::Tensor& out, F&& f) {
  switch (out.scalar_type()) {
    case at::kFloat: f(out.data_ptr<float>()); break;
    case at::kBFloat16: f(out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: f(out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "output dtype must be float32, bfloat16 or float16, got ", out.scalar_type());
  }
}

void check_out(const at::Tensor& out, int64_t rows, int64_t cols);

// out[t, n] of a block-layout matrix, its rows n (the output columns) split over the threads, TILE x rows at
// a time: dot(weight row n, first x row, rows, res) sets res[0, rows)
template <int TILE, typename O, typename Dot>
void block_linear(int64_t T, int64_t N, const uint8_t* w, int64_t ldw, O* out, int64_t ldo, Dot&& dot) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float res[TILE];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t nt = std::min<int64_t>(TILE, T - t0);
        dot(w + n * ldw, t0, nt, res);
        for (int64_t t = 0; t < nt; ++t) out[(t0 + t) * ldo + n] = static_cast<O>(res[t]);
      }
  });
}

// f(std::integral_constant<int, NT>()) for the pass's row count nt in [1, 8]: NT accumulators in registers
template <typename F>
inline void by_rows(int64_t nt, F&& f) {
  switch (nt) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

// ---- the families' entry points (quant.cpp routes by type) ----------------------------------------------
// linear: out = x W^T, or with glu (W = [gate; up]) silu(x gate^T) * (x up^T); dequantize: out[i, :] = row
// ids[i] of an [N, K] matrix (every row when ids is null); pack: the packed form of a block matrix
namespace blocks {
// Q4_0, Q4_1, Q5_0, Q8_0
constexpr bool has(int64_t base) { return base == 2 || base == 3 || base == 6 || base == 8; }
void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu);
void dequantize(const at::Tensor& w, int64_t qtype, int64_t N, const int64_t* ids, int64_t n,
                const at::Tensor& out);
at::Tensor pack(const at::Tensor& w, int64_t qtype);
}  // namespace blocks
namespace kquants {
constexpr bool has(int64_t base) { return base == 12 || base == 14; }  // Q4_K, Q6_K
void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu);
void dequantize(const at::Tensor& w, int64_t qtype, int64_t N, const int64_t* ids, int64_t n,
                const at::Tensor& out);
at::Tensor pack(const at::Tensor& w, int64_t qtype);
}  // namespace kquants

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 32 bf16 activations (their bits) rounded to int8 with their own scale, absmax / 127, as llama.cpp's
// Q8 blocks (vcvtps2dq rounds to nearest even, as nearbyint does in the default rounding mode). Returns
// the scale; sums[i] = the int8 values' sum of each 16. The packed kernels' activations, a block at a
// time; 7% of an 8192-token prefill's CPU time before it lost its cross-lane widening, clamps and two of
// its three horizontal reductions (the sums now in SAD)
inline float quantize_block32(const uint16_t* x, int8_t* q, int32_t sums[2]) {
  const __m512i raw = _mm512_loadu_si512(x);
  // each 32-bit lane holds elements 2i, 2i+1: the even one as fp32 once shifted up, the odd one once
  // its low half is cleared
  const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  const __m512 od =
      _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(ev), _mm512_abs_ps(od)));
  const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // |x| <= amax, so |x| * fl(127 / amax) rounds to at most 127: no clamp
  const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(ev, id)),
                qo = _mm512_cvtps_epi32(_mm512_mul_ps(od, id));
  // the two bytes of each lane back in element order, then 16 lanes' low words = the 32 bytes
  const __m256i bytes = _mm512_cvtepi32_epi16(
      _mm512_or_si512(_mm512_and_si512(qe, _mm512_set1_epi32(0xFF)), _mm512_slli_epi32(qo, 8)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  // each 8 bytes' sum, read unsigned (+128 each)
  const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80))),
                                      _mm256_setzero_si256());
  const __m128i lo = _mm256_castsi256_si128(sad), hi = _mm256_extracti128_si256(sad, 1);
  sums[0] = static_cast<int32_t>(_mm_cvtsi128_si64(lo) + _mm_extract_epi64(lo, 1)) - 16 * 128;
  sums[1] = static_cast<int32_t>(_mm_cvtsi128_si64(hi) + _mm_extract_epi64(hi, 1)) - 16 * 128;
  return amax / 127.f;
}

// Activations as the packed kernels read them, per x row and 32-block: fp32 values and the block's sum (the
// offset terms: Q4_1's m, Q4_K's min), or (int8) the block rounded to int8, its scale, and its int8 values'
// sums (for Q4_0's -8, Q5_0's -16, Q4_1's and Q4_K's offsets, Q8_0's unsigned shift, Q6_K's -32); a row's
// values depend on that row alone (batch invariance)
struct PackedX {
  at::Tensor src;            // the activations, fp32 or bf16, contiguous (kept alive for f)
  const float* f = nullptr;  // fp32 x: src's rows themselves, or fbuf (bf16 x without VNNI)
  std::vector<float> fbuf;
  std::vector<float> sum;    // [T * K / 32] fp32: the block's sum; int8: scale * the int8 values' sum
  std::vector<float> scale;  // [T * K / 32] int8: the block's scale
  std::unique_ptr<int8_t[]> q;
  std::vector<int32_t> qsum;  // [T * K / 16] int8: the int8 values' sum of each 16
  int64_t K = 0, nb = 0;      // nb: 32-blocks a row
  bool int8 = false;
};

// x (fp32, bf16 or fp16) for the packed kernels: bf16 meets the weights as int8 where the CPU has VNNI
PackedX prepare_x(const at::Tensor& x);

// A packed kernel's tile: res[t] holds 16 output columns of x row t, `rows` of them real. Stored as O,
// with GLU first combined with the up projection's tile: silu(gate) * up in fp32, rounded once (unfused,
// gate and up would each be rounded, written, and read back)
template <bool GLU, typename O>
inline void store_tile(__m512* res, const __m512* res_up, int64_t nt, int rows, O* out, int64_t ldo) {
  alignas(64) float lane[16];
  for (int64_t t = 0; t < nt; ++t) {
    if constexpr (GLU) res[t] = _mm512_mul_ps(silu16(res[t]), res_up[t]);
    _mm512_store_ps(lane, res[t]);
    for (int r = 0; r < rows; ++r) out[t * ldo + r] = static_cast<O>(lane[r]);
  }
}

#endif
