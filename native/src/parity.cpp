#include "parity.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define UCPD_X86 1
#endif

namespace ucpd {
namespace {

constexpr std::size_t kBlock = 16 * 1024;    // inputs are walked together, one block at a time
constexpr std::size_t kMinTask = 1u << 20;   // bytes of out per parallel task (at least)

// out[0:n] = (acc ? out[0:n] : 0) ^ src[0][0:n] ^ ... ^ src[cnt-1][0:n]
using XorFn = void (*)(unsigned char*, const unsigned char* const*, std::size_t, std::size_t, bool);

inline uint64_t ld64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}
inline void st64(unsigned char* p, uint64_t w) { std::memcpy(p, &w, 8); }

void xor_scalar(unsigned char* out, const unsigned char* const* src, std::size_t cnt,
                std::size_t n, bool acc) {
  std::size_t x = 0;
  for (; x + 32 <= n; x += 32) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    if (acc) a0 = ld64(out + x), a1 = ld64(out + x + 8), a2 = ld64(out + x + 16), a3 = ld64(out + x + 24);
    for (std::size_t j = 0; j < cnt; ++j) {
      const unsigned char* s = src[j] + x;
      a0 ^= ld64(s), a1 ^= ld64(s + 8), a2 ^= ld64(s + 16), a3 ^= ld64(s + 24);
    }
    st64(out + x, a0), st64(out + x + 8, a1), st64(out + x + 16, a2), st64(out + x + 24, a3);
  }
  for (; x < n; ++x) {
    unsigned char a = acc ? out[x] : 0;
    for (std::size_t j = 0; j < cnt; ++j) a ^= src[j][x];
    out[x] = a;
  }
}

#ifdef UCPD_X86
__attribute__((target("avx2"))) void xor_avx2(unsigned char* out, const unsigned char* const* src,
                                              std::size_t cnt, std::size_t n, bool acc) {
  std::size_t x = 0;
  for (; x + 128 <= n; x += 128) {
    __m256i a0, a1, a2, a3;
    if (acc) {
      a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + x));
      a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + x + 32));
      a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + x + 64));
      a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + x + 96));
    } else {
      a0 = a1 = a2 = a3 = _mm256_setzero_si256();
    }
    for (std::size_t j = 0; j < cnt; ++j) {
      const unsigned char* s = src[j] + x;
      a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
      a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64)));
      a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x + 32), a1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x + 64), a2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x + 96), a3);
  }
  if (x < n) {
    const unsigned char* tail[256];
    const unsigned char* const* t = src;
    if (cnt <= 256) {
      for (std::size_t j = 0; j < cnt; ++j) tail[j] = src[j] + x;
      t = tail;
      xor_scalar(out + x, t, cnt, n - x, acc);
    } else {
      for (; x < n; ++x) {
        unsigned char a = acc ? out[x] : 0;
        for (std::size_t j = 0; j < cnt; ++j) a ^= src[j][x];
        out[x] = a;
      }
    }
  }
}
#endif

struct Backend {
  XorFn fn = xor_scalar;
  const char* name = "scalar";
  Backend() {
#ifdef UCPD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) fn = xor_avx2, name = "avx2";
#endif
  }
};
const Backend& backend() {
  static const Backend b;
  return b;
}

bool overlaps(const unsigned char* a, std::size_t an, const unsigned char* b, std::size_t bn) {
  return an && bn && a < b + bn && b < a + an;
}

}  // namespace

const char* xor_backend() { return backend().name; }

void xor_parity(unsigned char* out, std::size_t out_len, const std::vector<ConstSpan>& inputs,
                int threads) {
  // Find the input that is `out` itself (accumulate in place) and reject other overlaps.
  std::size_t alias = SIZE_MAX;
  for (std::size_t j = 0; j < inputs.size(); ++j) {
    const ConstSpan& in = inputs[j];
    const std::size_t used = std::min(in.size, out_len);
    if (!overlaps(out, out_len, in.data, used)) continue;
    if (in.data == out && in.size >= out_len && alias == SIZE_MAX) {
      alias = j;
      continue;
    }
    throw std::invalid_argument(
        "xor_parity: an input overlaps out; out may only be exactly one of the inputs "
        "(same start, at least as long)");
  }
  if (out_len == 0) return;
  const XorFn fn = backend().fn;

  std::size_t per_task = std::max(kMinTask, out_len / (std::max(1, threads) * 4) + 1);
  per_task = (per_task + kBlock - 1) / kBlock * kBlock;
  const std::size_t ntasks = (out_len + per_task - 1) / per_task;

  parallel_for(ntasks, threads, [&](std::size_t t) {
    std::vector<const unsigned char*> full;
    full.reserve(inputs.size());
    const std::size_t end = std::min(out_len, (t + 1) * per_task);
    for (std::size_t lo = t * per_task; lo < end; lo += kBlock) {
      const std::size_t hi = std::min(end, lo + kBlock);
      full.clear();
      for (std::size_t j = 0; j < inputs.size(); ++j)
        if (j != alias && inputs[j].size >= hi) full.push_back(inputs[j].data + lo);
      fn(out + lo, full.data(), full.size(), hi - lo, alias != SIZE_MAX);
      // Inputs that end inside this block contribute their remaining prefix.
      for (std::size_t j = 0; j < inputs.size(); ++j) {
        const ConstSpan& in = inputs[j];
        if (j == alias || in.size >= hi || in.size <= lo) continue;
        const unsigned char* p = in.data + lo;
        fn(out + lo, &p, 1, in.size - lo, true);
      }
    }
  });
}

}  // namespace ucpd
