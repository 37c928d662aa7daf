#!/usr/bin/env python3
"""A CUDA client of an MPS server, through the driver's libcuda alone (no toolkit): creates a
context on device 0 and allocates two buffers, one within CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and
one beyond it. Prints one line per step: `name result` (0 = CUDA_SUCCESS, 2 = out of memory)."""

import ctypes
import sys

cuda = ctypes.CDLL("libcuda.so.1")


def call(name, *args):
    result = getattr(cuda, name)(*args)
    return int(result)


def main():
    small, large = int(sys.argv[1]), int(sys.argv[2])
    print("cuInit", call("cuInit", 0), flush=True)
    device = ctypes.c_int()
    print("cuDeviceGet", call("cuDeviceGet", ctypes.byref(device), 0), flush=True)
    context = ctypes.c_void_p()
    print("cuCtxCreate", call("cuCtxCreate_v2", ctypes.byref(context), 0, device), flush=True)
    for label, size in (("small", small), ("large", large)):
        pointer = ctypes.c_uint64()
        print(f"cuMemAlloc_{label}", call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
