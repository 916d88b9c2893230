// Scatter with checksums: a contiguous source range copied into a strided destination window,
// CRC32C of the source computed in the same pass (restoring a whole tensor from shards that
// split it on an inner dimension: each source is read once, contiguously).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucpd {

struct ScatterResult {
  std::size_t first_chunk;      // index (in the source tensor) of crcs[0]
  std::vector<uint32_t> crcs;   // CRC32C of each whole chunk inside the copied source range
};

// Copies the elements of the row-major window `shape` (ndim <= 16) from the contiguous source
// `src` into `dst` at element strides `dst_strides` (>= 0). `src_offset` is the byte offset of
// `src` inside its source tensor: CRC chunks are `chunk` bytes from the tensor's start, and only
// chunks wholly inside [src_offset, src_offset + bytes) are checksummed (the partial ones at the
// edges are the caller's to verify). Chunks are spread over `threads` threads.
// Throws std::invalid_argument on bad sizes, strides, or a chunk not a multiple of itemsize.
ScatterResult scatter_crc(void* dst, const std::vector<std::int64_t>& dst_strides, const void* src,
                          const std::vector<std::int64_t>& shape, std::size_t itemsize,
                          std::size_t chunk, std::size_t src_offset, int threads);

struct ScatterItem {
  void* dst;
  std::vector<std::int64_t> dst_strides;
  const void* src;
  std::vector<std::int64_t> shape;
  std::size_t itemsize, chunk, src_offset;
};

// Many scatters in one call: every item's chunk-sized units share one task list, so the threads
// stay busy however small each item is. Same per-item semantics as scatter_crc.
std::vector<ScatterResult> scatter_crc_batch(const std::vector<ScatterItem>& items, int threads);

}  // namespace ucpd
