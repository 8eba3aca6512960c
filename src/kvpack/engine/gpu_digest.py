"""SHA-256 of many independent messages on a CUDA device (chunk verification on the GPU).

A verified restore has to hash every byte twice (the object's SHA-256 and the content-ID
HMAC over the plaintext). On the CPU that is the whole restore budget: 8.6 GB of hashing for
a 32k-token 8B-shape cache, about 0.54 s on 16 cores. The bytes have to go to the GPU
anyway, and every chunk's two hashes are independent of every other chunk's, so the GPU
can run thousands of them at once.

SHA-256 of one message is a chain of 64-round compressions, so a launch takes as long as its
longest message, and that latency is what a restore waits for after its last upload. A lone
thread per message was bound by its integer pipe (the schedule's expansion and the rounds
issue on the same scheduler of the multiprocessor): 58.7 ms for a 2 MiB message on the H200.
The kernel therefore gives each group of 32 messages two warps, which land on different
schedulers: warp 0 reads every 64-byte block and expands its schedule into shared memory as
``K[t] + W[t]`` (two stages, named barriers), warp 1 runs the rounds from there: 35.1 ms for
the same message, 244 GB/s over 4,096 of them (146 before;
reproduce with ``benchmarks/diag_gpu_sha256.py --mib 2 --jobs 1,256,4096``).

A *job* is the message ``head || body``: ``body`` is device memory (a chunk object, or the
plaintext inside it) and ``head`` an optional short prefix (for the content ID: the HMAC
inner block and the A.2 content prefix; see ``identity.chunk_content_prefix`` and
``identity.hmac_sha256_pads``). The kernel applies the standard SHA-256 padding and writes
the eight state words; :func:`digest_bytes` turns them into the usual 32-byte digest. It is
plain FIPS 180-4 SHA-256: the CUDA tests compare it with hashlib on random messages of
every length class and alignment.

The kernel is compiled at first use with NVRTC through ``torch.cuda._compile_kernel`` (in
PyTorch since 2.8); where that is missing or fails, :func:`available` says why and the
store verifies on the CPU as before.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from .lazy_torch import load_torch as _torch

#: Longest head a job may carry (bytes); longer prefixes are verified on the CPU instead.
HEAD_BYTES = 512

_KERNEL_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

__constant__ u32 K256[64] = {
  0x428a2f98u,0x71374491u,0xb5c0fbcfu,0xe9b5dba5u,0x3956c25bu,0x59f111f1u,0x923f82a4u,0xab1c5ed5u,
  0xd807aa98u,0x12835b01u,0x243185beu,0x550c7dc3u,0x72be5d74u,0x80deb1feu,0x9bdc06a7u,0xc19bf174u,
  0xe49b69c1u,0xefbe4786u,0x0fc19dc6u,0x240ca1ccu,0x2de92c6fu,0x4a7484aau,0x5cb0a9dcu,0x76f988dau,
  0x983e5152u,0xa831c66du,0xb00327c8u,0xbf597fc7u,0xc6e00bf3u,0xd5a79147u,0x06ca6351u,0x14292967u,
  0x27b70a85u,0x2e1b2138u,0x4d2c6dfcu,0x53380d13u,0x650a7354u,0x766a0abbu,0x81c2c92eu,0x92722c85u,
  0xa2bfe8a1u,0xa81a664bu,0xc24b8b70u,0xc76c51a3u,0xd192e819u,0xd6990624u,0xf40e3585u,0x106aa070u,
  0x19a4c116u,0x1e376c08u,0x2748774cu,0x34b0bcb5u,0x391c0cb3u,0x4ed8aa4au,0x5b9cca4fu,0x682e6ff3u,
  0x748f82eeu,0x78a5636fu,0x84c87814u,0x8cc70208u,0x90befffau,0xa4506cebu,0xbef9a3f7u,0xc67178f2u};

__device__ __forceinline__ u32 rotr(u32 x, u32 n) { return __funnelshift_r(x, x, n); }
__device__ __forceinline__ u32 be32(u32 x) { return __byte_perm(x, 0, 0x0123); }
__device__ __forceinline__ void bar_sync(u32 id) { asm volatile("bar.sync %0, 64;" :: "r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(u32 id) { asm volatile("bar.arrive %0, 64;" :: "r"(id) : "memory"); }

#define STAGES 2
#define FULL 1
#define EMPTY (1 + STAGES)

// Two warps per 32 jobs: warp 0 reads each 64-byte block and expands its message schedule
// into shared memory as K[t] + W[t]; warp 1 runs the 64 rounds from there. The rounds are the
// latency of one long message; the schedule is a third of their integer work, now done on
// another scheduler of the multiprocessor.
extern "C" __global__ void __launch_bounds__(64) sha256_jobs(const u64* jobs, u32* out, int njobs) {
  __shared__ u32 kw[STAGES][64][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int j = blockIdx.x * 32 + lane;
  const bool active = j < njobs;
  const u8* body = 0;
  const u8* head = 0;
  u64 blen = 0, hlen = 0;
  if (active) {
    body = (const u8*)jobs[4 * j + 0];
    head = (const u8*)jobs[4 * j + 1];
    blen = jobs[4 * j + 2];
    hlen = jobs[4 * j + 3];
  }
  const u64 total = hlen + blen;
  const u32 nblocks = active ? (u32)((total + 9 + 63) / 64) : 0u;
  const u32 most = __reduce_max_sync(0xffffffffu, nblocks);
  if (warp == 0) {
    const u64 shift_base = (u64)body - hlen;
    const u32 sh = (u32)(shift_base & 3);
    u32 nv[17];
    u32 w[16];
    bool have_next = false;
    for (u32 blk = 0; blk < most; ++blk) {
      const u32 s = blk & (STAGES - 1);
      if (blk >= STAGES) bar_sync(EMPTY + s);
      if (blk < nblocks) {
        const u64 p = (u64)blk * 64;
        const bool fast = p >= hlen && p + 68 <= total;
        if (fast) {
          if (!have_next) {
            const u32* al = (const u32*)((shift_base + p) & ~(u64)3);
#pragma unroll
            for (int i = 0; i < 17; ++i) nv[i] = __ldg(al + i);
          }
          if (sh == 0) {
#pragma unroll
            for (int i = 0; i < 16; ++i) w[i] = be32(nv[i]);
          } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) w[i] = be32(__funnelshift_r(nv[i], nv[i + 1], sh * 8));
          }
          const u64 q = p + 64;
          have_next = q >= hlen && q + 68 <= total;
          if (have_next) {
            const u32* al = (const u32*)((shift_base + q) & ~(u64)3);
#pragma unroll
            for (int i = 0; i < 17; ++i) nv[i] = __ldg(al + i);
            if (q + 640 <= total) asm volatile("prefetch.global.L2 [%0];" :: "l"(shift_base + q + 512));
          }
        } else {
          have_next = false;
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            u32 v = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              const u64 m = p + 4 * i + b;
              u32 byte;
              if (m < hlen) byte = head[m];
              else if (m < total) byte = body[m - hlen];
              else if (m == total) byte = 0x80u;
              else byte = 0;
              v = (v << 8) | byte;
            }
            w[i] = v;
          }
          if (blk == nblocks - 1) {
            const u64 bits = total * 8;
            w[14] = (u32)(bits >> 32);
            w[15] = (u32)bits;
          }
        }
#pragma unroll
        for (int t = 0; t < 64; ++t) {
          u32 wt;
          if (t < 16) {
            wt = w[t];
          } else {
            u32 w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
            u32 s0 = rotr(w15, 7) ^ rotr(w15, 18) ^ (w15 >> 3);
            u32 s1 = rotr(w2, 17) ^ rotr(w2, 19) ^ (w2 >> 10);
            wt = w[t & 15] = w[t & 15] + s0 + w[(t - 7) & 15] + s1;
          }
          kw[s][t][lane] = wt + K256[t];
        }
      }
      __syncwarp();
      bar_arrive(FULL + s);
    }
    for (u32 blk = most > STAGES ? most - STAGES : 0; blk < most; ++blk) bar_sync(EMPTY + (blk & (STAGES - 1)));
  } else {
    u32 st[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au, 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    for (u32 blk = 0; blk < most; ++blk) {
      const u32 s = blk & (STAGES - 1);
      bar_sync(FULL + s);
      if (blk < nblocks) {
        u32 a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
#pragma unroll
        for (int t = 0; t < 64; ++t) {
          const u32 hkw = h + kw[s][t][lane];
          const u32 s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
          const u32 ch = (e & f) ^ (~e & g);
          const u32 t1 = hkw + s1 + ch;
          const u32 s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
          const u32 mj = (a & b) ^ (a & c) ^ (b & c);
          h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + s0 + mj;
        }
        st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
      }
      __syncwarp();
      bar_arrive(EMPTY + s);
    }
    if (active) {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[8 * j + i] = st[i];
    }
  }
}
"""

_lock = threading.Lock()
_kernels: dict[int, Any] = {}
_failure: dict[int, str] = {}

#: Jobs per CUDA block: one warp reads and expands the message schedules of 32 jobs, a second
#: warp runs their rounds. Messages are few (thousands) and long: small blocks spread them over
#: every multiprocessor instead of packing them onto a few.
JOBS_PER_BLOCK = 32
THREADS_PER_BLOCK = 2 * JOBS_PER_BLOCK


def _index(device: Any) -> int:
    torch = _torch()
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _kernel(device: Any):
    torch = _torch()
    index = _index(device)
    with _lock:
        if index in _kernels:
            return _kernels[index]
        if index in _failure:
            raise RuntimeError(_failure[index])
        try:
            compile_kernel = torch.cuda._compile_kernel
            with torch.cuda.device(index):
                kernel = compile_kernel(_KERNEL_SOURCE, "sha256_jobs")
        except Exception as exc:  # no NVRTC, old torch, unsupported device
            _failure[index] = f"GPU SHA-256 kernel unavailable: {type(exc).__name__}: {exc}"
            raise RuntimeError(_failure[index]) from None
        _kernels[index] = kernel
        return kernel


def available(device: Any) -> str | None:
    """``None`` if the kernel runs on ``device``, else the reason it does not."""
    torch = _torch()
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    try:
        _kernel(device)
    except RuntimeError as exc:
        return str(exc)
    return None


def launch(jobs, out, count: int, stream=None) -> None:
    """Hash ``count`` jobs: ``jobs`` is an int64 CUDA tensor of shape (>=count, 4) (body
    address, head address, body bytes, head bytes); ``out`` a uint32/int32 tensor of shape
    (>=count, 8), on the device or in pinned host memory (mapped into the device's address
    space under unified addressing: the kernel writes it over the bus). Runs on ``stream`` (default: the current stream) asynchronously.
    Every address must stay valid until the kernel has run."""
    if count <= 0:
        return
    kernel = _kernel(jobs.device)
    blocks = -(-count // JOBS_PER_BLOCK)
    driver = _launcher()
    if driver is None:
        kernel(grid=(blocks, 1, 1), block=(THREADS_PER_BLOCK, 1, 1), args=[jobs, out, int(count)], stream=stream)
        return
    # The same cuLaunchKernel call torch's kernel wrapper makes, without its per-call driver
    # library load (a fresh ctypes.CDLL and function lookup each launch: ~4 % of a 131k
    # restore's installing thread on the H200, docs/benchmarks.md).
    if not jobs.is_cuda or not (out.is_cuda or out.is_pinned()):
        raise ValueError("the job table must be on the device and the digests on the device or pinned")
    if stream is None:
        stream = _torch().cuda.current_stream(jobs.device)
    table, digests, n = ctypes.c_void_p(jobs.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(int(count))
    params = (ctypes.c_void_p * 3)(ctypes.addressof(table), ctypes.addressof(digests), ctypes.addressof(n))
    rc = driver(kernel.func, blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, stream._as_parameter_, params, None)
    if rc != 0:
        raise RuntimeError(f"GPU SHA-256 launch failed: CUDA driver error {rc}")


_driver: list[Any] = []


def _launcher() -> Any:
    """``cuLaunchKernel`` from the CUDA driver, loaded once; ``None`` where torch's own
    wrapper must launch (ROCm, Windows)."""
    if not _driver:
        torch = _torch()
        fn = None
        if not torch.version.hip and sys.platform != "win32":
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
            fn.restype = ctypes.c_int
        _driver.append(fn)
    return _driver[0]


_latency: dict[tuple[int, int], float] = {}


def message_latency(device: Any, nbytes: int) -> float:
    """Seconds one launch takes to hash one ``nbytes`` message on ``device`` (measured once
    per device and size, then cached). A launch of many messages takes about as long as its
    longest one, so this is what a wave of chunk objects costs after its last upload."""
    torch = _torch()
    index = _index(device)
    key = (index, nbytes)
    if key not in _latency:
        with torch.cuda.device(index):
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
            table, _heads = job_table([(buf, b"")], buf.device)
            out = torch.empty((1, 8), dtype=torch.int32, device=buf.device)
            launch(table, out, 1)  # compile and load
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(table, out, 1)
            end.record()
            end.synchronize()
            _latency[key] = start.elapsed_time(end) / 1e3
    return _latency[key]


def digest_bytes(words) -> bytes:
    """The 32-byte digest from the 8 state words the kernel wrote (a numpy row of uint32)."""
    import numpy as np

    return np.asarray(words, dtype=np.uint32).astype(">u4").tobytes()


def job_table(messages: list[tuple[Any, bytes]], device: Any):
    """The device job table (and the heads it points into; keep both alive until the launch
    has run) for ``(body, head)`` messages, ``body`` a flat uint8 tensor on ``device``."""
    torch = _torch()
    n = len(messages)
    heads = torch.zeros((max(n, 1), HEAD_BYTES), dtype=torch.uint8)
    table = torch.zeros((max(n, 1), 4), dtype=torch.int64)
    for i, (body, head) in enumerate(messages):
        if len(head) > HEAD_BYTES:
            raise ValueError(f"head of {len(head)} bytes; at most {HEAD_BYTES}")
        if head:
            heads[i, : len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        table[i, 2] = body.numel()
        table[i, 3] = len(head)
    dev_heads = heads.to(device)
    for i, (body, _head) in enumerate(messages):
        table[i, 0] = body.data_ptr()
        table[i, 1] = dev_heads[i].data_ptr()
    return table.to(device), dev_heads


def sha256_many(messages: list[tuple[Any, bytes]], device: Any) -> list[bytes]:
    """Digests of ``head || body`` for each ``(body, head)``, ``body`` a flat uint8 CUDA
    tensor (any offset into a larger buffer). Synchronous; for tests and the benchmark."""
    torch = _torch()
    n = len(messages)
    table, _heads = job_table(messages, device)
    out = torch.empty((max(n, 1), 8), dtype=torch.int32, device=device)
    launch(table, out, n)
    words = out.cpu().numpy().view("uint32")
    return [digest_bytes(words[i]) for i in range(n)]


__all__ = ["HEAD_BYTES", "JOBS_PER_BLOCK", "THREADS_PER_BLOCK", "available", "digest_bytes", "job_table", "launch", "message_latency", "sha256_many"]
