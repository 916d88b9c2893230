// Consolidation with checksums on both sides (the flush): contiguous ranges of source tensors
// copied into windows of one contiguous destination block, each byte read once. The CRC32C of
// every piece copied is computed in the copy's pass and then combined twice: in source order into
// CRCs of the source chunks (for the caller to check against those recorded at snapshot time)
// and in destination order into the destination's chunk CRCs (the checkpoint file's), so that
// the destination is never read back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucpd {

struct CrcSource {
  const void* ptr;     // the source tensor's byte 0
  std::size_t nbytes;  // its size
  std::size_t chunk;   // its CRC chunk: chunk i covers bytes [i*chunk, (i+1)*chunk)
};

// One copy: the contiguous source range [src_offset, src_offset + numel * itemsize) into the
// destination window `shape` at element offset `dst_offset` and element strides `dst_strides`
// (row-major window order is source order). Strides >= 0, at most 16 dimensions.
struct CrcWindowCopy {
  std::size_t source;
  std::size_t src_offset;
  std::int64_t dst_offset;
  std::vector<std::int64_t> shape, dst_strides;
  std::size_t itemsize;
};

// A contiguous byte range [lo, hi) read from one chunk of one source, and its CRC32C.
struct CrcRange {
  std::size_t source, lo, hi;
  uint32_t crc;
};

struct ConsolidateResult {
  // The destination cut where dst_origin + offset is a multiple of dst_chunk (piece k covers
  // [max(0, k*C - phase), min(n, (k+1)*C - phase)) with phase = dst_origin % C): the CRC32C of
  // each piece's first dst_covered[k] bytes, the prefix that the copies wrote without a gap
  // (so the CRC is the piece's own when dst_covered[k] is the piece's length).
  std::vector<uint32_t> dst_crcs;
  std::vector<std::uint64_t> dst_covered;
  // What was read from the sources: maximal contiguous ranges inside one chunk each, sorted by
  // source then offset.
  std::vector<CrcRange> reads;
};

// Runs the copies (the windows must not overlap one another) over `threads` threads and returns
// the CRCs above. Throws std::invalid_argument for a window outside its buffer, overlapping
// windows, bad sizes or strides, a zero chunk or item size, or a null pointer with bytes to copy.
ConsolidateResult copy_crc_windows(void* dst, std::size_t dst_nbytes, std::size_t dst_origin,
                                   std::size_t dst_chunk, const std::vector<CrcSource>& sources,
                                   const std::vector<CrcWindowCopy>& copies, int threads);

}  // namespace ucpd
