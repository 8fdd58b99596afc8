// Every stepgraph kernel opens with await_previous_kernel(). Inside a captured step its
// launches allow programmatic dependent launch (runtime/dependent_launch.py): the GPU may
// start a kernel's blocks while the kernel before it in the stream is finishing, which hides
// part of the gap between the two (0.4-0.6 µs a launch in chains of kernels on an H200). The wait
// holds every thread until the kernels before it have completed and their writes are
// visible, so nothing may read or write global memory before it. A block that returned
// before it would let the kernels after it start early; tests/unit/test_launch_order.py
// checks that it is every kernel's first statement. Launched without that attribute (eager
// calls, GPUs before sm_90) it returns at once.
#pragma once

__device__ __forceinline__ void await_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
