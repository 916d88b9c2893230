// CUDA staging for snapshots and restores: page-locking, streams, events, and batched copies
// between device tensors and one page-locked host buffer (a shared-memory slot).
//
// Plain C++ interface (no CUDA headers) so the bindings compile with the host compiler. Built
// only when CMake finds a CUDA compiler; the runtime is linked statically and loads the driver
// at run time, so the module imports on machines without a GPU: available() is then false.
// Every function throws std::runtime_error naming the failed CUDA call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ucpd {
namespace cuda {

bool available();   // a driver and at least one device; never throws
int device_count(); // 0 without driver/device; never throws

// portable + mapped; read_only: a read-only mapping the devices only read (restore sources)
void host_register(void* ptr, std::size_t nbytes, bool read_only = false);
void host_unregister(void* ptr);

uintptr_t stream_create(int device);  // non-blocking stream
void stream_destroy(uintptr_t stream);
void stream_synchronize(uintptr_t stream);
bool stream_query(uintptr_t stream);

uintptr_t event_create(bool timing);
void event_destroy(uintptr_t event);
void event_record(uintptr_t event, uintptr_t stream);
void event_synchronize(uintptr_t event);
bool event_query(uintptr_t event);

// One tensor of a batched copy: `dev` is a device address; `host_offset` is relative to the
// page-locked host buffer passed with the batch.
struct BatchItem {
  uintptr_t dev;
  std::size_t host_offset;
  std::size_t nbytes;
};

struct BatchStats {
  std::size_t kernel_items = 0, kernel_bytes = 0;  // moved by the one packing kernel
  std::size_t memcpy_items = 0, memcpy_bytes = 0;  // moved by cudaMemcpyAsync (copy engine)
};

// Device -> host: items with nbytes < small_threshold are copied by one kernel launch that
// writes through the host buffer's device mapping; larger ones by cudaMemcpyAsync. Everything is
// ordered after the work already queued on `stream`, and later work on `stream` waits for all of
// it. host_nbytes > 0 bounds-checks every item against the buffer's size. Returns once queued.
BatchStats pack_d2h(const std::vector<BatchItem>& items, void* host_base, std::size_t host_nbytes,
                    uintptr_t stream, std::size_t small_threshold);

// Host -> device, the same rules (restore direction).
BatchStats unpack_h2d(const std::vector<BatchItem>& items, const void* host_base,
                      std::size_t host_nbytes, uintptr_t stream, std::size_t small_threshold);

void copy_h2d_async(uintptr_t dst_dev, const void* src_host, std::size_t nbytes, uintptr_t stream);
void copy_d2h_async(void* dst_host, uintptr_t src_dev, std::size_t nbytes, uintptr_t stream);

// One 2-D host -> device copy (cudaMemcpy2DAsync): `rows` rows of `width` bytes, `src_pitch`
// bytes apart in host memory and `dst_pitch` apart on the device (a column piece of a
// resharded restore). Both pitches must be >= width.
void copy_h2d_2d_async(uintptr_t dst_dev, std::size_t dst_pitch, const void* src_host,
                       std::size_t src_pitch, std::size_t width, std::size_t rows, uintptr_t stream);

}  // namespace cuda
}  // namespace ucpd
