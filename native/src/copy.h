// Parallel memcpy over the persistent thread pool, with optional CRC32C of the source
// computed in the same pass (the snapshot hot path: hundreds of tensors, GiBs, one call).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucpd {

struct CopyItem {
  void* dst;
  const void* src;
  std::size_t nbytes;
};

// How copy_batch combines checksumming with copying (crc_chunk > 0). The benchmark compares them.
enum class CrcMode {
  kFused,        // crc32c_copy: one pass (AVX-512), else kCrcThenCopy with 64 KiB blocks
  kCrcThenCopy,  // per block: CRC the source block (pulls it into cache), then copy it
  kCopyThenCrc,  // per block: copy the block, then CRC the source block while it is cached
};

struct CopyOptions {
  int threads = 1;
  std::size_t crc_chunk = 0;      // 0: no checksums
  CrcMode mode = CrcMode::kFused;
  std::size_t block = 64 * 1024;  // block size of the two-step modes
};

// Copies every item (dst and src of an item must not overlap). Work is balanced across threads
// by splitting the concatenated byte stream into equal tasks: big items are split, small ones
// grouped. With opts.crc_chunk = C > 0, returns for each item the CRC32C of each C-byte chunk
// of its source (ceil(nbytes / C) values, none for an empty item); otherwise returns {}.
std::vector<std::vector<uint32_t>> copy_batch(const std::vector<CopyItem>& items,
                                              const CopyOptions& opts);

// One contiguous copy of n bytes, split across `threads` threads when it is large enough.
void copy_parallel(void* dst, const void* src, std::size_t n, int threads);

}  // namespace ucpd
