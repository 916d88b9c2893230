#include "cuda_stage.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace ucpd {
namespace cuda {
namespace {

constexpr std::size_t kTile = 64 * 1024;  // bytes per kernel block (items are cut into tiles)
constexpr int kBlockThreads = 256;

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear the sticky-free error so the next call starts clean
  throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(e) + ": " +
                           cudaGetErrorString(e));
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t as_event(uintptr_t e) { return reinterpret_cast<cudaEvent_t>(e); }

// One tile of the batch: copy n bytes src -> dst (both device-accessible addresses).
struct Desc {
  const unsigned char* src;
  unsigned char* dst;
  unsigned long long n;
};

// Copies with words of type W once src and dst are both W-aligned (their misalignment is equal).
template <typename W>
__device__ void copy_words(const unsigned char* s, unsigned char* d, unsigned long long n) {
  const unsigned long long mis = reinterpret_cast<uintptr_t>(s) % sizeof(W);
  unsigned long long head = mis ? sizeof(W) - mis : 0;
  if (head > n) head = n;
  for (unsigned long long i = threadIdx.x; i < head; i += blockDim.x) d[i] = s[i];
  s += head, d += head, n -= head;
  const unsigned long long words = n / sizeof(W);
  const W* sw = reinterpret_cast<const W*>(s);
  W* dw = reinterpret_cast<W*>(d);
  for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) dw[i] = sw[i];
  for (unsigned long long i = words * sizeof(W) + threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

__global__ void batch_copy_kernel(const Desc* descs) {
  const Desc t = descs[blockIdx.x];
  const uintptr_t rel = reinterpret_cast<uintptr_t>(t.src) ^ reinterpret_cast<uintptr_t>(t.dst);
  if ((rel & 15) == 0)
    copy_words<uint4>(t.src, t.dst, t.n);  // 16-byte loads and stores
  else if ((rel & 7) == 0)
    copy_words<unsigned long long>(t.src, t.dst, t.n);
  else if ((rel & 3) == 0)
    copy_words<unsigned int>(t.src, t.dst, t.n);
  else
    copy_words<unsigned char>(t.src, t.dst, t.n);
}

// A descriptor table: pinned host staging + device copy, reusable once `done` has fired.
struct Table {
  Desc* host = nullptr;
  Desc* dev = nullptr;
  std::size_t cap = 0;
  cudaEvent_t done = nullptr;
};

// Per-device state: a side stream for the kernel (so it overlaps the copy-engine transfers on
// the caller's stream), fork/join events, and recycled descriptor tables.
struct DeviceState {
  std::mutex mu;
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  std::vector<Table> tables;
};

std::mutex g_mu;
std::map<int, DeviceState*> g_devices;  // never freed: lives as long as the process

DeviceState& device_state(int dev) {
  std::lock_guard<std::mutex> g(g_mu);
  DeviceState*& s = g_devices[dev];
  if (!s) {
    auto* st = new DeviceState();
    check(cudaStreamCreateWithFlags(&st->side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaEventCreateWithFlags(&st->fork, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventCreateWithFlags(&st->join, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s = st;
  }
  return *s;
}

// A table with room for n descriptors whose previous use has finished (caller holds st.mu).
Table& acquire_table(DeviceState& st, std::size_t n) {
  for (Table& t : st.tables)
    if (t.cap >= n && cudaEventQuery(t.done) == cudaSuccess) return t;
  cudaGetLastError();  // cudaErrorNotReady from the queries is not an error
  Table t;
  t.cap = std::max<std::size_t>(1024, n);
  check(cudaMallocHost(&t.host, t.cap * sizeof(Desc)), "cudaMallocHost(descriptors)");
  check(cudaMalloc(&t.dev, t.cap * sizeof(Desc)), "cudaMalloc(descriptors)");
  check(cudaEventCreateWithFlags(&t.done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  st.tables.push_back(t);
  return st.tables.back();
}

int stream_device(cudaStream_t s) {
  int dev = 0;
  if (s == nullptr || cudaStreamGetDevice(s, &dev) != cudaSuccess) {
    cudaGetLastError();
    check(cudaGetDevice(&dev), "cudaGetDevice");
  }
  return dev;
}

// Shared by both directions. to_host: dev -> host (pack), else host -> dev (unpack).
BatchStats batch(const std::vector<BatchItem>& items, unsigned char* host_base,
                 std::size_t host_nbytes, uintptr_t stream_handle, std::size_t small, bool to_host) {
  BatchStats stats;
  cudaStream_t stream = as_stream(stream_handle);
  const int dev = stream_device(stream);
  check(cudaSetDevice(dev), "cudaSetDevice");

  std::size_t ntiles = 0;
  for (const BatchItem& it : items) {
    if (host_nbytes && (it.host_offset > host_nbytes || it.nbytes > host_nbytes - it.host_offset))
      throw std::invalid_argument("batched copy: item [" + std::to_string(it.host_offset) + ", +" +
                                  std::to_string(it.nbytes) + ") lies outside the host buffer of " +
                                  std::to_string(host_nbytes) + " bytes");
    if (it.nbytes && it.nbytes < small) ntiles += (it.nbytes + kTile - 1) / kTile;
  }

  unsigned char* host_dev = nullptr;  // the host buffer as the device sees it
  if (ntiles) {
    void* p = nullptr;
    cudaError_t e = cudaHostGetDevicePointer(&p, host_base, 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(
          "batched copy: the host buffer is not page-locked and mapped (call host_register on it "
          "first): cudaHostGetDevicePointer: " + std::string(cudaGetErrorName(e)));
    }
    host_dev = static_cast<unsigned char*>(p);
  }

  DeviceState& st = device_state(dev);
  std::lock_guard<std::mutex> g(st.mu);
  if (ntiles) {
    // Fork: the side stream waits for what is already queued on the caller's stream.
    check(cudaEventRecord(st.fork, stream), "cudaEventRecord(fork)");
    check(cudaStreamWaitEvent(st.side, st.fork, 0), "cudaStreamWaitEvent(fork)");
  }
  // Large items: one copy-engine transfer each, on the caller's stream.
  for (const BatchItem& it : items) {
    if (it.nbytes == 0 || it.nbytes < small) continue;
    if (to_host)
      check(cudaMemcpyAsync(host_base + it.host_offset, reinterpret_cast<const void*>(it.dev),
                            it.nbytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync(D2H)");
    else
      check(cudaMemcpyAsync(reinterpret_cast<void*>(it.dev), host_base + it.host_offset, it.nbytes,
                            cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync(H2D)");
    ++stats.memcpy_items;
    stats.memcpy_bytes += it.nbytes;
  }
  if (ntiles) {
    // Small items: one descriptor per tile, one H2D copy of the table, one kernel launch.
    Table& t = acquire_table(st, ntiles);
    std::size_t k = 0;
    for (const BatchItem& it : items) {
      if (it.nbytes == 0 || it.nbytes >= small) continue;
      unsigned char* dptr = reinterpret_cast<unsigned char*>(it.dev);
      unsigned char* hptr = host_dev + it.host_offset;
      for (std::size_t off = 0; off < it.nbytes; off += kTile) {
        const std::size_t n = std::min(kTile, it.nbytes - off);
        t.host[k++] = to_host ? Desc{dptr + off, hptr + off, n} : Desc{hptr + off, dptr + off, n};
      }
      ++stats.kernel_items;
      stats.kernel_bytes += it.nbytes;
    }
    check(cudaMemcpyAsync(t.dev, t.host, ntiles * sizeof(Desc), cudaMemcpyHostToDevice, st.side),
          "cudaMemcpyAsync(descriptors)");
    batch_copy_kernel<<<static_cast<unsigned>(ntiles), kBlockThreads, 0, st.side>>>(t.dev);
    check(cudaGetLastError(), "batch_copy_kernel launch");
    check(cudaEventRecord(t.done, st.side), "cudaEventRecord(table)");
    // Join: later work on the caller's stream waits for the kernel too.
    check(cudaEventRecord(st.join, st.side), "cudaEventRecord(join)");
    check(cudaStreamWaitEvent(stream, st.join, 0), "cudaStreamWaitEvent(join)");
  }
  return stats;
}

}  // namespace

bool available() { return device_count() > 0; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void host_register(void* ptr, std::size_t nbytes, bool read_only) {
  unsigned flags = cudaHostRegisterPortable | cudaHostRegisterMapped;
  if (read_only) flags |= cudaHostRegisterReadOnly;
  check(cudaHostRegister(ptr, nbytes, flags), "cudaHostRegister");
}

void host_unregister(void* ptr) { check(cudaHostUnregister(ptr), "cudaHostUnregister"); }

uintptr_t stream_create(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return reinterpret_cast<uintptr_t>(s);
}
void stream_destroy(uintptr_t s) { check(cudaStreamDestroy(as_stream(s)), "cudaStreamDestroy"); }
void stream_synchronize(uintptr_t s) {
  check(cudaStreamSynchronize(as_stream(s)), "cudaStreamSynchronize");
}
bool stream_query(uintptr_t s) {
  cudaError_t e = cudaStreamQuery(as_stream(s));
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(e, "cudaStreamQuery");
  return true;
}

uintptr_t event_create(bool timing) {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
        "cudaEventCreateWithFlags");
  return reinterpret_cast<uintptr_t>(e);
}
void event_destroy(uintptr_t e) { check(cudaEventDestroy(as_event(e)), "cudaEventDestroy"); }
void event_record(uintptr_t e, uintptr_t s) {
  check(cudaEventRecord(as_event(e), as_stream(s)), "cudaEventRecord");
}
void event_synchronize(uintptr_t e) { check(cudaEventSynchronize(as_event(e)), "cudaEventSynchronize"); }
bool event_query(uintptr_t e) {
  cudaError_t r = cudaEventQuery(as_event(e));
  if (r == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(r, "cudaEventQuery");
  return true;
}

BatchStats pack_d2h(const std::vector<BatchItem>& items, void* host_base, std::size_t host_nbytes,
                    uintptr_t stream, std::size_t small_threshold) {
  return batch(items, static_cast<unsigned char*>(host_base), host_nbytes, stream,
               small_threshold, true);
}

BatchStats unpack_h2d(const std::vector<BatchItem>& items, const void* host_base,
                      std::size_t host_nbytes, uintptr_t stream, std::size_t small_threshold) {
  return batch(items, static_cast<unsigned char*>(const_cast<void*>(host_base)), host_nbytes,
               stream, small_threshold, false);
}

void copy_h2d_async(uintptr_t dst_dev, const void* src_host, std::size_t nbytes, uintptr_t stream) {
  check(cudaMemcpyAsync(reinterpret_cast<void*>(dst_dev), src_host, nbytes, cudaMemcpyHostToDevice,
                        as_stream(stream)), "cudaMemcpyAsync(H2D)");
}

void copy_d2h_async(void* dst_host, uintptr_t src_dev, std::size_t nbytes, uintptr_t stream) {
  check(cudaMemcpyAsync(dst_host, reinterpret_cast<const void*>(src_dev), nbytes,
                        cudaMemcpyDeviceToHost, as_stream(stream)), "cudaMemcpyAsync(D2H)");
}

void copy_h2d_2d_async(uintptr_t dst_dev, std::size_t dst_pitch, const void* src_host,
                       std::size_t src_pitch, std::size_t width, std::size_t rows, uintptr_t stream) {
  if (src_pitch < width || dst_pitch < width)
    throw std::invalid_argument("copy_h2d_2d_async: a pitch is smaller than the row width");
  check(cudaMemcpy2DAsync(reinterpret_cast<void*>(dst_dev), dst_pitch, src_host, src_pitch, width,
                          rows, cudaMemcpyHostToDevice, as_stream(stream)),
        "cudaMemcpy2DAsync(H2D)");
}

}  // namespace cuda
}  // namespace ucpd
