// XOR parity over byte buffers of possibly unequal length.
//
// out[i] = XOR over inputs j with i < len_j of in_j[i], for every i < out_len: a shorter input
// counts as zero-padded, a longer one is truncated to out_len. Encoding a group is one call
// (out = parity); recovering a lost member is the same call with the parity and the survivors
// (out = the lost member, out_len = its length).
#pragma once

#include <cstddef>
#include <vector>

namespace ucpd {

struct ConstSpan {
  const unsigned char* data;
  std::size_t size;
};

// `out` may be exactly one of the inputs (same start, size >= out_len): the XOR then accumulates
// in place. Any other overlap between out and an input throws std::invalid_argument.
void xor_parity(unsigned char* out, std::size_t out_len, const std::vector<ConstSpan>& inputs,
                int threads);

// Name of the XOR kernel in use: "avx2" or "scalar".
const char* xor_backend();

}  // namespace ucpd
