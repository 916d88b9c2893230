// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), bit-compatible with the `crc32c`
// PyPI package, iSCSI and ext4: initial value 0, pre- and post-inverted register.
//
// Streaming: crc32c_update(crc32c_update(0, a), b) == crc32c_update(0, a + b).
// The fastest available backend is chosen once at run time (cpuid): the SSE4.2 crc32
// instruction over three interleaved streams, else a portable slicing-by-8 table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucpd {

// CRC of `n` bytes at `data`, continuing from the CRC `crc` of the preceding bytes (0 to start).
uint32_t crc32c_update(uint32_t crc, const void* data, std::size_t n);

// The portable table implementation (always available; used by tests to check the fast path).
uint32_t crc32c_portable(uint32_t crc, const void* data, std::size_t n);

// CRC of A+B from crc(A), crc(B) and len(B). O(log len_b) carry-less multiplications.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// crc32c_combine in two steps, for many combines over the same lengths: the operator for
// len_b (O(log len_b)), then its application (one GF(2) product):
//   crc32c_combine(a, b, n) == crc32c_shift(crc32c_shift_op(n), a) ^ b
uint32_t crc32c_shift_op(uint64_t len_b);
uint32_t crc32c_shift(uint32_t op, uint32_t crc);

// Name of the backend in use: "sse4.2" or "table".
const char* crc32c_backend();

// Copies n bytes src -> dst (no overlap) and returns the CRC of the source continuing from `crc`,
// in one pass where the CPU allows it (AVX-512 + VPCLMULQDQ: each 256-byte step is loaded once,
// streamed to dst and folded into the CRC); otherwise block by block (checksum, then copy).
// The one-pass path writes with streaming stores: meant for large copies.
uint32_t crc32c_copy(void* dst, const void* src, std::size_t n, uint32_t crc);
bool crc32c_copy_fused();  // whether crc32c_copy is the one-pass kernel

// The CRC of `data` (n bytes, continuing `crc`) while m bytes are copied src -> dst, in one loop
// where the CPU allows it (AVX-512 + VPCLMULQDQ, streaming stores), else block by block: a
// pipeline that checksums the next chunk while it copies the one it just checked.
uint32_t crc32c_update_while_copying(uint32_t crc, const void* data, std::size_t n, void* dst,
                                     const void* src, std::size_t m);

// Per-chunk CRCs: out[i] = crc32c of bytes [i*chunk, min((i+1)*chunk, n)). `out` holds
// ceil(n / chunk) values (none when n == 0). Chunks are spread over `threads` threads.
void crc32c_chunks(const void* data, std::size_t n, std::size_t chunk, int threads, uint32_t* out);

// Whether every chunk CRC of each buffer (data[k], n[k]) equals expected[k][i] (ceil(n[k] / chunk)
// values each): one parallel pass over the chunks of all buffers (small buffers grouped into
// ~1 MiB tasks), a buffer's remaining chunks skipped once one differs. Read-only: the incremental
// snapshot's check of the tensors that may not have changed.
std::vector<bool> crc32c_chunks_match(const std::vector<const void*>& data, const std::vector<std::size_t>& n,
                                      const std::vector<const uint32_t*>& expected, std::size_t chunk, int threads);

}  // namespace ucpd
