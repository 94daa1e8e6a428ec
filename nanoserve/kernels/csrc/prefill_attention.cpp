// Prefill attention over the paged cache, flash-style. Phase 1 packs each (sequence, KV head)'s context
// once, KT keys at a time, from its blocks into GEMM-ready tiles (K^T and V; VNNI-packed for AMX): every
// query tile of that head reuses them. Phase 2, per (sequence, KV head, query tile) task: the tile's query
// rows of the whole head group (GQA without repeating K/V) against the packed tiles up to the causal edge,
// online softmax in fp32. Both products are GEMMs: with AMX, bf16 tiles through ATen's brgemm (oneDNN's
// JIT micro-kernels); with AVX512_BF16 but no AMX, bf16 tiles through VDPBF16PS (qk_bf16, pv_bf16: 1.79x
// the fp32 tiles, 2048 tokens, SmolLM2 heads, one thread); elsewhere fp32 through ATen's brgemm (tiles
// converted while packed; oneDNN's AVX2/AVX-512 kernels, or ATen's gemm).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <limits>
#include <vector>
#include "kernels.h"
#include "vec.h"

namespace {

constexpr int64_t KT = 64;  // keys per tile (oneDNN's AMX packing takes at most 64 columns)
// Keys go in tiles of KS: one softmax pass per row and one PV GEMM per tile (K = the tile's keys:
// with AMX a longer accumulation per C tile load/store), QK^T in KT-key GEMMs (the packing limit).
constexpr int64_t KS = 4 * KT;

template <typename C, typename T>
static inline C as(T x) {
  return static_cast<C>(static_cast<float>(x));
}
template <>
inline c10::BFloat16 as<c10::BFloat16, c10::BFloat16>(c10::BFloat16 x) {
  return x;
}
template <>
inline float as<float, float>(float x) {
  return x;
}

// One row of scores s[n] (unscaled; n a multiple of 16) -> probabilities p[n] in C, for keys
// [from, valid) (the rest 0: before `from` out of a sliding window, from `valid` on past the causal edge);
// updates the row's running max and sum, returns the factor its accumulator must be scaled by. A row that
// sees none of these keys keeps its max and sum (its max may stay -inf: every lane then is masked).
template <typename C>
static inline float softmax_row(const float* s, C* p, int64_t n, int64_t from, int64_t valid, float scale,
                                float& mx, float& sum) {
  float rmax = mx;
  float rsum = 0.f;
  int64_t t = 0;
  from = std::max<int64_t>(from, 0);
#if defined(__AVX512F__)
  if constexpr (kVec16<C>) {
    // the max as 16 lanes: a scalar max chain costs its latency per key (~4x the whole exp)
    auto live = [from, valid](int64_t t) -> __mmask16 {
      const int64_t a = std::clamp<int64_t>(from - t, 0, 16), b = std::clamp<int64_t>(valid - t, 0, 16);
      return a >= b ? 0 : static_cast<__mmask16>((0xFFFFu >> (16 - b)) & (0xFFFFu << a));
    };
    // whole vectors of visible keys [first, full) unmasked; the window's and the causal edge's vectors
    // (the same one where both fall in it: max is idempotent) and the rest masked
    const int64_t full = std::clamp<int64_t>(valid, 0, n) / 16 * 16;
    const int64_t first = std::min<int64_t>((from + 15) / 16 * 16, n), edge = from / 16 * 16;
    __m512 vmax[2] = {_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                      _mm512_set1_ps(-std::numeric_limits<float>::infinity())};
    for (int64_t u = first; u < full; u += 16)
      vmax[u / 16 % 2] = _mm512_max_ps(vmax[u / 16 % 2], _mm512_loadu_ps(s + u));
    if (edge < first && edge < n)
      vmax[1] = _mm512_mask_max_ps(vmax[1], live(edge), vmax[1], _mm512_loadu_ps(s + edge));
    if (full < valid) vmax[0] = _mm512_mask_max_ps(vmax[0], live(full), vmax[0], _mm512_loadu_ps(s + full));
    rmax = std::max(rmax, _mm512_reduce_max_ps(_mm512_max_ps(vmax[0], vmax[1])) * scale);  // scale > 0
    // e^(s * scale - max) as 2^x: one FMA to x, then 2^x by exp2_16; two vectors per step (two
    // independent sums, and one VCVTNE2PS2BF16 rounds both to bf16)
    constexpr float log2e = 1.44269504088896341f;
    const __m512 sc = _mm512_set1_ps(scale * log2e), mneg = _mm512_set1_ps(-rmax * log2e);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    auto exp16 = [&](int64_t t) {
      const __m512 e = exp2_16<C>(_mm512_fmadd_ps(_mm512_loadu_ps(s + t), sc, mneg));
      return t >= full || t < first ? _mm512_maskz_mov_ps(live(t), e) : e;
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
    for (int64_t u = from; u < valid; ++u) rmax = std::max(rmax, s[u] * scale);
  for (; t < n; ++t) {
    const float e = t >= from && t < valid ? exp_neg(s[t] * scale - rmax) : 0.f;
    rsum += e;
    p[t] = as<C>(e);
  }
  const float alpha = mx == rmax ? 1.f : exp_neg(mx - rmax);  // exp(-inf) -> 0 on the first tile
  sum = sum * alpha + rsum;
  mx = rmax;
  return alpha;
}

#if defined(__AVX512BF16__)
// bf16 tiles on AVX512_BF16 without AMX, where ATen's brgemm has no fast bf16 kernel (unpacked bf16
// tiles measured slower than its fp32 GEMM: 66.4 vs 54.7 ms a layer, 2048 tokens, SmolLM2 heads, one
// thread). VDPBF16PS takes pairs: K is packed per 16 keys as [d / 2][16 keys][2 dims] and V as
// [keys / 2][d][2 keys], so one vector op adds two products to 16 fp32 results.
// The micro-kernel of both products: rows [r0, r0 + MR) of C [., NV * 16] (+)= A B over `pairs` pairs,
// A's row r holding its pairs at a + r * lda, B's vector c of pair i at b + i * b_pair + c * b_vec.
// MR x NV accumulators stay in registers for the whole pass; each B vector serves the MR rows.
template <int MR, int NV>
static inline void pair_tile(int64_t r0, int64_t pairs, const c10::BFloat16* a, int64_t lda,
                             const c10::BFloat16* b, int64_t b_pair, int64_t b_vec, float* c, int64_t ldc,
                             bool accumulate) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + (r0 + r) * ldc + v * 16) : _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v)
      bv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + i * b_pair + v * b_vec));
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
static inline void pair_rows(int64_t m, int64_t pairs, const c10::BFloat16* a, int64_t lda,
                             const c10::BFloat16* b, int64_t b_pair, int64_t b_vec, float* c, int64_t ldc,
                             bool accumulate) {
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

// acc[r, :] += p[r, :kk] V[:kk, :] for rows [0, m), kk even, D = d (64, 128 or 256): in passes of at most
// 128 columns (256 at once would need 32 accumulators and 16 V vectors)
template <int64_t D>
static void pv_bf16(int64_t m, int64_t kk, const c10::BFloat16* pb, int64_t ldp, const c10::BFloat16* vt,
                    float* acc) {
  constexpr int64_t CW = std::min<int64_t>(D, 128);
  constexpr int NV = CW / 16, MR = NV == 4 ? 6 : 2;  // MR x NV accumulators within the 32 registers
  for (int64_t c0 = 0; c0 < D; c0 += CW)  // V is [kk / 2][D][2]: column c0's pair words at 2 * c0
    pair_rows<MR, NV>(m, kk / 2, pb, ldp, vt + 2 * c0, 2 * D, 32, acc + c0, D, true);
}
#endif

// Mode: how the tiles are multiplied. Fp32: tiles converted to fp32, ATen's brgemm; Amx: bf16 tiles
// packed for oneDNN's AMX brgemm; Vnni: bf16 tiles in VDPBF16PS pairs, qk_bf16 / pv_bf16 above.
enum class Tiles { Fp32, Amx, Vnni };

// The step's prefill rows of one layer: sequence i's are q[start[i] : start[i] + len[i]], the last len[i]
// of its ctx[i] tokens, whose K/V (the new ones included) are in the cache at tables[i]
template <typename T>
struct PrefillJob {
  const T* q;
  int64_t q_row;  // q's row stride (a view of the fused QKV output)
  T* out;         // [rows, h, d]
  PagedLayer<T> kv;
  int64_t h, seqs, max_blocks;
  const int64_t* tables;
  const int64_t* start;
  const int64_t* len;
  const int64_t* ctx;
  float scale;
  int64_t window;  // keys a query sees, itself included (0: all of its context)
  // the first key the query at position p sees
  int64_t first_key(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
  // sequence s's first tile that any of its queries sees, and its tile count from there: tiles wholly
  // out of every query's window are neither packed nor attended
  int64_t tile_lo(int64_t s) const { return first_key(ctx[s] - len[s]) / KS; }
  int64_t tiles(int64_t s) const { return (ctx[s] + KS - 1) / KS - tile_lo(s); }
  // where key `tok` of sequence s, KV head hk sits
  const T* key(int64_t s, int64_t hk, int64_t tok) const {
    return kv.k + tables[s * max_blocks + tok / kv.bs] * kv.block_stride + (hk * kv.bs + tok % kv.bs) * kv.d;
  }
};

// Phase 1's buffers: tile0[s] is the index of sequence s's first tile (the one of key tile_lo(s) * KS);
// its head hk's tiles follow at hk * tiles(s). A tile: K^T as KS / KT blocks [d, KT] (each VNNI-packed
// with AMX), then V [KS, d] (packed per 64 columns)
template <typename C>
struct PackedTiles {
  std::vector<int64_t> tile0;
  at::Tensor kbuf, vbuf;
  C* k() const { return kbuf.data_ptr<C>(); }
  C* v() const { return vbuf.data_ptr<C>(); }
};

// one tile of keys [k0, k0 + cnt) for the VDPBF16PS pairs: K [KS / 16][d / 2][16][2], V [KS / 2][d][2];
// zero past the end
template <typename T, typename C>
static void pack_pairs(const PrefillJob<T>& job, int64_t s, int64_t hk, int64_t k0, int64_t cnt, C* kd,
                       C* vd) {
  const int64_t d = job.kv.d;
  for (int64_t t = 0; t < KS; ++t) {
    C* kb = kd + (t / 16 * d / 2 * 16 + t % 16) * 2;
    C* vb = vd + t % 2;
    const T* kr = t < cnt ? job.key(s, hk, k0 + t) : nullptr;
    for (int64_t x = 0; x < d; ++x) {
      kb[x / 2 * 32 + x % 2] = kr ? as<C>(kr[x]) : C(0);
      vb[(t / 2 * d + x) * 2] = kr ? as<C>(kr[job.kv.v_off + x]) : C(0);
    }
  }
}

// one tile as K^T blocks [d, KT] and V [KS, d] (zero past the end), then packed for AMX
template <typename T, typename C, Tiles mode>
static void pack_tile(const PrefillJob<T>& job, int64_t s, int64_t hk, int64_t k0, int64_t cnt, C* kd, C* vd,
                      C* kp, C* vp) {
  const int64_t d = job.kv.d;
  for (int64_t t = 0; t < KS; ++t) {
    C* kb = kd + t / KT * KT * d + t % KT;  // column t % KT of block t / KT
    if (t < cnt) {
      const T* kr = job.key(s, hk, k0 + t);
      for (int64_t x = 0; x < d; ++x) {
        kb[x * KT] = as<C>(kr[x]);
        vd[t * d + x] = as<C>(kr[job.kv.v_off + x]);
      }
    } else {
      for (int64_t x = 0; x < d; ++x) {
        kb[x * KT] = C(0);
        vd[t * d + x] = C(0);
      }
    }
  }
  if constexpr (mode == Tiles::Amx) {
    constexpr auto dt = c10::CppTypeToScalarType<C>::value;
    for (int64_t b = 0; b < KS; b += KT)
      at::native::cpublas::pack(d, KT, KT, KT, dt, dt, kd + b * d, kp + b * d);
    for (int64_t c0 = 0; c0 < d; c0 += 64)  // at most 64 columns per packed block
      at::native::cpublas::pack(KS, 64, d, 64, dt, dt, vd + c0, vp + c0 * KS);
  }
}

// phase 1: every (sequence, KV head)'s context as tiles
template <typename T, typename C, Tiles mode>
static PackedTiles<C> pack_tiles(const PrefillJob<T>& job) {
  constexpr bool amx = mode == Tiles::Amx;
  const int64_t kh = job.kv.kh, tile = KS * job.kv.d;
  PackedTiles<C> tiles{std::vector<int64_t>(job.seqs + 1, 0), {}, {}};
  std::vector<int64_t>& tile0 = tiles.tile0;
  for (int64_t s = 0; s < job.seqs; ++s) tile0[s + 1] = tile0[s] + kh * job.tiles(s);
  tiles.kbuf = at::empty({tile0[job.seqs], tile}, at::dtype(c10::CppTypeToScalarType<C>::value));
  tiles.vbuf = at::empty({tile0[job.seqs], tile}, at::dtype(c10::CppTypeToScalarType<C>::value));
  C* kp = tiles.k();
  C* vp = tiles.v();
  at::parallel_for(0, tile0[job.seqs], 1, [&](int64_t begin, int64_t end) {
    PhaseClock clock;
    std::vector<C> kt(amx ? tile : 0), vt(amx ? tile : 0);
    int64_t s = 0;
    for (int64_t i = begin; i < end; ++i) {
      while (tile0[s + 1] <= i) ++s;
      const int64_t nt = job.tiles(s), hk = (i - tile0[s]) / nt;
      const int64_t k0 = (job.tile_lo(s) + (i - tile0[s]) % nt) * KS;
      const int64_t cnt = std::min(KS, job.ctx[s] - k0);
      if constexpr (mode == Tiles::Vnni)
        pack_pairs(job, s, hk, k0, cnt, kp + i * tile, vp + i * tile);
      else if constexpr (amx)
        pack_tile<T, C, mode>(job, s, hk, k0, cnt, kt.data(), vt.data(), kp + i * tile, vp + i * tile);
      else
        pack_tile<T, C, mode>(job, s, hk, k0, cnt, kp + i * tile, vp + i * tile, nullptr, nullptr);
    }
    NS_LAP(clock, kPack);
  });
  return tiles;
}

// phase 2's unit of work: query rows [r0, r1) of sequence s against KV head hk
struct Task {
  int64_t s, hk, r0, r1, work;
};

// the tasks, heaviest first: causal tiles differ in cost by up to the context/tile ratio
template <typename T>
static std::vector<Task> attention_tasks(const PrefillJob<T>& job, int64_t qt) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < job.seqs; ++s)
    for (int64_t r0 = 0; r0 < job.len[s]; r0 += qt) {
      const int64_t off = job.ctx[s] - job.len[s], r1 = std::min(job.len[s], r0 + qt);
      const int64_t keys = off + r1 - job.first_key(off + r0);
      for (int64_t hk = 0; hk < job.kv.kh; ++hk) tasks.push_back({s, hk, r0, r1, keys * (r1 - r0)});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.work > b.work; });
  return tasks;
}

// A worker's buffers for one task at a time: query rows qb, probabilities pb, scores sc, accumulators
// acc, each row's running max and sum, and its query position pos
template <typename C>
struct TaskBuffers {
  explicit TaskBuffers(int64_t mmax, int64_t d)
      : qb(mmax * d), pb(mmax * KS), sc(mmax * KS), acc(mmax * d), mx(mmax), sum(mmax), pos(mmax) {}
  std::vector<C> qb, pb;
  std::vector<float> sc, acc, mx, sum;
  std::vector<int64_t> pos;
};

// the task's m query rows (a whole number of 16) into b: row r is query token r0 + r / g, head hk * g + r % g
template <typename T, typename C>
static void load_queries(const PrefillJob<T>& job, const Task& w, int64_t rows, int64_t m,
                         TaskBuffers<C>& b) {
  const int64_t d = job.kv.d, g = job.h / job.kv.kh, off = job.ctx[w.s] - job.len[w.s];
  for (int64_t r = 0; r < m; ++r) {
    C* dst = b.qb.data() + r * d;
    if (r < rows) {
      const T* src = job.q + (job.start[w.s] + w.r0 + r / g) * job.q_row + (w.hk * g + r % g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = as<C>(src[x]);
      b.pos[r] = off + w.r0 + r / g;
    } else {  // padding rows (to whole AMX tiles): zeros that see every key, output dropped
      std::fill(dst, dst + d, C(0));
      b.pos[r] = std::numeric_limits<int64_t>::max() / 2;
    }
  }
  std::fill(b.acc.begin(), b.acc.begin() + m * d, 0.f);
  std::fill(b.mx.begin(), b.mx.begin() + m, -std::numeric_limits<float>::infinity());
  std::fill(b.sum.begin(), b.sum.begin() + m, 0.f);
}

// the m rows against one tile of kk keys from k0 (cnt of them real): scores, online softmax, P.V
template <Tiles mode, typename C>
static void attend_tile(int64_t m, int64_t d, int64_t k0, int64_t cnt, int64_t kk, float scale,
                        int64_t window, const C* kt, const C* vt, TaskBuffers<C>& b, PhaseClock& clock) {
  constexpr bool amx = mode == Tiles::Amx;
  if constexpr (mode == Tiles::Vnni) {
    qk_bf16(m, kk, d, b.qb.data(), kt, b.sc.data(), KS);
  } else {
    for (int64_t j = 0; j < kk; j += KT)
      at::native::cpublas::brgemm(m, KT, d, d, KT, KS, false, b.qb.data(), kt + j * d, b.sc.data() + j, amx);
  }
  NS_LAP(clock, kQK);
  for (int64_t r = 0; r < m; ++r) {  // keys pos[r] - window + 1 .. pos[r] are visible to row r
    const int64_t from = window > 0 ? b.pos[r] - window + 1 - k0 : 0;
    const float alpha = softmax_row(b.sc.data() + r * KS, b.pb.data() + r * KS, kk, from,
                                    std::min(cnt, b.pos[r] - k0 + 1), scale, b.mx[r], b.sum[r]);
    if (alpha != 1.f) {
      float* a = b.acc.data() + r * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) a[x] *= alpha;
    }
  }
  NS_LAP(clock, kSoftmax);
  if constexpr (mode == Tiles::Vnni) {
    if (d == 64)
      pv_bf16<64>(m, kk, b.pb.data(), KS, vt, b.acc.data());
    else if (d == 128)
      pv_bf16<128>(m, kk, b.pb.data(), KS, vt, b.acc.data());
    else
      pv_bf16<256>(m, kk, b.pb.data(), KS, vt, b.acc.data());
  } else if constexpr (amx) {  // the first kk rows of each packed column block
    for (int64_t c0 = 0; c0 < d; c0 += 64)
      at::native::cpublas::brgemm(m, 64, kk, KS, 64, d, true, b.pb.data(), vt + c0 * KS, b.acc.data() + c0,
                                  true);
  } else {
    at::native::cpublas::brgemm(m, d, kk, KS, d, d, true, b.pb.data(), vt, b.acc.data(), false);
  }
  NS_LAP(clock, kPV);
}

// one task: its rows against the packed tiles from its first row's window to the causal edge, normalized
// into out
template <typename T, typename C, Tiles mode>
static void attend_task(const PrefillJob<T>& job, const PackedTiles<C>& tiles, const Task& w,
                        TaskBuffers<C>& b, PhaseClock& clock) {
  const int64_t d = job.kv.d, g = job.h / job.kv.kh, tile = KS * d;
  const int64_t off = job.ctx[w.s] - job.len[w.s], rows = (w.r1 - w.r0) * g, m = (rows + 15) / 16 * 16;
  load_queries(job, w, rows, m, b);
  const int64_t lo = job.tile_lo(w.s), first = tiles.tile0[w.s] + w.hk * job.tiles(w.s);
  NS_LAP(clock, kQload);
  for (int64_t j = job.first_key(off + w.r0) / KS - lo, k0 = (lo + j) * KS; k0 < off + w.r1; ++j, k0 += KS) {
    const int64_t cnt = std::min(KS, off + w.r1 - k0), kk = (cnt + KT - 1) / KT * KT;  // keys any row sees
    attend_tile<mode>(m, d, k0, cnt, kk, job.scale, job.window, tiles.k() + (first + j) * tile,
                      tiles.v() + (first + j) * tile, b, clock);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = job.out + ((job.start[w.s] + w.r0 + r / g) * job.h + w.hk * g + r % g) * d;
    const float inv = 1.f / b.sum[r];
    for (int64_t x = 0; x < d; ++x) o[x] = static_cast<T>(b.acc[r * d + x] * inv);
  }
  NS_LAP(clock, kStore);
}

// T: storage dtype; C: GEMM input dtype (T itself with AMX packing, else float)
template <typename T, typename C, Tiles mode = std::is_same_v<C, float> ? Tiles::Fp32 : Tiles::Amx>
static void prefill(const PrefillJob<T>& job) {
  const int64_t g = job.h / job.kv.kh, qt = std::max<int64_t>(1, 128 / g);
  const PackedTiles<C> tiles = pack_tiles<T, C, mode>(job);
  const std::vector<Task> tasks = attention_tasks(job, qt);
  std::atomic<int64_t> next{0};  // handed out one at a time, heaviest first
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    TaskBuffers<C> buffers((qt * g + 15) / 16 * 16, job.kv.d);
    PhaseClock clock;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++)
      attend_task<T, C, mode>(job, tiles, tasks[i], buffers, clock);
    if constexpr (mode == Tiles::Amx) at::native::cpublas::brgemm_release(true);
  });
}

template <typename T>
static PrefillJob<T> prefill_job(const at::Tensor& q, const at::Tensor& out, const at::Tensor& cache,
                                 int64_t layer, const at::Tensor& tables, const at::Tensor& start,
                                 const at::Tensor& len, const at::Tensor& ctx, double scale, int64_t window) {
  const int64_t kh = cache.size(3), bs = cache.size(4), d = q.size(2);
  const T* k = cache.data_ptr<T>() + layer * 2 * kh * bs * d;
  return {q.data_ptr<T>(),
          q.stride(0),
          out.data_ptr<T>(),
          {k, cache.size(1) * 2 * kh * bs * d, kh * bs * d, kh, bs, d},
          q.size(1),
          tables.size(0),
          tables.size(1),
          tables.data_ptr<int64_t>(),
          start.data_ptr<int64_t>(),
          len.data_ptr<int64_t>(),
          ctx.data_ptr<int64_t>(),
          static_cast<float>(scale),
          window};
}

// every row and block the kernel will touch is in range
static void check_prefill(const at::Tensor& q, const at::Tensor& out, const at::Tensor& cache, int64_t layer,
                          const at::Tensor& tables, const at::Tensor& start, const at::Tensor& len,
                          const at::Tensor& ctx) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              q.stride(0) >= q.size(1) * q.size(2) && out.is_contiguous() && out.sizes() == q.sizes() &&
              out.scalar_type() == q.scalar_type());
  TORCH_CHECK(cache.is_contiguous() && tables.is_contiguous() && start.is_contiguous() &&
              len.is_contiguous() && ctx.is_contiguous() && q.dim() == 3 && cache.dim() == 6);
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && tables.scalar_type() == at::kLong &&
              start.scalar_type() == at::kLong && len.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong);
  const int64_t seqs = tables.size(0), h = q.size(1), d = q.size(2), kh = cache.size(3), bs = cache.size(4);
  TORCH_CHECK(cache.size(5) == d && h % kh == 0 && layer >= 0 && layer < cache.size(1) &&
              start.numel() == seqs && len.numel() == seqs && ctx.numel() == seqs);
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* ln = len.data_ptr<int64_t>();
  const int64_t* cx = ctx.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < seqs; ++i) {
    TORCH_CHECK(ln[i] >= 1 && ln[i] <= cx[i] && st[i] >= 0 && st[i] + ln[i] <= q.size(0) &&
                    (cx[i] + bs - 1) / bs <= tables.size(1),
                "paged_prefill_attention: bad sequence ", i);
    for (int64_t b = 0; b < (cx[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tab[i * tables.size(1) + b] >= 0 && tab[i * tables.size(1) + b] < cache.size(0),
                  "paged_prefill_attention: block out of range");
  }
}

}  // namespace

bool amx() { return at::native::cpublas::could_pack(at::kBFloat16); }

// q [T, h, d]: the step's prefill rows (see PrefillJob). q's rows may be strided (a view of the fused
// QKV output: no copy); the result goes to `out` (contiguous, q's shape). window > 0: each query sees only
// its last `window` keys (itself included).
void paged_prefill_attention(at::Tensor q, at::Tensor out, at::Tensor cache, int64_t layer, at::Tensor tables,
                             at::Tensor start, at::Tensor len, at::Tensor ctx, double scale, bool allow_amx,
                             int64_t window) {
  check_prefill(q, out, cache, layer, tables, start, len, ctx);
  TORCH_CHECK(window >= 0, "paged_prefill_attention: window must be >= 0 (0: no window)");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256,
              "paged_prefill_attention: head_dim 64, 128 or 256 only");
  switch (q.scalar_type()) {
    case at::kBFloat16: {
      const auto job =
          prefill_job<c10::BFloat16>(q, out, cache, layer, tables, start, len, ctx, scale, window);
      if (allow_amx && amx()) prefill<c10::BFloat16, c10::BFloat16>(job);
#if defined(__AVX512BF16__)
      else if (allow_amx)
        prefill<c10::BFloat16, c10::BFloat16, Tiles::Vnni>(job);
#endif
      else
        prefill<c10::BFloat16, float>(job);
      break;
    }
    case at::kHalf:
      prefill<c10::Half, float>(
          prefill_job<c10::Half>(q, out, cache, layer, tables, start, len, ctx, scale, window));
      break;
    case at::kFloat:
      prefill<float, float>(prefill_job<float>(q, out, cache, layer, tables, start, len, ctx, scale, window));
      break;
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype");
  }
}
