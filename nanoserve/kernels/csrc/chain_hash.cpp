// A prompt's chain of block digests (kvcache/block_pool.py's chain_hash, block after block): keyed
// BLAKE2b-256 (RFC 7693) of the previous digest and one block's int64 token bytes. Plain C++ on raw buffers,
// bit-exact with Python's hashlib.blake2b(digest_size=32, key=key); module.cpp binds it without the GIL.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include "kernels.h"

// GCC's Zen tunings (-march=native on this EPYC: znver3) spill the rounds' 32 live words to vector registers,
// each a slow cross-unit move on the critical path: 4x the time of the generic tuning's stack spills
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define NS_CHAIN_TUNE_GENERIC 1
#pragma GCC push_options
#pragma GCC target("tune=generic")
#endif

namespace {

constexpr size_t kBlockBytes = 128;  // one compression's message block
constexpr uint64_t kIV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                             0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                             0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
// the message word permutations of rounds 0..9 (rounds 10 and 11 reuse 0 and 1)
constexpr uint8_t kSigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0}};

// BLAKE2b's state between compressions: the chain value and the bytes hashed so far (a link is far below
// 2^64 bytes, so the counter's high word stays 0)
struct State {
  uint64_t h[8];
  uint64_t t;
};

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  return w;
}

inline void store64(uint8_t* p, uint64_t w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  std::memcpy(p, &w, 8);
}

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

// G, on four words of the working vector v (indices constant once inlined, so v lives in registers)
[[gnu::always_inline]] inline void mix(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
  v[a] = v[a] + v[b] + x;
  v[d] = rotr(v[d] ^ v[a], 32);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 24);
  v[a] = v[a] + v[b] + y;
  v[d] = rotr(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 63);
}

// round R: the columns, then the diagonals, of v with the message words in sigma's order
template <int R>
[[gnu::always_inline]] inline void blake_round(uint64_t* v, const uint64_t* m) {
  constexpr const uint8_t* z = kSigma[R % 10];
  mix(v, 0, 4, 8, 12, m[z[0]], m[z[1]]);
  mix(v, 1, 5, 9, 13, m[z[2]], m[z[3]]);
  mix(v, 2, 6, 10, 14, m[z[4]], m[z[5]]);
  mix(v, 3, 7, 11, 15, m[z[6]], m[z[7]]);
  mix(v, 0, 5, 10, 15, m[z[8]], m[z[9]]);
  mix(v, 1, 6, 11, 12, m[z[10]], m[z[11]]);
  mix(v, 2, 7, 8, 13, m[z[12]], m[z[13]]);
  mix(v, 3, 4, 9, 14, m[z[14]], m[z[15]]);
}

template <int... R>
[[gnu::always_inline]] inline void rounds(uint64_t* v, const uint64_t* m, std::integer_sequence<int, R...>) {
  (blake_round<R>(v, m), ...);
}

// F: one 128-byte block into s (its counter already counting the block); last: the final block
void compress(State& s, const uint8_t* block, bool last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  for (int i = 0; i < 8; ++i) {
    v[i] = s.h[i];
    v[i + 8] = kIV[i];
  }
  v[12] ^= s.t;
  if (last) v[14] = ~v[14];
  rounds(v, m, std::make_integer_sequence<int, 12>());
  for (int i = 0; i < 8; ++i) s.h[i] ^= v[i] ^ v[i + 8];
}

// the state after the parameter block and, with a key, the key's own (zero-padded) block: what every link
// starts from
State keyed_state(const uint8_t* key, size_t key_len) {
  State s{};
  for (int i = 0; i < 8; ++i) s.h[i] = kIV[i];
  s.h[0] ^= 0x01010000ULL ^ (static_cast<uint64_t>(key_len) << 8) ^ kChainDigestBytes;  // fanout 1, depth 1
  if (key_len > 0) {
    uint8_t block[kBlockBytes] = {};
    std::memcpy(block, key, key_len);
    s.t = kBlockBytes;
    compress(s, block, false);
  }
  return s;
}

// one link: the digest of prev (32 bytes) followed by len bytes of data, into out (which may be
// where the next link reads its prev)
void hash_link(const State& keyed, const uint8_t* prev, const uint8_t* data, size_t len, uint8_t* out) {
  State s = keyed;
  uint8_t block[kBlockBytes];
  std::memcpy(block, prev, kChainDigestBytes);
  const size_t head = std::min(len, kBlockBytes - kChainDigestBytes);
  std::memcpy(block + kChainDigestBytes, data, head);
  if (kChainDigestBytes + len <= kBlockBytes) {  // the whole message in one block, the last
    std::memset(block + kChainDigestBytes + head, 0, kBlockBytes - kChainDigestBytes - head);
    s.t += kChainDigestBytes + len;
    compress(s, block, true);
  } else {
    s.t += kBlockBytes;
    compress(s, block, false);
    data += head;
    len -= head;
    for (; len > kBlockBytes; data += kBlockBytes, len -= kBlockBytes) {  // read in place
      s.t += kBlockBytes;
      compress(s, data, false);
    }
    std::memcpy(block, data, len);  // 1..128 bytes left: the last block, zero-padded
    std::memset(block + len, 0, kBlockBytes - len);
    s.t += len;
    compress(s, block, true);
  }
  for (int i = 0; i < 4; ++i) store64(out + 8 * i, s.h[i]);
}

}  // namespace

void chain_digests(const uint8_t* tokens, size_t n_blocks, size_t block_bytes, const uint8_t* parent,
                   const uint8_t* key, size_t key_len, uint8_t* out) {
  static const uint8_t kNoParent[kChainDigestBytes] = {};
  const State keyed = keyed_state(key, std::min(key_len, kChainKeyBytes));
  const uint8_t* prev = parent != nullptr ? parent : kNoParent;
  for (size_t i = 0; i < n_blocks; ++i, tokens += block_bytes, out += kChainDigestBytes) {
    hash_link(keyed, prev, tokens, block_bytes, out);
    prev = out;
  }
}

#if defined(NS_CHAIN_TUNE_GENERIC)
#pragma GCC pop_options
#endif
