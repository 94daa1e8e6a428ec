// The decoder layer's elementwise steps, each one pass instead of several small eager ops (a decode step
// of a small model is as much per-op overhead as math): the residual add fused with the RMSNorm after it,
// RoPE in place, and the step's K/V rows written into their cache slots.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <vector>
#include "kernels.h"
#include "vec.h"

namespace {

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
          const __m512 inv =
              _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
          T* oi = out + i * n;
          for (int64_t c = 0; c < n; c += 16)
            store16(oi + c, _mm512_mul_ps(load16(w + c),
                                          round16(oi, _mm512_mul_ps(_mm512_loadu_ps(r.data() + c), inv))));
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
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < n; ++c) ss += r[c] * r[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* oi = out + i * n;
      for (int64_t c = 0; c < n; ++c)
        oi[c] = static_cast<T>(static_cast<float>(w[c]) * static_cast<float>(static_cast<T>(r[c] * inv)));
    }
  });
}

// Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, width] (Q and K
// heads, contiguous), with cos/sin [T, d/2]. Every product and sum is rounded to the dtype as the
// eager `x1*cos - x2*sin` would be, so it is bit-exact with the torch path.
template <typename T>
static void rope_rows(T* x, int64_t width, const T* cos, const T* sin, int64_t tokens, int64_t heads,
                      int64_t d) {
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
              const __m512 x1 = load16(p + i), x2 = load16(p + i + half), ci = load16(c + i),
                           si = load16(sn + i);
              store16(p + i,
                      _mm512_sub_ps(round16(p, _mm512_mul_ps(x1, ci)), round16(p, _mm512_mul_ps(x2, si))));
              store16(p + i + half,
                      _mm512_add_ps(round16(p, _mm512_mul_ps(x2, ci)), round16(p, _mm512_mul_ps(x1, si))));
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

}  // namespace

// x may be undefined (no add: just the norm of residual)
at::Tensor add_rms_norm(c10::optional<at::Tensor> x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous() && residual.dim() == 2 &&
              weight.numel() == residual.size(1) && weight.scalar_type() == residual.scalar_type());
  if (x.has_value())
    TORCH_CHECK(x->is_contiguous() && x->sizes() == residual.sizes() &&
                x->scalar_type() == residual.scalar_type());
  auto out = at::empty_like(residual);
  const int64_t rows = residual.size(0), n = residual.size(1);
  switch (residual.scalar_type()) {
#define NS_CASE(K, T)                                                                                \
  case K:                                                                                            \
    add_rms_norm_rows<T>(x.has_value() ? x->data_ptr<T>() : nullptr, residual.data_ptr<T>(),         \
                         weight.data_ptr<T>(), out.data_ptr<T>(), rows, n, static_cast<float>(eps)); \
    break;
    NS_CASE(at::kBFloat16, c10::BFloat16)
    NS_CASE(at::kHalf, c10::Half)
    NS_CASE(at::kFloat, float)
#undef NS_CASE
    default: TORCH_CHECK(false, "add_rms_norm: unsupported dtype");
  }
  return out;
}

void rope_(at::Tensor qkv, int64_t heads, int64_t d, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && qkv.dim() == 2 &&
              heads * d <= qkv.size(1) && cos.numel() == qkv.size(0) * (d / 2) &&
              sin.numel() == cos.numel() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type());
  switch (qkv.scalar_type()) {
#define NS_CASE(K, T)                                                                                      \
  case K:                                                                                                  \
    rope_rows<T>(qkv.data_ptr<T>(), qkv.size(1), cos.data_ptr<T>(), sin.data_ptr<T>(), qkv.size(0), heads, \
                 d);                                                                                       \
    break;
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
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 6 && blocks.is_contiguous() &&
              offsets.is_contiguous() && blocks.scalar_type() == at::kLong &&
              offsets.scalar_type() == at::kLong);
  const int64_t n = k.size(0), kh = cache.size(3), bs = cache.size(4), d = cache.size(5);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == kh && k.size(2) == d && k.stride(2) == 1 &&
              k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d && blocks.numel() == n &&
              offsets.numel() == n && k.scalar_type() == cache.scalar_type() &&
              v.scalar_type() == cache.scalar_type() && layer >= 0 && layer < cache.size(1));
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
