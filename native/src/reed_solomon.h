// Systematic Reed-Solomon erasure code over GF(2^8) (polynomial x^8+x^4+x^3+x^2+1, 0x11d).
//
// k data shards and m parity shards of equal length, k >= 1, m >= 1, k + m <= 256. The
// generator is [I_k ; C] with the m x k Cauchy matrix C[i][j] = 1 / ((k + i) XOR j), so any
// k of the k + m shards determine the others (every square submatrix of C is invertible).
// Parity byte x of shard i: p_i[x] = XOR_j C[i][j] * d_j[x] (GF(2^8) multiplication).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucpd {

// GF(2^8) helpers (exposed for tests and the decoder).
uint8_t gf_mul(uint8_t a, uint8_t b);
uint8_t gf_inv(uint8_t a);  // a != 0

// Row-major m x k Cauchy parity matrix.
std::vector<uint8_t> rs_parity_matrix(int k, int m);

// out[r][0:len] = XOR_c coef[r*nin + c] * in[c][0:len] for r < nout. Outputs must not overlap
// inputs. Spread over `threads` threads by byte ranges.
void gf_matmul(const uint8_t* coef, std::size_t nout, std::size_t nin,
               const unsigned char* const* in, unsigned char* const* out, std::size_t len,
               int threads);

// parity[i] = sum_j C[i][j] * data[j]; all shards `len` bytes.
void rs_encode(const std::vector<const unsigned char*>& data,
               const std::vector<unsigned char*>& parity, std::size_t len, int threads);

// shards[0..k+m): present shards (index < k: data, else parity) are read; for every index in
// `missing` the shard is rebuilt into out[i] (out has one buffer per missing index, same order).
// Needs at least k present shards; throws std::invalid_argument otherwise.
void rs_decode(int k, int m, const std::vector<const unsigned char*>& shards,
               const std::vector<int>& missing, const std::vector<unsigned char*>& out,
               std::size_t len, int threads);

// Name of the multiply kernel in use: "gfni-avx512" (affine instruction), "avx2" (pshufb nibble
// tables) or "table".
const char* rs_backend();

}  // namespace ucpd
