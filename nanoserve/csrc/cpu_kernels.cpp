// nanoserve's C++ CPU kernels, built on first use by nanoserve/layers/cpu_kernels.py
// (torch.utils.cpp_extension, -march=native; cached by a hash of this file, the CPU flags and torch).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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
// round to the storage dtype and back: what an eager op's result holds
static inline __m512 round16(c10::BFloat16*, __m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
static inline __m512 round16(float*, __m512 v) { return v; }
static inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <typename T> constexpr bool kVec16 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
#endif

// q [nd, h, d]; cache [N, layers, 2, kh, bs, d] (contiguous); tables [nd, max_blocks]; ctx [nd]
template <typename T, int64_t d>
static torch::Tensor decode(const torch::Tensor& q, const torch::Tensor& cache, int64_t layer,
                            const torch::Tensor& tables, const torch::Tensor& ctx, float scale) {
  const int64_t nd = q.size(0), h = q.size(1);
  const int64_t layers = cache.size(1), kh = cache.size(3), bs = cache.size(4), g = h / kh;
  const int64_t max_blocks = tables.size(1), block_stride = layers * 2 * kh * bs * d;
  const int64_t layer_off = layer * 2 * kh * bs * d, v_off = kh * bs * d;
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const T* kv = cache.data_ptr<T>();
  const int64_t width = max_blocks * bs;
  auto scores = torch::full({nd * kh, g, width}, -std::numeric_limits<float>::infinity(),
                            torch::dtype(torch::kFloat));
  float* sc = scores.data_ptr<float>();
  at::parallel_for(0, nd * kh, 1, [&](int64_t begin, int64_t end) {  // pass 1: scaled q.k
    std::vector<float> qf(g * d), blk(bs * d);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / kh, hk = i % kh, n = lens[s];
      to_float(qp + (s * h + hk * g) * d, qf.data(), g * d);
      for (int64_t x = 0; x < g * d; ++x) qf[x] *= scale;
#if defined(__AVX512F__)
      if (g <= 8) {  // K rows read straight into registers, each shared by the g query heads
        constexpr int64_t V = d / 16;
        __m512 qv[8][V];
        for (int64_t j = 0; j < g; ++j)
          for (int64_t c = 0; c < V; ++c) qv[j][c] = _mm512_loadu_ps(qf.data() + j * d + c * 16);
        for (int64_t t = 0; t < n; ++t) {
          const T* k = kv + tab[s * max_blocks + t / bs] * block_stride + layer_off + (hk * bs + t % bs) * d;
          __m512 kr[V];
          for (int64_t c = 0; c < V; ++c) kr[c] = load16(k + c * 16);
          for (int64_t j = 0; j < g; ++j) {
            __m512 a = _mm512_mul_ps(qv[j][0], kr[0]);
            for (int64_t c = 1; c < V; ++c) a = _mm512_fmadd_ps(qv[j][c], kr[c], a);
            sc[(i * g + j) * width + t] = _mm512_reduce_add_ps(a);
          }
        }
        continue;
      }
#endif
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
    }
  });
  scores = scores.softmax(-1);  // ATen's vectorized softmax; masked tail -> 0
  sc = scores.data_ptr<float>();
  auto out = torch::empty_like(q);
  T* op = out.data_ptr<T>();
  at::parallel_for(0, nd * kh, 1, [&](int64_t begin, int64_t end) {  // pass 2: probabilities x V
    std::vector<float> acc(g * d), blk(bs * d);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / kh, hk = i % kh, n = lens[s];
#if defined(__AVX512F__)
      if (g <= 8) {  // accumulators stay in registers across the whole context
        constexpr int64_t V = d / 16;
        __m512 av[8][V];
        for (int64_t j = 0; j < g; ++j)
          for (int64_t c = 0; c < V; ++c) av[j][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; ++t) {
          const T* v = kv + tab[s * max_blocks + t / bs] * block_stride + layer_off + v_off + (hk * bs + t % bs) * d;
          __m512 vr[V];
          for (int64_t c = 0; c < V; ++c) vr[c] = load16(v + c * 16);
          for (int64_t j = 0; j < g; ++j) {
            const __m512 p = _mm512_set1_ps(sc[(i * g + j) * width + t]);
            for (int64_t c = 0; c < V; ++c) av[j][c] = _mm512_fmadd_ps(p, vr[c], av[j][c]);
          }
        }
        for (int64_t j = 0; j < g; ++j)
          for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(acc.data() + j * d + c * 16, av[j][c]);
        T* o = op + (s * h + hk * g) * d;
        for (int64_t x = 0; x < g * d; ++x) o[x] = static_cast<T>(acc[x]);
        continue;
      }
#endif
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
      T* o = op + (s * h + hk * g) * d;
      for (int64_t x = 0; x < g * d; ++x) o[x] = static_cast<T>(acc[x]);
    }
  });
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache, int64_t layer, torch::Tensor tables,
                                     torch::Tensor ctx, double scale) {
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && tables.is_contiguous() && ctx.is_contiguous());
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && tables.scalar_type() == torch::kLong &&
              ctx.scalar_type() == torch::kLong);
  TORCH_CHECK(cache.dim() == 6 && cache.size(5) == q.size(2) && q.size(1) % cache.size(3) == 0 &&
              layer >= 0 && layer < cache.size(1) && tables.size(0) == q.size(0) && ctx.size(0) == q.size(0));
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "paged_decode_attention: head_dim 64 or 128 only");
  const bool d64 = q.size(2) == 64;
  switch (q.scalar_type()) {
    case torch::kBFloat16: return d64 ? decode<c10::BFloat16, 64>(q, cache, layer, tables, ctx, scale)
                                      : decode<c10::BFloat16, 128>(q, cache, layer, tables, ctx, scale);
    case torch::kHalf: return d64 ? decode<c10::Half, 64>(q, cache, layer, tables, ctx, scale)
                                  : decode<c10::Half, 128>(q, cache, layer, tables, ctx, scale);
    case torch::kFloat: return d64 ? decode<float, 64>(q, cache, layer, tables, ctx, scale)
                                   : decode<float, 128>(q, cache, layer, tables, ctx, scale);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype");
  }
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
torch::Tensor add_rms_norm(c10::optional<torch::Tensor> x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous() && residual.dim() == 2 &&
              weight.numel() == residual.size(1) && weight.scalar_type() == residual.scalar_type());
  if (x.has_value()) TORCH_CHECK(x->is_contiguous() && x->sizes() == residual.sizes() &&
                                 x->scalar_type() == residual.scalar_type());
  auto out = torch::empty_like(residual);
  const int64_t rows = residual.size(0), n = residual.size(1);
  switch (residual.scalar_type()) {
#define NS_CASE(K, T) case K: add_rms_norm_rows<T>(x.has_value() ? x->data_ptr<T>() : nullptr, \
    residual.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), rows, n, static_cast<float>(eps)); break;
    NS_CASE(torch::kBFloat16, c10::BFloat16)
    NS_CASE(torch::kHalf, c10::Half)
    NS_CASE(torch::kFloat, float)
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

void rope_(torch::Tensor qkv, int64_t heads, int64_t d, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && qkv.dim() == 2 &&
              heads * d <= qkv.size(1) && cos.numel() == qkv.size(0) * (d / 2) && sin.numel() == cos.numel() &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type());
  switch (qkv.scalar_type()) {
#define NS_CASE(K, T) case K: rope_rows<T>(qkv.data_ptr<T>(), qkv.size(1), cos.data_ptr<T>(), sin.data_ptr<T>(), \
    qkv.size(0), heads, d); break;
    NS_CASE(torch::kBFloat16, c10::BFloat16)
    NS_CASE(torch::kHalf, c10::Half)
    NS_CASE(torch::kFloat, float)
#undef NS_CASE
    default: TORCH_CHECK(false, "rope_: unsupported dtype");
  }
}

// The step's new K and V rows [T, kh, d] (row stride free, heads contiguous) into their cache slots:
// one call instead of two index_put.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor cache, int64_t layer, torch::Tensor blocks,
              torch::Tensor offsets) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 6 && blocks.is_contiguous() && offsets.is_contiguous() &&
              blocks.scalar_type() == torch::kLong && offsets.scalar_type() == torch::kLong);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_", &rope_);
  m.def("write_kv", &write_kv);
#if defined(__AVX512F__)
  m.attr("vectorized") = true;   // the norm and RoPE kernels run 16 lanes at a time (bf16, fp32)
#else
  m.attr("vectorized") = false;  // element by element: only worth it on decode-sized batches
#endif
}
