// GGUF K-quant weights (Q4_K, Q6_K: the types of the usual Q4_K_M files) computed on directly, built
// on first use by nanoserve/layers/cpu_kernels.py (-march=native unless NANOSERVE_CPU_MARCH says
// otherwise). Same interface and contract as quant_kernels.cpp, for 256-weight super-blocks:
//
// Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks of 32), 128
//   bytes of nibbles (bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c+1 in the high ones);
//   w = (d*sc)*q - dmin*m, each product and the difference rounded to fp32 (no FMA), as gguf does.
// Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per
//   16 weights), fp16 d; w = (d*scale) * (q - 32).
//
// Each super-block is dequantized in registers with exactly that arithmetic, one vector at a time,
// and FMA-ed against x in fp32 (bf16 x is widened once per call): a product differs from "dequantize,
// then matmul in fp32" only in summation order, whatever the output dtype (it is rounded to once, at
// the end). A row's result depends only on its own x row (batch invariance). Code paths by compiler
// flags: AVX-512, else AVX2 + FMA + F16C, else scalar.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

int64_t block_bytes_of(int64_t qtype) {
  TORCH_CHECK(qtype == Q4_K || qtype == Q6_K, "quantized type ", qtype, " has no K-quant kernel (Q4_K=12, Q6_K=14)");
  return qtype == Q4_K ? 144 : 210;
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  const int64_t bb = block_bytes_of(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.dtype() == torch::kUInt8 && w.dim() == 2 && w.stride(1) == 1,
              "weight: 2-D uint8 CPU blocks, rows contiguous");
  TORCH_CHECK(K % QK == 0, "the input size must be a multiple of 256 for K-quants, got ", K);
  TORCH_CHECK(w.size(1) == K / QK * bb, "weight rows hold ", w.size(1), " bytes; type ", qtype, " with ", K,
              " inputs needs ", K / QK * bb);
}

void check_out(const torch::Tensor& out, int64_t rows, int64_t cols) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == rows && out.size(1) == cols &&
              (out.stride(1) == 1 || cols <= 1),
              "out must be a CPU [", rows, ", ", cols, "] tensor with unit column stride");
}

// (qtype, output dtype) -> a template instance
template <typename Run>
void dispatch(int64_t qtype, const torch::Tensor& out, Run&& run) {
  auto by_out = [&](auto qt) {
    switch (out.scalar_type()) {
      case torch::kFloat: run(qt, out.data_ptr<float>()); break;
      case torch::kBFloat16: run(qt, out.data_ptr<c10::BFloat16>()); break;
      case torch::kHalf: run(qt, out.data_ptr<c10::Half>()); break;
      default: TORCH_CHECK(false, "output dtype must be float32, bfloat16 or float16, got ", out.scalar_type());
    }
  };
  if (qtype == Q4_K) by_out(std::integral_constant<int, Q4_K>());
  else by_out(std::integral_constant<int, Q6_K>());
}

}  // namespace

// out[t, n] = sum_k x[t, k] * W[n, k], W given as K-quant super-blocks [N, K/256 * block bytes]; `out`
// may be a column slice of a wider tensor (fused parts of different types each write their columns).
void quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  check_out(out, T, N);
  if (T == 0 || N == 0) return;
  const torch::Tensor xf = x.to(torch::kFloat).contiguous();  // bf16 / fp16 widen exactly, once per call
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldw = w.stride(0), ldo = out.stride(0);
  dispatch(qtype, out, [&](auto qt, auto* o) {
    linear_impl<decltype(qt)::value>(xp, T, K, wp, N, ldw, o, ldo);
  });
}

// out[n, :] = the dequantized weight row n, bit for bit gguf's (prefill GEMMs, embedding rows)
void quant_dequantize(torch::Tensor w, int64_t qtype, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  const int64_t N = w.size(0), K = out.size(1);
  check_weight(w, qtype, K);
  check_out(out, N, K);
  if (N == 0 || K == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldw = w.stride(0), ldo = out.stride(0);
  dispatch(qtype, out, [&](auto qt, auto* o) { dequant_impl<decltype(qt)::value>(wp, N, K, ldw, o, ldo); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("quant_dequantize", &quant_dequantize, py::arg("w"), py::arg("qtype"), py::arg("out"));
  m.def("isa", []() { return std::string(Simd::name()); });
}
