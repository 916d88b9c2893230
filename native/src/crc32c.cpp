#include "crc32c.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <cstdlib>
#include <cstring>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <nmmintrin.h>
#define UCPD_X86 1
#endif

namespace ucpd {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// ---- GF(2) arithmetic modulo P, reflected representation (bit 31 is x^0) ----

// a * b mod P.
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct PowTable {
  uint32_t x2k[64];  // x^(2^k) mod P
  PowTable() {
    uint32_t p = 1u << 30;  // x^1
    for (int k = 0; k < 64; ++k) {
      x2k[k] = p;
      p = multmodp(p, p);
    }
  }
};
const PowTable& pow_table() {
  static const PowTable t;
  return t;
}

// x^n mod P.
uint32_t xnmodp(uint64_t n) {
  const PowTable& t = pow_table();
  uint32_t p = 1u << 31;  // x^0
  for (int k = 0; n; n >>= 1, ++k)
    if (n & 1) p = multmodp(t.x2k[k & 63], p);
  return p;
}

// x^(8 * nbytes) mod P: the factor that shifts a CRC register over `nbytes` zero bytes
// (computed as (x^nbytes)^8 so that no bit count overflows).
uint32_t x8nmodp(uint64_t nbytes) {
  uint32_t p = xnmodp(nbytes);  // x^nbytes
  p = multmodp(p, p);           // x^(2 nbytes)
  p = multmodp(p, p);           // x^(4 nbytes)
  return multmodp(p, p);        // x^(8 nbytes)
}

// ---- portable slicing-by-8 ----

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int j = 0; j < 8; ++j) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// Raw register update (no inversion).
uint32_t raw_portable(uint32_t c, const unsigned char* p, std::size_t n) {
  const Tables& T = tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = (c >> 8) ^ T.t[0][(c ^ *p++) & 0xff];
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;  // little-endian: the register covers the first 4 bytes
    c = T.t[7][w & 0xff] ^ T.t[6][(w >> 8) & 0xff] ^ T.t[5][(w >> 16) & 0xff] ^
        T.t[4][(w >> 24) & 0xff] ^ T.t[3][(w >> 32) & 0xff] ^ T.t[2][(w >> 40) & 0xff] ^
        T.t[1][(w >> 48) & 0xff] ^ T.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ T.t[0][(c ^ *p++) & 0xff];
  return c;
}

#ifdef UCPD_X86
// ---- SSE4.2: three independent crc32 streams hide the instruction's 3-cycle latency ----

// Shifting a raw register over a fixed number of zero bytes is linear in the register, so it
// is four table look-ups (one per register byte).
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(uint64_t nbytes) {
    uint32_t f = x8nmodp(nbytes);
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = multmodp(f, b << (8 * k));
  }
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

constexpr std::size_t kLong = 8192;  // bytes per stream in a long block (3 * 8 KiB)
constexpr std::size_t kShort = 256;  // bytes per stream in a short block (3 * 256 B)

const ShiftTable& shift_long() {
  static const ShiftTable t(kLong);
  return t;
}
const ShiftTable& shift_short() {
  static const ShiftTable t(kShort);
  return t;
}

__attribute__((target("sse4.2"))) inline uint64_t load64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// Three streams of `len` bytes each (len % 8 == 0) starting at p, p+len, p+2len.
template <std::size_t len>
__attribute__((target("sse4.2"))) inline uint64_t crc3(uint64_t c0, const unsigned char* p,
                                                      const ShiftTable& shift) {
  uint64_t c1 = 0, c2 = 0;
  const unsigned char* end = p + len;
  for (; p < end; p += 8) {
    c0 = _mm_crc32_u64(c0, load64(p));
    c1 = _mm_crc32_u64(c1, load64(p + len));
    c2 = _mm_crc32_u64(c2, load64(p + 2 * len));
  }
  c0 = shift(static_cast<uint32_t>(c0)) ^ c1;
  return shift(static_cast<uint32_t>(c0)) ^ c2;
}

__attribute__((target("sse4.2"))) uint32_t raw_sse42(uint32_t crc, const unsigned char* p,
                                                     std::size_t n) {
  uint64_t c = crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  if (n >= 3 * kLong) {
    const ShiftTable& sl = shift_long();
    do {
      c = crc3<kLong>(c, p, sl);
      p += 3 * kLong;
      n -= 3 * kLong;
    } while (n >= 3 * kLong);
  }
  if (n >= 3 * kShort) {
    const ShiftTable& ss = shift_short();
    do {
      c = crc3<kShort>(c, p, ss);
      p += 3 * kShort;
      n -= 3 * kShort;
    } while (n >= 3 * kShort);
  }
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

// ---- AVX-512 + VPCLMULQDQ: fold 256-byte blocks with carry-less multiplies ----
//
// A 16-byte lane loaded little-endian holds, in CRC bit order, bit i <-> x^(127-i): its low
// quadword L is the high-degree half. Moving a lane F bytes further along the message multiplies
// it by x^(8F); modulo P that is L * x^(8F+64) + H * x^(8F), and because a carry-less product of
// two bit-reflected quadwords reads back one degree low, the factors are x^(8F+63) and x^(8F-1)
// mod P. Folding keeps the message congruent modulo P, so its CRC is unchanged: at the end the
// 256 accumulated bytes are simply run through the crc32 instruction, then the tail.
constexpr std::size_t kFold = 256;       // bytes per fold step: 4 zmm accumulators
constexpr std::size_t kPrefetch = 4096;  // software prefetch distance (prefetches never fault)

// Multipliers {k_lo, k_hi} that fold a 16-byte lane forward by F bytes.
struct FoldK {
  uint64_t lo, hi;
  explicit FoldK(std::size_t f)
      : lo(static_cast<uint64_t>(xnmodp(8 * f + 63)) << 32),
        hi(static_cast<uint64_t>(xnmodp(8 * f - 1)) << 32) {}
};

constexpr std::size_t kPage = 4096, kGroup = 4 * kPage;  // copy+CRC walks 4 pages at once

struct FoldConstants {
  FoldK step{kFold};                       // next 256 bytes
  FoldK jump{kGroup - kPage + kFold};      // last 256 B of a page -> same page, next group
  FoldK join[3] = {FoldK(3 * kPage), FoldK(2 * kPage), FoldK(kPage)};  // pages 0..2 onto 3
};
const FoldConstants& fold_constants() {
  static const FoldConstants c;
  return c;
}

__attribute__((target("avx512f"))) inline __m512i fold_vec(const FoldK& k) {
  const long long lo = static_cast<long long>(k.lo), hi = static_cast<long long>(k.hi);
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
}

// a * x^(8F) mod P (per 16-byte lane, k from FoldK(F)), XOR x.
__attribute__((target("avx512f,vpclmulqdq"))) inline __m512i fold(__m512i a, __m512i k, __m512i x) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00),
                                   _mm512_clmulepi64_epi128(a, k, 0x11), x, 0x96);
}

__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) uint32_t raw_avx512(uint32_t crc,
                                                                          const unsigned char* p,
                                                                          std::size_t n) {
  if (n < 4 * kFold) return raw_sse42(crc, p, n);
  const __m512i k = fold_vec(fold_constants().step);
  // The register enters as an XOR into the first four message bytes.
  __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p),
                                _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i a1 = _mm512_loadu_si512(p + 64);
  __m512i a2 = _mm512_loadu_si512(p + 128);
  __m512i a3 = _mm512_loadu_si512(p + 192);
  p += kFold;
  n -= kFold;
  while (n >= kFold) {
    // Prefetch 4 KiB ahead: measured 10-20% faster than the hardware prefetcher alone when the
    // data streams from DRAM (the common case: a tensor checksummed once).
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + 192, _MM_HINT_T0);
    a0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a0, k, 0x00),
                                   _mm512_clmulepi64_epi128(a0, k, 0x11), _mm512_loadu_si512(p), 0x96);
    a1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a1, k, 0x00),
                                   _mm512_clmulepi64_epi128(a1, k, 0x11), _mm512_loadu_si512(p + 64), 0x96);
    a2 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a2, k, 0x00),
                                   _mm512_clmulepi64_epi128(a2, k, 0x11), _mm512_loadu_si512(p + 128), 0x96);
    a3 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a3, k, 0x00),
                                   _mm512_clmulepi64_epi128(a3, k, 0x11), _mm512_loadu_si512(p + 192), 0x96);
    p += kFold;
    n -= kFold;
  }
  alignas(64) unsigned char acc[kFold];
  _mm512_store_si512(acc, a0);
  _mm512_store_si512(acc + 64, a1);
  _mm512_store_si512(acc + 128, a2);
  _mm512_store_si512(acc + 192, a3);
  const uint32_t c = raw_sse42(0, acc, kFold);
  return raw_sse42(c, p, n);
}

// Copy and checksum in one pass: every byte is loaded once, written to the destination with
// streaming stores and folded into the CRC. Like the plain streaming copy (copy.cpp) it walks four
// pages at once, so it keeps four sets of accumulators (one per page, 16 zmm registers): within a
// page a set folds forward 256 bytes per step, from one group of four pages to the next it jumps
// 12 KiB + 256, and at the end the sets of pages 0..2 are folded onto page 3's.
__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) uint32_t raw_copy_avx512(
    uint32_t crc, unsigned char* d, const unsigned char* s, std::size_t n) {
  std::size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  crc = raw_sse42(crc, s, head);
  d += head, s += head, n -= head;
  if (n < kGroup) {
    std::memcpy(d, s, n);
    return raw_sse42(crc, s, n);
  }
  const FoldConstants& fc = fold_constants();
  const __m512i k_step = fold_vec(fc.step), k_jump = fold_vec(fc.jump);
  __m512i acc[4][4];  // [page][64-byte vector within the 256-byte block]; zero folds to zero
  for (auto& page : acc)
    for (auto& v : page) v = _mm512_setzero_si512();
  for (std::size_t g = 0; n >= kGroup; ++g, d += kGroup, s += kGroup, n -= kGroup) {
    for (std::size_t l = 0; l < kPage; l += kFold) {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const unsigned char* src = s + p * kPage + l;
        unsigned char* dst = d + p * kPage + l;
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m512i x = _mm512_loadu_si512(src + 64 * v);
          _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 64 * v), x);
          acc[p][v] = fold(acc[p][v], l != 0 ? k_step : k_jump, x);
        }
      }
      if (l == 0 && g == 0)  // the register enters as an XOR into the first four message bytes
        acc[0][0] = _mm512_xor_si512(acc[0][0],
                                     _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
    }
  }
  _mm_sfence();
#pragma GCC unroll 3
  for (int p = 0; p < 3; ++p) {
    const __m512i kj = fold_vec(fc.join[p]);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[3][v] = fold(acc[p][v], kj, acc[3][v]);
  }
  alignas(64) unsigned char block[kFold];
  for (int v = 0; v < 4; ++v) _mm512_store_si512(block + 64 * v, acc[3][v]);
  std::memcpy(d, s, n);
  return raw_sse42(raw_sse42(0, block, kFold), s, n);
}

// Checksum one buffer while copying another, in one loop: each 256-byte step folds 256 bytes of
// `p` into the CRC and streams 256 bytes of `s` (already in cache: the chunk checksummed just
// before) to `d`, so the CRC work and the stores overlap (copy_batch_verified's pipeline).
__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) uint32_t raw_next_copy_avx512(
    uint32_t crc, const unsigned char* p, std::size_t n, unsigned char* d, const unsigned char* s,
    std::size_t m) {
  std::size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  if (head > m) head = m;
  std::memcpy(d, s, head);
  d += head, s += head, m -= head;
  if (n >= 4 * kFold) {
    const __m512i k = fold_vec(fold_constants().step);
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p),
                                  _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
    __m512i a1 = _mm512_loadu_si512(p + 64);
    __m512i a2 = _mm512_loadu_si512(p + 128);
    __m512i a3 = _mm512_loadu_si512(p + 192);
    p += kFold;
    n -= kFold;
    while (n >= kFold) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + 192, _MM_HINT_T0);
      a0 = fold(a0, k, _mm512_loadu_si512(p));
      a1 = fold(a1, k, _mm512_loadu_si512(p + 64));
      a2 = fold(a2, k, _mm512_loadu_si512(p + 128));
      a3 = fold(a3, k, _mm512_loadu_si512(p + 192));
      if (m >= kFold) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64 * v), _mm512_loadu_si512(s + 64 * v));
        d += kFold, s += kFold, m -= kFold;
      }
      p += kFold;
      n -= kFold;
    }
    alignas(64) unsigned char acc[kFold];
    _mm512_store_si512(acc, a0);
    _mm512_store_si512(acc + 64, a1);
    _mm512_store_si512(acc + 128, a2);
    _mm512_store_si512(acc + 192, a3);
    crc = raw_sse42(0, acc, kFold);
  }
  crc = raw_sse42(crc, p, n);
  for (; m >= 64; d += 64, s += 64, m -= 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
  std::memcpy(d, s, m);
  _mm_sfence();
  return crc;
}
#endif

using RawFn = uint32_t (*)(uint32_t, const unsigned char*, std::size_t);
using RawCopyFn = uint32_t (*)(uint32_t, unsigned char*, const unsigned char*, std::size_t);
using RawNextCopyFn = uint32_t (*)(uint32_t, const unsigned char*, std::size_t, unsigned char*,
                                   const unsigned char*, std::size_t);

struct Backend {
  RawFn fn = raw_portable;
  RawCopyFn copy_fn = nullptr;  // one-pass copy + CRC, where available
  RawNextCopyFn next_copy_fn = nullptr;  // CRC of one buffer while copying another, where available
  const char* name = "table";
  Backend() {
#ifdef UCPD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
      shift_long();  // build the tables now, not inside the first (possibly threaded) call
      shift_short();
      fn = raw_sse42;
      name = "sse4.2";
      if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
          !std::getenv("UCPD_CRC32C_NO_AVX512")) {
        fold_constants();
        fn = raw_avx512;
        copy_fn = raw_copy_avx512;
        next_copy_fn = raw_next_copy_avx512;
        name = "avx512-vpclmulqdq";
      }
    }
#endif
    tables();
    pow_table();
  }
};
const Backend& backend() {
  static const Backend b;
  return b;
}

}  // namespace

uint32_t crc32c_update(uint32_t crc, const void* data, std::size_t n) {
  return ~backend().fn(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_portable(uint32_t crc, const void* data, std::size_t n) {
  return ~raw_portable(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return multmodp(x8nmodp(len_b), crc_a) ^ crc_b;
}

uint32_t crc32c_shift_op(uint64_t len_b) { return x8nmodp(len_b); }

uint32_t crc32c_shift(uint32_t op, uint32_t crc) { return multmodp(op, crc); }

const char* crc32c_backend() { return backend().name; }

bool crc32c_copy_fused() { return backend().copy_fn != nullptr; }

uint32_t crc32c_update_while_copying(uint32_t crc, const void* data, std::size_t n, void* dst,
                                     const void* src, std::size_t m) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  if (const RawNextCopyFn f = backend().next_copy_fn) return ~f(~crc, p, n, d, s, m);
  constexpr std::size_t kBlock = 64 * 1024;
  for (std::size_t off = 0; off < std::max(n, m); off += kBlock) {
    if (off < n) crc = crc32c_update(crc, p + off, std::min(kBlock, n - off));
    if (off < m) std::memcpy(d + off, s + off, std::min(kBlock, m - off));
  }
  return crc;
}

uint32_t crc32c_copy(void* dst, const void* src, std::size_t n, uint32_t crc) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  if (const RawCopyFn f = backend().copy_fn) return ~f(~crc, d, s, n);
  constexpr std::size_t kBlock = 64 * 1024;  // checksum a block, then copy it while cached
  for (std::size_t off = 0; off < n; off += kBlock) {
    const std::size_t len = std::min(kBlock, n - off);
    crc = crc32c_update(crc, s + off, len);
    std::memcpy(d + off, s + off, len);
  }
  return crc;
}

void crc32c_chunks(const void* data, std::size_t n, std::size_t chunk, int threads, uint32_t* out) {
  if (n == 0) return;
  const auto* p = static_cast<const unsigned char*>(data);
  const std::size_t nchunks = (n + chunk - 1) / chunk;
  // Group small chunks so that a task is at least ~1 MiB of work.
  const std::size_t per_task = chunk >= (1u << 20) ? 1 : ((1u << 20) + chunk - 1) / chunk;
  const std::size_t ntasks = (nchunks + per_task - 1) / per_task;
  backend();
  parallel_for(ntasks, threads, [&](std::size_t t) {
    const std::size_t first = t * per_task;
    const std::size_t last = std::min(nchunks, first + per_task);
    for (std::size_t i = first; i < last; ++i) {
      const std::size_t off = i * chunk;
      out[i] = crc32c_update(0, p + off, std::min(chunk, n - off));
    }
  });
}

std::vector<bool> crc32c_chunks_match(const std::vector<const void*>& data, const std::vector<std::size_t>& n,
                                      const std::vector<const uint32_t*>& expected, std::size_t chunk, int threads) {
  // every chunk of every buffer is a piece; a task is a run of pieces of at least ~1 MiB
  struct Piece {
    std::size_t item, index;
  };
  std::vector<Piece> pieces;
  std::vector<std::size_t> starts{0};  // task t covers pieces [starts[t], starts[t + 1])
  std::size_t bytes = 0;
  for (std::size_t k = 0; k < data.size(); ++k) {
    for (std::size_t i = 0; i * chunk < n[k]; ++i) {
      pieces.push_back({k, i});
      bytes += std::min(chunk, n[k] - i * chunk);
      if (bytes >= (1u << 20)) {
        starts.push_back(pieces.size());
        bytes = 0;
      }
    }
  }
  if (starts.back() != pieces.size()) starts.push_back(pieces.size());
  std::unique_ptr<std::atomic<bool>[]> differs(new std::atomic<bool>[data.size()]);
  for (std::size_t k = 0; k < data.size(); ++k) differs[k].store(false, std::memory_order_relaxed);
  if (!pieces.empty()) {
    backend();
    parallel_for(starts.size() - 1, threads, [&](std::size_t t) {
      for (std::size_t j = starts[t]; j < starts[t + 1]; ++j) {
        const Piece& pc = pieces[j];
        if (differs[pc.item].load(std::memory_order_relaxed)) continue;
        const std::size_t off = pc.index * chunk;
        const uint32_t got =
            crc32c_update(0, static_cast<const unsigned char*>(data[pc.item]) + off, std::min(chunk, n[pc.item] - off));
        if (got != expected[pc.item][pc.index]) differs[pc.item].store(true, std::memory_order_relaxed);
      }
    });
  }
  std::vector<bool> out(data.size());
  for (std::size_t k = 0; k < data.size(); ++k) out[k] = !differs[k].load();
  return out;
}

}  // namespace ucpd
