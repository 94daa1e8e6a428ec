// GGUF block-quantized weights of 32 (Q4_0, Q4_1, Q5_0, Q8_0; layouts: quant_blocks.h) computed on
// directly in the block layout, dequantized, and packed (the packed layout's kernels: quant_packed.cpp). A
// block is dequantized with exactly the arithmetic of the gguf package's dequantize (Q4_0/Q5_0/Q8_0: d*q;
// Q4_1: d*q then + m, two roundings, no FMA); with bf16 outputs the block layout's weights are rounded to
// bf16 first, as the prefill GEMM's bf16 copy holds them.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include "quant.h"
#include "quant_blocks.h"

namespace blocks {
namespace {

constexpr int N = QK / QSimd::W;  // vectors per block

// ---- one block of 32 weights -> N fp32 vectors, per instruction set ----------------------------------
// RB: each weight rounded to bf16 (QSimd::bf16)
#if defined(__AVX512F__)
inline V iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
// the 16 values a 4-bit weight can take, by nibble, or (Q5_0) the 16 negative ones of a 5-bit weight's 32
// (the reference's own arithmetic, so the same floats)
template <int QT>
V table(const uint8_t* b) {
  const V d = _mm512_set1_ps(h2f(b));
  if constexpr (QT == Q4_0 || QT == Q5_0)
    return _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(QT == Q4_0 ? 8 : 16)));
  return _mm512_add_ps(_mm512_mul_ps(d, iota16()), _mm512_set1_ps(h2f(b + 2)));
}
template <int QT, bool RB = false>
void decode(const uint8_t* b, V* w) {
  if constexpr (QT == Q8_0) {
    const V d = _mm512_set1_ps(h2f(b));
    for (int i = 0; i < N; ++i) {
      w[i] = _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2 + 16 * i)))));
      if constexpr (RB) w[i] = QSimd::bf16(w[i]);
    }
  } else {
    // A 4-bit weight is one of 16 values: compute those once per block and look each weight up
    // by its nibble (vpermps reads the low 4 bits of each lane: the low nibble as is, the high one
    // after a shift)
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + qs_in_block<QT>())));
    V t = table<QT>(b);
    if constexpr (RB) t = QSimd::bf16(t);
    if constexpr (QT == Q5_0) {
      // 32 values in two tables: vpermt2ps reads 5 bits of each lane, the fifth (qh's) picking the table
      V t1 = _mm512_mul_ps(_mm512_set1_ps(h2f(b)), iota16());
      if constexpr (RB) t1 = QSimd::bf16(t1);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(q, 4),
                    b4 = _mm512_set1_epi32(16);
      const __mmask16 k_lo = static_cast<__mmask16>(qh), k_hi = static_cast<__mmask16>(qh >> 16);
      w[0] = _mm512_permutex2var_ps(t, _mm512_mask_or_epi32(lo, k_lo, lo, b4), t1);
      w[1] = _mm512_permutex2var_ps(t, _mm512_mask_or_epi32(hi, k_hi, hi, b4), t1);
    } else {
      w[0] = _mm512_permutexvar_ps(q, t);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// always inlined: GCC otherwise calls Q5_0's (and the bf16-rounding ones) from the GEMV's inner loop,
// its 4 accumulators spilled around each call (a 2048 x 640 Q5_0 GEMV: 2x the time)
template <int QT, bool RB = false>
__attribute__((always_inline)) inline void decode(const uint8_t* b, V* w) {
  const V d = _mm256_set1_ps(h2f(b));
  if constexpr (QT == Q8_0) {
    for (int i = 0; i < N; ++i)
      w[i] = _mm256_mul_ps(
          d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * i)))));
  } else if constexpr (QT == Q5_0) {
    // the 32 weights as signed bytes q - 16, then as Q8_0's: byte j's fifth bit is qh's byte j / 8 (spread
    // by the shuffle) tested against bit j % 8
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                           _mm256_set1_epi8(16));
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + 6)), m4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_setr_m128i(_mm_and_si128(q, m4), _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    const __m256i v = _mm256_sub_epi8(_mm256_or_si256(nib, fifth), _mm256_set1_epi8(16));
    const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
    for (int i = 0; i < N; ++i) {
      const __m128i part = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
    }
  } else {
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + qs_in_block<QT>())), m4 = _mm_set1_epi8(0x0F);
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
    for (int i = 0; i < N; ++i) w[i] = QSimd::bf16(w[i]);
}
#else
template <int QT, bool RB = false>
void decode(const uint8_t* b, V* w) {
  const float d = h2f(b);
  if constexpr (QT == Q8_0) {
    for (int i = 0; i < QK; ++i) w[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
  } else {
    const uint8_t* qs = b + qs_in_block<QT>();
    const float m = QT == Q4_1 ? h2f(b + 2) : 0.f;
    uint32_t qh = 0;
    if constexpr (QT == Q5_0) std::memcpy(&qh, b + 2, 4);
    for (int i = 0; i < 16; ++i) {
      const int lo = qs[i] & 15, hi = qs[i] >> 4;
      if constexpr (QT == Q5_0) {
        const int f_lo = static_cast<int>((qh >> i) & 1), f_hi = static_cast<int>((qh >> (i + 16)) & 1);
        w[i] = d * static_cast<float>((lo | f_lo << 4) - 16);  // int: unsigned would wrap below 16
        w[i + 16] = d * static_cast<float>((hi | f_hi << 4) - 16);
      } else {
        w[i] = QT == Q4_0 ? d * static_cast<float>(lo - 8) : d * static_cast<float>(lo) + m;
        w[i + 16] = QT == Q4_0 ? d * static_cast<float>(hi - 8) : d * static_cast<float>(hi) + m;
      }
    }
  }
  if constexpr (RB)
    for (int i = 0; i < QK; ++i) w[i] = QSimd::bf16(w[i]);
}
#endif

// res[t] = dot(weight row, x row t) for NT rows of x at once: the row's blocks are dequantized once
// per NT rows. Accumulators: one per vector of a block, so consecutive FMAs do not wait on each other.
// RB (bf16 activations): the weights rounded to bf16 first, as the prefill path's bf16 copy holds
// them, so a token's result does not depend on which path its step took beyond summation order
template <int QT, bool RB, int NT>
inline void dot_rows(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, float* res) {
  constexpr int NA = N < 4 ? N : 4;
  V acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = QSimd::zero();
  V w[N];
  for (int64_t b = 0; b < nb; ++b) {
    decode<QT, RB>(wrow + b * block_bytes<QT>(), w);
    for (int t = 0; t < NT; ++t) {
      const float* xb = x + t * ldx + b * QK;
      for (int i = 0; i < N; ++i)
        acc[t][i % NA] = QSimd::fma(w[i], QSimd::load(xb + i * QSimd::W), acc[t][i % NA]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    V s = acc[t][0];
    for (int a = 1; a < NA; ++a) s = s + acc[t][a];
    res[t] = QSimd::sum(s);
  }
}

constexpr int TILE = 8;  // x rows per pass over a weight row

template <int QT, typename O>
void linear_impl(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N_out, int64_t row_bytes,
                 O* out, int64_t ldo) {
  constexpr bool RB = std::is_same_v<O, c10::BFloat16>;
  block_linear<TILE>(
      T, N_out, w, row_bytes, out, ldo, [&](const uint8_t* wrow, int64_t t0, int64_t nt, float* res) {
        by_rows(nt,
                [&](auto NT) { dot_rows<QT, RB, decltype(NT)::value>(wrow, K / QK, x + t0 * K, K, res); });
      });
}

// ---- the packed layout: 16 rows interleaved (quant_blocks.h) -------------------------------------
// quant_pack rearranges a block matrix (same bytes, same count, rows padded to a multiple of 16 with
// zero blocks) so that one vector holds 16 rows: the block-layout GEMV is held at about 13 G weights/s,
// compute bound, below what memory delivers, by its horizontal sums and per-row scalar scale conversions.

// Q5_0's qh bit j of row r <-> its place in the packed block's hb masks (bit 4r+i of hb[c][h],
// j = 4c+i+16h): byte and bit within the 64 bytes after d
constexpr int hb_byte(int j, int r) { return 32 + 16 * ((j % 16) / 4) + 8 * (j / 16) + (4 * r + j % 4) / 8; }
constexpr int hb_bit(int j, int r) { return (4 * r + j % 4) % 8; }

// row `lane` of a packed group's block b back in GGUF block form (for dequantization)
template <int QT>
inline void unpack_block(const uint8_t* group, int64_t b, int lane, uint8_t* blk) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>(), nq = qs_bytes<QT>();
  const uint8_t* src = group + b * G * bb;
  std::memcpy(blk, src + 2 * lane, 2);
  if constexpr (QT == Q4_1) std::memcpy(blk + 2, src + 32 + 2 * lane, 2);
  if constexpr (QT == Q5_0) {
    uint32_t qh = 0;
    for (int j = 0; j < QK; ++j)
      qh |= static_cast<uint32_t>((src[hb_byte(j, lane)] >> hb_bit(j, lane)) & 1) << j;
    std::memcpy(blk + 2, &qh, 4);
  }
  uint8_t* q = blk + qs_in_block<QT>();
  for (int c = 0; c < nq / 4; ++c) std::memcpy(q + 4 * c, src + qo + qs_index(4 * c, lane), 4);
}

// a dequantized block (N vectors of fp32) stored as 32 values of O
template <typename O>
inline void store_block(O* o, const V* v) {
  for (int j = 0; j < N; ++j) QSimd::store(o + j * QSimd::W, v[j]);
}

template <int QT>
void pack_impl(const uint8_t* w, int64_t N_out, int64_t row_bytes, uint8_t* out) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>(), nq = qs_bytes<QT>();
  const int64_t nb = row_bytes / bb, groups = (N_out + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = out + (g * nb + b) * G * bb;
        std::memset(dst, 0, G * bb);
        for (int r = 0; r < G && g * G + r < N_out; ++r) {
          const uint8_t* src = w + (g * G + r) * row_bytes + b * bb;
          std::memcpy(dst + 2 * r, src, 2);
          if constexpr (QT == Q4_1) std::memcpy(dst + 32 + 2 * r, src + 2, 2);
          if constexpr (QT == Q5_0) {
            uint32_t qh;
            std::memcpy(&qh, src + 2, 4);
            for (int j = 0; j < QK; ++j) dst[hb_byte(j, r)] |= ((qh >> j) & 1) << hb_bit(j, r);
          }
          const uint8_t* q = src + qs_in_block<QT>();
          for (int c = 0; c < nq / 4; ++c) std::memcpy(dst + qo + qs_index(4 * c, r), q + 4 * c, 4);
        }
      }
  });
}

// the whole packed matrix dequantized, a group at a time (prefill GEMMs)
template <int QT, typename O>
void dequant_packed_impl(const uint8_t* w, int64_t group_bytes, int64_t N_out, int64_t K, O* out,
                         int64_t ldo) {
  constexpr int bb = block_bytes<QT>();
  const int64_t nb = K / QK;
  at::parallel_for(0, (N_out + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t blk[G * bb];
    V v[N];
    for (int64_t g = begin; g < end; ++g) {
      const int rows = static_cast<int>(std::min<int64_t>(G, N_out - g * G));
      for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < G; ++r) unpack_block<QT>(w + g * group_bytes, b, r, blk + r * bb);
        for (int r = 0; r < rows; ++r) {
          decode<QT>(blk + r * bb, v);
          store_block(out + (g * G + r) * ldo + b * QK, v);
        }
      }
    }
  });
}

// out[i, :] = the dequantized weight row rows[i] (all rows when `rows` is null), the block-layout
// or the packed matrix alike, with the reference's arithmetic (decode)
template <int QT, typename O>
void dequant_impl(const uint8_t* w, bool packed, int64_t row_bytes, const int64_t* rows, int64_t n_out,
                  int64_t K, O* out, int64_t ldo) {
  constexpr int bb = block_bytes<QT>();
  const int64_t nb = K / QK;
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    uint8_t blk[block_bytes<QT>()];
    V v[N];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = rows ? rows[i] : i;
      O* orow = out + i * ldo;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* src = w + n * row_bytes + b * bb;
        if (packed) {
          unpack_block<QT>(w + n / G * row_bytes, b, static_cast<int>(n % G), blk);
          src = blk;
        }
        decode<QT>(src, v);
        store_block(orow + b * QK, v);
      }
    }
  });
}

int64_t row_bytes_of(int64_t qtype, int64_t K) {
  const int64_t base = qtype & ~PACKED;
  const int64_t bb = base == Q4_0 ? 18 : base == Q4_1 ? 20 : base == Q5_0 ? 22 : base == Q8_0 ? 34 : 0;
  TORCH_CHECK(bb && (qtype == base || qtype == (base | PACKED)), "quantized type ", qtype,
              " has no kernel (Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, each + 256 packed)");
  return K / QK * bb * (qtype & PACKED ? G : 1);
}

// a block matrix [N, row bytes], or a packed one [ceil(N / 16), 16 * row bytes]
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, int64_t N_out) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.stride(1) == 1,
              "weight: 2-D uint8 blocks, rows contiguous");
  TORCH_CHECK(K % QK == 0, "the input size must be a multiple of 32, got ", K);
  TORCH_CHECK(w.size(1) == row_bytes_of(qtype, K), "weight rows hold ", w.size(1), " bytes; type ", qtype,
              " with ", K, " inputs needs ", row_bytes_of(qtype, K));
  const int64_t want = qtype & PACKED ? (N_out + G - 1) / G : N_out;
  TORCH_CHECK(w.size(0) == want, "weight has ", w.size(0), " rows; ", N_out, " outputs need ", want);
}

}  // namespace

// out[t, n] = sum_k x[t, k] * W[n, k], W given as GGUF blocks [N, row_bytes] or packed (qtype + 256);
// `out` may be a column slice of a wider tensor (fused QKV / gate-up parts of different types each
// write their columns). `glu` (packed only): W = [gate; up] and out = silu(x gate^T) * (x up^T).
void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu) {
  const int64_t T = x.size(0), K = x.size(1), N_out = out.dim() == 2 ? out.size(1) * (glu ? 2 : 1) : -1;
  check_weight(w, qtype, K, N_out);
  check_out(out, T, glu ? N_out / 2 : N_out);
  TORCH_CHECK(!glu || ((qtype & PACKED) && out.size(1) % G == 0),
              "quant_linear_glu: a packed [gate; up] matrix, "
              "each half a multiple of 16 rows");
  if (qtype & PACKED) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    packed_linear(prepare_x(x), qtype & ~PACKED, w.data_ptr<uint8_t>(), N_out, w.size(1), out, glu);
    return;
#else
    TORCH_CHECK(false, "packed matrices need an AVX-512 build (see packs())");
#endif
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  by_type(qtype, [&](auto qt) {
    by_out_dtype(out, [&](auto* o) {
      linear_impl<decltype(qt)::value>(xf.data_ptr<float>(), T, K, w.data_ptr<uint8_t>(), N_out, w.size(1), o,
                                       out.stride(0));
    });
  });
}

// out[i, :] = the dequantized row ids[i] of an [N, K] matrix (all rows when ids is null: prefill GEMMs;
// a few rows: embedding lookups read only those)
void dequantize(const at::Tensor& w, int64_t qtype, int64_t N_out, const int64_t* ids, int64_t n,
                const at::Tensor& out) {
  const int64_t K = out.size(1);
  check_weight(w, qtype, K, N_out);
  check_out(out, n, K);
  const bool packed = qtype & PACKED;
  by_type(qtype & ~PACKED, [&](auto qt) {
    by_out_dtype(out, [&](auto* o) {
      constexpr int QT = decltype(qt)::value;
      if (packed && !ids)
        dequant_packed_impl<QT>(w.data_ptr<uint8_t>(), w.size(1), n, K, o, out.stride(0));
      else
        dequant_impl<QT>(w.data_ptr<uint8_t>(), packed, w.size(1), ids, n, K, o, out.stride(0));
    });
  });
}

// the packed form of a block matrix [N, row bytes]: [ceil(N / 16), 16 * row bytes]
at::Tensor pack(const at::Tensor& w, int64_t qtype) {
  const int64_t N_out = w.size(0), rb = w.size(1);
  TORCH_CHECK(rb % (row_bytes_of(qtype, QK)) == 0, "weight rows of ", rb,
              " bytes are not whole blocks of type ", qtype);
  at::Tensor out = at::empty({(N_out + G - 1) / G, rb * G}, w.options());
  by_type(qtype, [&](auto qt) {
    pack_impl<decltype(qt)::value>(w.data_ptr<uint8_t>(), N_out, rb, out.data_ptr<uint8_t>());
  });
  return out;
}

}  // namespace blocks
