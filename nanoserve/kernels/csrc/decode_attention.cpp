// Decode attention over the paged cache: one query token per sequence, its KV blocks read in place, two
// passes (scores, softmax, weighted V) accumulating in fp32 (bf16: both passes' products in VDPBF16PS,
// the probabilities rounded to bf16 for the second). A layer with a sliding window reads only the window's
// keys: a long context costs what the window does.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <limits>
#include <vector>
#include "kernels.h"
#include "vec.h"

namespace {

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
// f(rows, next, t0, count) for each block holding keys [lo, n) of a sequence's context (rows of `row`
// elements), in order: the first of those keys' rows in the block, the next block's first row (the block
// itself for the last, so that prefetches stay in the sequence's own blocks), the first key's index from
// lo and the key count. Blocks wholly before lo (out of a sliding window) are never touched. A plain loop
// a block: a row walker's per-key branches kept the kernels' accumulators on the stack
template <typename T, typename F>
static inline void for_blocks(const T* base, const int64_t* table, int64_t stride, int64_t bs, int64_t row,
                              int64_t lo, int64_t n, F&& f) {
  const int64_t blocks = (n + bs - 1) / bs;
  for (int64_t b = lo / bs; b < blocks; ++b) {
    const int64_t t0 = std::max(lo, b * bs);
    const T* rows = base + table[b] * stride + (t0 - b * bs) * row;
    f(rows, b + 1 < blocks ? base + table[b + 1] * stride : rows, t0 - lo, std::min((b + 1) * bs, n) - t0);
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
// reload around every VDPBF16PS (1.6x slower in L3). acc [G][D] gets the fp32 sums of keys [first, n), whose
// probabilities start at pb.
template <int G, int64_t D>
__attribute__((noinline)) static void pv_pairs(const c10::BFloat16* vbase, const int64_t* table,
                                               int64_t stride, int64_t bs, int64_t first, int64_t n,
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
    for_blocks(vbase + 32 * c0, table, stride, bs, D, first, n,
               [&](const c10::BFloat16* rows, const c10::BFloat16* next, int64_t t0, int64_t cnt) {
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
__attribute__((noinline)) static void qk_heads(const c10::BFloat16* q, int64_t g, const c10::BFloat16* kbase,
                                               const int64_t* table, int64_t stride, int64_t bs, int64_t lo,
                                               int64_t n, float scale, float* sc, int64_t width) {
  constexpr int W = D / 32;
  const __m512 sv = _mm512_set1_ps(scale);
  for_blocks(kbase, table, stride, bs, D, lo, n,
             [&](const c10::BFloat16* rows, const c10::BFloat16* next, int64_t t0, int64_t in_block) {
               for (int64_t u0 = 0; u0 < in_block; u0 += 16) {
                 const int64_t cnt = std::min<int64_t>(16, in_block - u0);
                 const c10::BFloat16* ahead =
                     u0 + 32 <= in_block ? rows + (u0 + 16) * D : next;  // the next 16 keys, or near
                 const c10::BFloat16* k[16];
                 for (int u = 0; u < 16; ++u) {
                   k[u] = rows + (u0 + std::min<int64_t>(u, cnt - 1)) *
                                     D;  // past the end: the last key again, dropped below
                   prefetch_row(ahead + u * D, D * 2);
                 }
                 for (int64_t j = 0; j < g; ++j) {
                   __m512bh qh[W];
                   for (int c = 0; c < W; ++c)
                     qh[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + j * D + c * 32));
                   __m512 part[16];
                   for (int u = 0; u < 16; ++u) {
                     part[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0],
                                                reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[u])));
                     for (int c = 1; c < W; ++c)
                       part[u] = _mm512_dpbf16_ps(
                           part[u], qh[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[u] + c * 32)));
                   }
                   _mm512_mask_storeu_ps(sc + j * width + t0 + u0, static_cast<__mmask16>((1u << cnt) - 1),
                                         _mm512_mul_ps(hsum16(part), sv));
                 }
               }
             });
}
#endif

#if defined(NS_LANES)
// sc[j * width + t] = q_j . k_t (q already scaled, fp32 [g, D]) for g query heads sharing a KV head:
// Lanes::N keys at a time, one horizontal-sum tree for all of them, blocks walked as qk_heads does
template <typename T, int64_t D>
__attribute__((noinline)) static void qk_lanes(const float* q, int64_t g, const T* kbase,
                                               const int64_t* table, int64_t stride, int64_t bs, int64_t lo,
                                               int64_t n, float* sc, int64_t width) {
  using L = Lanes;
  constexpr int N = L::N, C = D / N;
  for_blocks(kbase, table, stride, bs, D, lo, n,
             [&](const T* rows, const T* next, int64_t t0, int64_t in_block) {
    for (int64_t u0 = 0; u0 < in_block; u0 += N) {
      const int64_t cnt = std::min<int64_t>(N, in_block - u0);
      const T* ahead = u0 + 2 * N <= in_block ? rows + (u0 + N) * D : next;
      const T* k[N];
      // past the end: the last key again, dropped below
      for (int u = 0; u < N; ++u) k[u] = rows + (u0 + std::min<int64_t>(u, cnt - 1)) * D;
      // the next N rows are asked for a few at a time, spread over every (head, chunk) step: all at
      // once (64 lines for fp32 rows) made q.k ~1.3x slower when the K/V come from memory (-DNS_PHASE_TIMES)
      const int64_t spread = g * C;
      for (int64_t j = 0; j < g; ++j) {
        typename L::V part[N];
        for (int c = 0; c < C; ++c) {
          for (int64_t u = j * C + c; u < N; u += spread) prefetch_row(ahead + u * D, D * sizeof(T));
          const typename L::V qc = L::load(q + j * D + c * N);
          for (int u = 0; u < N; ++u)
            part[u] = c ? L::fmadd(qc, L::load(k[u] + c * N), part[u]) : L::mul(qc, L::load(k[u]));
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
__attribute__((noinline)) static void pv_lanes(const T* vbase, const int64_t* table, int64_t stride,
                                               int64_t bs, int64_t lo, int64_t n, const float* p,
                                               int64_t pstride, float* acc) {
  using L = Lanes;
  constexpr int N = L::N, C = D / N;
  constexpr int WC = (G + 1) * 8 + 1 <= L::REGS && C % 8 == 0   ? 8
                     : (G + 1) * 4 + 1 <= L::REGS && C % 4 == 0 ? 4
                     : (G + 1) * 2 + 1 <= L::REGS               ? 2
                                                                : 1;
  for (int c0 = 0; c0 < C; c0 += WC) {
    typename L::V av[G][WC];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < WC; ++c) av[j][c] = L::zero();
    for_blocks(vbase + c0 * N, table, stride, bs, D, lo, n,
               [&](const T* rows, const T* next, int64_t t0, int64_t in_block) {
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

// One decode step of one layer: rows = (sequence, KV head) pairs, each with g query heads
template <typename T>
struct DecodeJob {
  const T* q;
  int64_t q_row;  // q's row stride (a view of the fused QKV output)
  PagedLayer<T> kv;
  int64_t seqs, g, max_blocks;
  const int64_t* tables;  // [seqs, max_blocks]
  const int64_t* lens;    // [seqs] context lengths
  float scale;
  int64_t window;  // keys a query sees, itself included (0: all of its context)
  // [seqs * kh, g, width]: a row's entry t is key first(s) + t's score, then probability (its first
  // lens[s] - first(s) entries are written by pass 1 and read by pass 2; the rest never)
  float* sc;
  int64_t width;  // max_blocks * bs, or the window where that is smaller
  T* out;         // [seqs, kh * g, d]
  // sequence s's first visible key: the decode token at lens[s] - 1 sees the window's last keys
  int64_t first(int64_t s) const { return window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0; }
};

#if !defined(NS_LANES)
// the scalar build's pass 1 for one row: blocks converted to fp32, then one dot product a key
template <typename T>
static void scores_scalar(const DecodeJob<T>& job, int64_t s, int64_t hk, const float* qf, float* blk,
                          float* sc) {
  const PagedLayer<T>& kv = job.kv;
  const int64_t bs = kv.bs, d = kv.d;
  for_blocks(kv.k + hk * bs * d, job.tables + s * job.max_blocks, kv.block_stride, bs, d, job.first(s),
             job.lens[s], [&](const T* rows, const T*, int64_t t0, int64_t cnt) {
               to_float(rows, blk, cnt * d);
               for (int64_t j = 0; j < job.g; ++j) {
                 const float* qj = qf + j * d;
                 float* out = sc + j * job.width + t0;
                 for (int64_t t = 0; t < cnt; ++t) {
                   const float* k = blk + t * d;
                   float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                   for (int64_t x = 0; x < d; ++x) dot += qj[x] * k[x];
                   out[t] = dot;
                 }
               }
             });
}

// the scalar build's pass 2 for one row
template <typename T>
static void values_scalar(const DecodeJob<T>& job, int64_t s, int64_t hk, float* blk, float* acc) {
  const PagedLayer<T>& kv = job.kv;
  const int64_t bs = kv.bs, d = kv.d, i = s * kv.kh + hk;
  std::fill(acc, acc + job.g * d, 0.f);
  for_blocks(kv.k + kv.v_off + hk * bs * d, job.tables + s * job.max_blocks, kv.block_stride, bs, d,
             job.first(s), job.lens[s], [&](const T* rows, const T*, int64_t t0, int64_t cnt) {
               to_float(rows, blk, cnt * d);
               for (int64_t j = 0; j < job.g; ++j) {
                 const float* p = job.sc + (i * job.g + j) * job.width + t0;
                 float* aj = acc + j * d;
                 for (int64_t t = 0; t < cnt; ++t) {
                   const float pt = p[t];
                   const float* v = blk + t * d;
#pragma omp simd
                   for (int64_t x = 0; x < d; ++x) aj[x] += pt * v[x];
                 }
               }
             });
}
#endif

// pass 1: the scaled q.k of every row's keys
template <typename T, int64_t D>
static void scores_pass(const DecodeJob<T>& job) {
  const PagedLayer<T>& kv = job.kv;
  const int64_t g = job.g, kh = kv.kh, bs = kv.bs;
  at::parallel_for(0, job.seqs * kh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * D);
#if !defined(NS_LANES)
    std::vector<float> blk(bs * D);  // the scalar fallback's rows in fp32
#endif
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / kh, hk = i % kh, n = job.lens[s], lo = job.first(s);
      const T* q = job.q + s * job.q_row + hk * g * D;
      const int64_t* table = job.tables + s * job.max_blocks;
      float* sc = job.sc + i * g * job.width;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        qk_heads<D>(q, g, kv.k + hk * bs * D, table, kv.block_stride, bs, lo, n, job.scale, sc, job.width);
        continue;
      }
#endif
      to_float(q, qf.data(), g * D);
      for (int64_t x = 0; x < g * D; ++x) qf[x] *= job.scale;
#if defined(NS_LANES)
      qk_lanes<T, D>(qf.data(), g, kv.k + hk * bs * D, table, kv.block_stride, bs, lo, n, sc, job.width);
#else
      scores_scalar(job, s, hk, qf.data(), blk.data(), sc);
#endif
    }
  });
}

#if defined(__AVX512BF16__)
// bf16: pv_pairs (two keys a VDPBF16PS, bf16 probabilities): half the instructions of widening V to
// fp32 and an FMA per key, which made this pass 2/3 of the kernel
template <int64_t D>
static void values_pairs(const DecodeJob<c10::BFloat16>& job, int64_t i, std::vector<uint16_t>& pb,
                         float* acc) {
  const PagedLayer<c10::BFloat16>& kv = job.kv;
  const int64_t g = job.g, s = i / kv.kh, hk = i % kv.kh, n = job.lens[s], lo = job.first(s);
  const int64_t np = n - lo;  // pv_pairs pairs keys within a block, so nothing past n is read
  pb.resize(g * np);
  for (int64_t j = 0; j < g; ++j) {
    const float* pr = job.sc + (i * g + j) * job.width;
    int64_t t = 0;
    for (; t + 16 <= np; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + j * np + t),
                          bf16_packed(_mm512_loadu_ps(pr + t)));
    for (; t < np; ++t) pb[j * np + t] = c10::BFloat16(pr[t]).x;
  }
  by_head_chunks(g, [&](int64_t j0, auto G) {
    pv_pairs<decltype(G)::value, D>(kv.k + kv.v_off + hk * kv.bs * D, job.tables + s * job.max_blocks,
                                    kv.block_stride, kv.bs, lo, n, pb.data() + j0 * np, np, acc + j0 * D);
  });
}
#endif

// pass 2: each row's probabilities times its values, into out
template <typename T, int64_t D>
static void values_pass(const DecodeJob<T>& job) {
  const PagedLayer<T>& kv = job.kv;
  const int64_t g = job.g, kh = kv.kh;
  at::parallel_for(0, job.seqs * kh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(g * D);
#if !defined(NS_LANES)
    std::vector<float> blk(kv.bs * D);
#endif
    std::vector<uint16_t> pb;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / kh, hk = i % kh;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        values_pairs<D>(job, i, pb, acc.data());
      else
#endif
      {
#if defined(NS_LANES)
        by_head_chunks(g, [&](int64_t j0, auto G) {
          pv_lanes<T, D, decltype(G)::value>(
              kv.k + kv.v_off + hk * kv.bs * D, job.tables + s * job.max_blocks, kv.block_stride, kv.bs,
              job.first(s), job.lens[s], job.sc + (i * g + j0) * job.width, job.width, acc.data() + j0 * D);
        });
#else
        values_scalar(job, s, hk, blk.data(), acc.data());
#endif
      }
      T* o = job.out + (s * kh * g + hk * g) * D;
      for (int64_t x = 0; x < g * D; ++x) o[x] = static_cast<T>(acc[x]);
    }
  });
}

template <typename T, int64_t D>
static void decode(const DecodeJob<T>& job) {
  PhaseClock clock;
  scores_pass<T, D>(job);
  NS_LAP(clock, kDecScores);
  const int64_t g = job.g, kh = job.kv.kh;
  // one row per (sequence, query head)
  at::parallel_for(0, job.seqs * kh * g, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = r / (kh * g);
      softmax_inplace(job.sc + r * job.width, job.lens[s] - job.first(s));
    }
  });
  NS_LAP(clock, kDecSoftmax);
  values_pass<T, D>(job);
  NS_LAP(clock, kDecPV);
}

// the job of q [nd, h, d] over cache [N, layers, 2, kh, bs, d]'s layer, scores into sc
template <typename T>
static DecodeJob<T> decode_job(const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                               const at::Tensor& tables, const at::Tensor& ctx, float scale, int64_t window,
                               float* sc, int64_t width, const at::Tensor& out) {
  const int64_t kh = cache.size(3), bs = cache.size(4), d = cache.size(5), max_blocks = tables.size(1);
  const int64_t block_stride = cache.size(1) * 2 * kh * bs * d;
  const T* k = cache.data_ptr<T>() + layer * 2 * kh * bs * d;
  return {q.data_ptr<T>(),
          q.stride(0),
          {k, block_stride, kh * bs * d, kh, bs, d},
          q.size(0),
          q.size(1) / kh,
          max_blocks,
          tables.data_ptr<int64_t>(),
          ctx.data_ptr<int64_t>(),
          scale,
          window,
          sc,
          width,
          out.data_ptr<T>()};
}

template <typename T>
static void decode_typed(const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                         const at::Tensor& tables, const at::Tensor& ctx, float scale, int64_t window,
                         const at::Tensor& out) {
  const int64_t kh = cache.size(3), g = q.size(1) / kh, all = tables.size(1) * cache.size(4);
  const int64_t width = window > 0 ? std::min(all, window) : all;  // a row holds its visible keys only
  const at::Tensor scores = at::empty({q.size(0) * kh, g, width}, at::dtype(at::kFloat));
  const DecodeJob<T> job =
      decode_job<T>(q, cache, layer, tables, ctx, scale, window, scores.data_ptr<float>(), width, out);
  switch (q.size(2)) {
    case 64: decode<T, 64>(job); break;
    case 128: decode<T, 128>(job); break;
    default: decode<T, 256>(job); break;
  }
}

}  // namespace

// q's rows may be strided (a view of the fused QKV output: no copy); the result goes to `out` when
// given (contiguous, q's shape; a view of the backend's output), else to a new tensor. window > 0: each
// query sees only its last `window` keys (itself included), and only their blocks are read.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, int64_t layer, at::Tensor tables,
                                  at::Tensor ctx, double scale, c10::optional<at::Tensor> out_,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              q.stride(0) >= q.size(1) * q.size(2));
  TORCH_CHECK(cache.is_contiguous() && tables.is_contiguous() && ctx.is_contiguous());
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && tables.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong);
  TORCH_CHECK(cache.dim() == 6 && cache.size(5) == q.size(2) && q.size(1) % cache.size(3) == 0 &&
              layer >= 0 && layer < cache.size(1) && tables.size(0) == q.size(0) && ctx.size(0) == q.size(0));
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256,
              "paged_decode_attention: head_dim 64, 128 or 256 only");
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0 (0: no window)");
  const at::Tensor out = out_.has_value() ? *out_ : at::empty(q.sizes(), q.options());
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type());
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kBFloat16: decode_typed<c10::BFloat16>(q, cache, layer, tables, ctx, s, window, out); break;
    case at::kHalf: decode_typed<c10::Half>(q, cache, layer, tables, ctx, s, window, out); break;
    case at::kFloat: decode_typed<float>(q, cache, layer, tables, ctx, s, window, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype");
  }
  return out;
}
