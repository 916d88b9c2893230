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
  uint32_t crc_init = 0;  // kCrcOnly: the item's first chunk continues this CRC (0: a fresh one)
};

// How copy_batch combines checksumming with copying (crc_chunk > 0). The benchmark compares them.
enum class CrcMode {
  kFused,        // crc32c_copy: one pass (AVX-512), else kCrcThenCopy with 64 KiB blocks
  kCrcThenCopy,  // per block: CRC the source block (pulls it into cache), then copy it
  kCopyThenCrc,  // per block: copy the block, then CRC the source block while it is cached
  kCrcOnly,      // checksum the source, copy nothing (dst is not used): crc32c_batch
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

// A chunk copy_batch_verified did not copy: its item, chunk number and the CRC32C found.
struct BadChunk {
  std::size_t item;
  std::size_t chunk;
  uint32_t crc;
};

// Copies every item chunk by chunk, each C-byte chunk of its source (from the item's start)
// checksummed first and copied only if its CRC32C equals expected[item][chunk], while it is
// still in cache (the source is read from RAM once; a damaged chunk is never written). Chunks
// are shared across threads. Returns the chunks not copied, sorted. expected[item] must hold
// ceil(nbytes / C) values (std::invalid_argument otherwise).
std::vector<BadChunk> copy_batch_verified(const std::vector<CopyItem>& items,
                                          const std::vector<std::vector<uint32_t>>& expected,
                                          std::size_t C, int threads);

// One contiguous copy of n bytes, split across `threads` threads when it is large enough.
void copy_parallel(void* dst, const void* src, std::size_t n, int threads);

constexpr int kMaxStridedDims = 16;

// Copies the N-D window `shape` (ndim <= kMaxStridedDims; ndim 0 is one element) from src to
// dst. Strides are in elements of `itemsize` bytes, one per dimension and side, all >= 0 (any
// order). Dimensions are reordered (destination-stride order), size-1 ones dropped and
// neighbours contiguous on both sides merged; the innermost run contiguous on both sides is
// copied with memcpy (streaming stores for long runs), otherwise element by element. Work is
// split across `threads` threads in balanced pieces (rows, or parts of rows when there are few);
// windows under 512 KiB run inline. A destination dimension of stride 0 receives its last index
// (as numpy's copyto); other aliasing destination elements and src/dst overlap are the caller's
// problem. Throws std::invalid_argument for bad sizes/strides, or null pointers with a non-zero
// volume. A zero-volume window copies nothing (pointers may be null).
void copy_strided(void* dst, const std::vector<std::int64_t>& dst_strides, const void* src,
                  const std::vector<std::int64_t>& src_strides,
                  const std::vector<std::int64_t>& shape, std::size_t itemsize, int threads);

// One run of a strided window: with streaming stores (no read-for-ownership of the destination,
// no cache pollution) when the run is long enough and the CPU has them (returns true), else
// memcpy (returns false). Issues no fence: call stream_fence() after the last streamed run,
// before the copied bytes are handed to another thread.
bool copy_run_streaming(void* dst, const void* src, std::size_t n);
void stream_fence();

}  // namespace ucpd
