#include "reed_solomon.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define UCPD_X86 1
#endif

namespace ucpd {
namespace {

constexpr unsigned kPoly = 0x11d;
constexpr std::size_t kBlock = 8 * 1024;   // bytes of every shard processed together
constexpr std::size_t kMinTask = 256 * 1024;

struct Field {
  uint8_t exp[512];
  uint8_t log[256];
  Field() {
    unsigned x = 1;
    for (int i = 0; i < 255; ++i) {
      exp[i] = static_cast<uint8_t>(x);
      log[x] = static_cast<uint8_t>(i);
      x <<= 1;
      if (x & 0x100) x ^= kPoly;
    }
    for (int i = 255; i < 512; ++i) exp[i] = exp[i - 255];
    log[0] = 0;
  }
};
const Field& field() {
  static const Field f;
  return f;
}

// Multiply-accumulate kernels: out[0:n] (^)= c * in[0:n]; `acc` false overwrites out.
struct MulTables {
  uint8_t row[256];  // c * x for every x
  uint8_t lo[16];    // c * x for x < 16
  uint8_t hi[16];    // c * (x << 4)
};
void make_tables(uint8_t c, MulTables& t) {
  for (int x = 0; x < 256; ++x) t.row[x] = gf_mul(c, static_cast<uint8_t>(x));
  for (int x = 0; x < 16; ++x) t.lo[x] = t.row[x], t.hi[x] = t.row[x << 4];
}

using MulFn = void (*)(const MulTables&, const unsigned char*, unsigned char*, std::size_t, bool);

void mul_table(const MulTables& t, const unsigned char* in, unsigned char* out, std::size_t n,
               bool acc) {
  if (acc)
    for (std::size_t x = 0; x < n; ++x) out[x] ^= t.row[in[x]];
  else
    for (std::size_t x = 0; x < n; ++x) out[x] = t.row[in[x]];
}

#ifdef UCPD_X86
__attribute__((target("avx2"))) void mul_avx2(const MulTables& t, const unsigned char* in,
                                              unsigned char* out, std::size_t n, bool acc) {
  const __m256i tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.lo)));
  const __m256i thi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.hi)));
  const __m256i mask = _mm256_set1_epi8(0x0f);
  std::size_t x = 0;
  for (; x + 64 <= n; x += 64) {
    __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + x));
    __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + x + 32));
    __m256i p0 = _mm256_xor_si256(_mm256_shuffle_epi8(tlo, _mm256_and_si256(v0, mask)),
                                  _mm256_shuffle_epi8(thi, _mm256_and_si256(_mm256_srli_epi64(v0, 4), mask)));
    __m256i p1 = _mm256_xor_si256(_mm256_shuffle_epi8(tlo, _mm256_and_si256(v1, mask)),
                                  _mm256_shuffle_epi8(thi, _mm256_and_si256(_mm256_srli_epi64(v1, 4), mask)));
    if (acc) {
      p0 = _mm256_xor_si256(p0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + x)));
      p1 = _mm256_xor_si256(p1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + x + 32)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x), p0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + x + 32), p1);
  }
  mul_table(t, in + x, out + x, n - x, acc);
}
#endif

// The bit matrix of "multiply by c" for GF2P8AFFINEQB: byte 7-i of the result holds, in bit j,
// bit i of c * x^j, so output bit i = parity(row_i & input).
uint64_t affine_matrix(uint8_t c) {
  uint64_t a = 0;
  for (int i = 0; i < 8; ++i) {
    uint64_t row = 0;
    for (int j = 0; j < 8; ++j)
      if ((gf_mul(c, static_cast<uint8_t>(1u << j)) >> i) & 1) row |= 1u << j;
    a |= row << (8 * (7 - i));
  }
  return a;
}

// Whole-block kernel: out[r][x] = XOR_c coef[r][c] * in[c][x] for x in [lo, lo + n).
using BlockFn = void (*)(const uint64_t* mats, std::size_t nout, std::size_t nin,
                         const unsigned char* const* in, unsigned char* const* out,
                         std::size_t lo, std::size_t n);

#ifdef UCPD_X86
// GFNI: one affine instruction multiplies 64 bytes by a constant; outputs stay in a register
// until every input has been added.
__attribute__((target("gfni,avx512f,avx512bw"))) void block_gfni(
    const uint64_t* mats, std::size_t nout, std::size_t nin, const unsigned char* const* in,
    unsigned char* const* out, std::size_t lo, std::size_t n) {
  const std::size_t end = lo + n;
  for (std::size_t x = lo; x < end; x += 64) {
    const std::size_t len = std::min<std::size_t>(64, end - x);
    const __mmask64 mask = len == 64 ? ~__mmask64(0) : ((__mmask64(1) << len) - 1);
    for (std::size_t r = 0; r < nout; ++r) {
      __m512i acc = _mm512_setzero_si512();
      for (std::size_t c = 0; c < nin; ++c) {
        const __m512i v = _mm512_maskz_loadu_epi8(mask, in[c] + x);
        const __m512i a = _mm512_set1_epi64(static_cast<long long>(mats[r * nin + c]));
        acc = _mm512_xor_si512(acc, _mm512_gf2p8affine_epi64_epi8(v, a, 0));
      }
      _mm512_mask_storeu_epi8(out[r] + x, mask, acc);
    }
  }
}
#endif

struct Backend {
  MulFn fn = mul_table;
  BlockFn block = nullptr;  // preferred when set
  const char* name = "table";
  Backend() {
#ifdef UCPD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) fn = mul_avx2, name = "avx2";
    if (__builtin_cpu_supports("gfni") && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && !std::getenv("UCPD_RS_NO_GFNI"))
      block = block_gfni, name = "gfni-avx512";
#endif
    field();
  }
};
const Backend& backend() {
  static const Backend b;
  return b;
}

// In-place Gauss-Jordan inverse of an n x n matrix over GF(2^8); false if singular.
bool invert(std::vector<uint8_t>& a, int n) {
  std::vector<uint8_t> inv(static_cast<std::size_t>(n) * n, 0);
  for (int i = 0; i < n; ++i) inv[i * n + i] = 1;
  for (int col = 0; col < n; ++col) {
    int piv = col;
    while (piv < n && a[piv * n + col] == 0) ++piv;
    if (piv == n) return false;
    if (piv != col)
      for (int j = 0; j < n; ++j) std::swap(a[piv * n + j], a[col * n + j]), std::swap(inv[piv * n + j], inv[col * n + j]);
    const uint8_t s = gf_inv(a[col * n + col]);
    for (int j = 0; j < n; ++j) a[col * n + j] = gf_mul(a[col * n + j], s), inv[col * n + j] = gf_mul(inv[col * n + j], s);
    for (int r = 0; r < n; ++r) {
      const uint8_t f = a[r * n + col];
      if (r == col || f == 0) continue;
      for (int j = 0; j < n; ++j) a[r * n + j] ^= gf_mul(f, a[col * n + j]), inv[r * n + j] ^= gf_mul(f, inv[col * n + j]);
    }
  }
  a.swap(inv);
  return true;
}

void check_km(int k, int m) {
  if (k < 1 || m < 1 || k + m > 256)
    throw std::invalid_argument("reed-solomon: need k >= 1, m >= 1 and k + m <= 256 (got k=" +
                                std::to_string(k) + ", m=" + std::to_string(m) + ")");
}

}  // namespace

uint8_t gf_mul(uint8_t a, uint8_t b) {
  if (a == 0 || b == 0) return 0;
  const Field& f = field();
  return f.exp[f.log[a] + f.log[b]];
}

uint8_t gf_inv(uint8_t a) {
  const Field& f = field();
  return f.exp[255 - f.log[a]];
}

const char* rs_backend() { return backend().name; }

std::vector<uint8_t> rs_parity_matrix(int k, int m) {
  check_km(k, m);
  std::vector<uint8_t> c(static_cast<std::size_t>(m) * k);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j) c[i * k + j] = gf_inv(static_cast<uint8_t>((k + i) ^ j));
  return c;
}

void gf_matmul(const uint8_t* coef, std::size_t nout, std::size_t nin,
               const unsigned char* const* in, unsigned char* const* out, std::size_t len,
               int threads) {
  if (len == 0 || nout == 0) return;
  const MulFn fn = backend().fn;
  const BlockFn block = nin ? backend().block : nullptr;
  std::vector<MulTables> tabs(block ? 0 : nout * nin);
  for (std::size_t i = 0; i < tabs.size(); ++i) make_tables(coef[i], tabs[i]);
  std::vector<uint64_t> mats(block ? nout * nin : 0);
  for (std::size_t i = 0; i < mats.size(); ++i) mats[i] = affine_matrix(coef[i]);

  std::size_t per_task = std::max(kMinTask, len / (std::max(1, threads) * 4) + 1);
  per_task = (per_task + kBlock - 1) / kBlock * kBlock;
  const std::size_t ntasks = (len + per_task - 1) / per_task;
  parallel_for(ntasks, threads, [&](std::size_t t) {
    const std::size_t end = std::min(len, (t + 1) * per_task);
    for (std::size_t lo = t * per_task; lo < end; lo += kBlock) {
      const std::size_t n = std::min(end, lo + kBlock) - lo;
      if (block) {
        block(mats.data(), nout, nin, in, out, lo, n);
        continue;
      }
      for (std::size_t r = 0; r < nout; ++r) {
        if (nin == 0) {
          std::memset(out[r] + lo, 0, n);
          continue;
        }
        for (std::size_t c = 0; c < nin; ++c) fn(tabs[r * nin + c], in[c] + lo, out[r] + lo, n, c > 0);
      }
    }
  });
}

void rs_encode(const std::vector<const unsigned char*>& data,
               const std::vector<unsigned char*>& parity, std::size_t len, int threads) {
  const int k = static_cast<int>(data.size()), m = static_cast<int>(parity.size());
  const std::vector<uint8_t> c = rs_parity_matrix(k, m);
  gf_matmul(c.data(), m, k, data.data(), parity.data(), len, threads);
}

void rs_decode(int k, int m, const std::vector<const unsigned char*>& shards,
               const std::vector<int>& missing, const std::vector<unsigned char*>& out,
               std::size_t len, int threads) {
  check_km(k, m);
  if (shards.size() != static_cast<std::size_t>(k + m) || out.size() != missing.size())
    throw std::invalid_argument("rs_decode: need k + m shards and one output per missing shard");
  std::vector<bool> is_missing(k + m, false);
  for (int i : missing) {
    if (i < 0 || i >= k + m || is_missing[i])
      throw std::invalid_argument("rs_decode: bad or repeated missing index " + std::to_string(i));
    is_missing[i] = true;
  }
  // Use the first k present shards (data shards first: their generator rows are unit rows).
  std::vector<int> use;
  for (int i = 0; i < k + m && static_cast<int>(use.size()) < k; ++i)
    if (!is_missing[i] && shards[i]) use.push_back(i);
  if (static_cast<int>(use.size()) < k)
    throw std::invalid_argument("rs_decode: only " + std::to_string(use.size()) + " of " +
                                std::to_string(k + m) + " shards present, need k=" + std::to_string(k));
  if (missing.empty()) return;

  const std::vector<uint8_t> c = rs_parity_matrix(k, m);
  auto gen_row = [&](int i, uint8_t* row) {  // generator row of shard i, k entries
    if (i < k) {
      std::fill(row, row + k, 0);
      row[i] = 1;
    } else {
      std::copy(c.begin() + (i - k) * k, c.begin() + (i - k + 1) * k, row);
    }
  };
  std::vector<uint8_t> a(static_cast<std::size_t>(k) * k);
  for (int r = 0; r < k; ++r) gen_row(use[r], &a[r * k]);
  if (!invert(a, k)) throw std::runtime_error("rs_decode: singular decode matrix (bug)");

  // Shard i = gen_row(i) * data = gen_row(i) * inv(A) * used shards.
  std::vector<uint8_t> coef(missing.size() * k, 0), g(k);
  for (std::size_t r = 0; r < missing.size(); ++r) {
    gen_row(missing[r], g.data());
    for (int j = 0; j < k; ++j) {
      uint8_t s = 0;
      for (int l = 0; l < k; ++l) s ^= gf_mul(g[l], a[l * k + j]);
      coef[r * k + j] = s;
    }
  }
  std::vector<const unsigned char*> in(k);
  for (int j = 0; j < k; ++j) in[j] = shards[use[j]];
  gf_matmul(coef.data(), missing.size(), k, in.data(), out.data(), len, threads);
}

}  // namespace ucpd
