// A stand-in for the NVIDIA driver library (libcuda.so.1) that runs gatestream's kernels on the
// CPU: the subset of the driver API that cudarc and src/backend/cuda call, over host memory,
// with kernels/*.cu compiled for the host (emu.h) and run block by block in a scrambled order,
// each GPU thread a fiber. Work queued on a stream runs in order but as late as the program allows — when
// something waits for it (a synchronize, an event, a copy to pageable memory) — so a missing
// wait shows as wrong values rather than passing by luck (see "Queued work"); an event's time is
// the host clock when its point in the stream was reached. Stream capture records a stream's
// kernel launches and memsets into a graph, which a graph launch queues again in order. It
// exists so that the CUDA device's host code and kernels run in CI on a machine without a GPU:
// what it shows is that they compute the right values, never how a GPU performs. Its device
// calls itself a host emulation.
//
// Checks the real driver makes and this one makes too (errors, not crashes): copies and frees
// must stay inside an allocation, a host range is registered once and unregistered once, an
// event made without timing cannot be timed, a launch needs 1..1024 threads per block. While a
// thread captures a stream (thread-local mode), any other call from it but a launch or memset
// on that stream is refused and spoils the capture, as is work another thread puts on the
// capturing stream — stricter than the driver, which also captures copies and event records.
// Kernel memory accesses are not bounds-checked (build with --asan for that, which checks their
// alignment too). A deadlock (a barrier or shuffle some live thread never reaches) fails the
// launch, and so do a block's threads meeting at different barriers (a divergent
// `__syncthreads`); a failure of queued work is returned by the next wait, and every one after
// (sticky, as on a GPU).
//
// Build: tests/cuda_emu/build.sh DIR (gives DIR/libcuda.so.1; point GATESTREAM_LIBCUDA at it).
//
// GSEMU_TRACE=1 prints each kernel as it runs (name, grid, block) to stderr: a step's launches.
//
// GSEMU_SKIP_KERNELS=1 skips every kernel (launches, captured or not, do nothing; copies and
// memsets still run): what is left of a run's time is the host's own work — gatestream's and
// this library's — for timing that alone. Every value a kernel would write is then garbage,
// except argmax_rows's greedy tokens (0 for every row) and top_k_rows's candidates (ids 0 to k - 1,
// each with value 0, and a log-sum-exp of 0 when asked), so a greedy or sampled run can go on.

#include "emu.h"

// The kernels, in the order the CUDA device's module has them (one translation unit).
#include "../../kernels/quant.cu"
#include "../../kernels/mma.cu"
#include "../../kernels/ops.cu"
#include "../../kernels/attention.cu"

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUgraph;
typedef void* CUgraphExec;

static const unsigned CU_MEMHOSTREGISTER_DEVICEMAP = 0x02;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_UNKNOWN = 999,
};

// ---------------------------------------------------------------------------------------------
// Fibers: one per GPU thread of the block being run.

namespace gsemu {

Fiber* current = nullptr;
MmaSlot mma_slots[32];
dim3 grid_dim, block_dim, block_idx;

static const size_t STACK_BYTES = 256 << 10;
static const size_t PAGE = 4096;
static std::vector<Fiber> fibers;  // the block's threads, by linear id
static int block_threads = 0;
static int thread_dir = 1;                 // the order a block's threads take turns in: 1 or -1
static unsigned long long grids_run = 0;   // launches run so far
static int live_block = 0;                 // threads of the block that have not exited
static int live_warp[32];                  // the same per warp
// Arrivals at a barrier or exchange of generation `gen` (threads are at most one apart, so two
// counters, by parity, suffice: the first to arrive at gen + 2 finds everyone past gen).
struct Arrivals {
    unsigned gen;
    int count;
    void arrive(unsigned g) {
        if (gen != g) {
            gen = g;
            count = 0;
        }
        count++;
    }
    bool all(unsigned g, int live) const { return gen == g && count >= live; }
};
static Arrivals bar_arrivals[2];
static Arrivals shfl_arrivals[32][2];
// The source line of the first thread's arrival at each barrier of a generation: every other
// thread must arrive at the same one (a `__syncthreads` in code the block's threads do not all
// run alike may hang a GPU, CUDA's guide says; here it would pair up with another). Warp
// exchanges are not held to one line: from sm_70 on, lanes pair up by arrival, as `shfl_xor` does.
static int bar_site[2];
static unsigned warp_slot[32][2][32];    // exchanged values: [warp][generation parity][lane]
static std::string launch_error;
static void* sched_sp = nullptr;
static void (*kernel_invoke)(void* fn, void** params) = nullptr;
static void* kernel_fn = nullptr;
static void** kernel_params = nullptr;

}  // namespace gsemu

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack and its pointer in *from, then resumes
// the stack `to` (System V x86-64).
extern "C" void gsemu_switch(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .globl gsemu_switch
    .hidden gsemu_switch
    .type gsemu_switch,@function
gsemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size gsemu_switch, .-gsemu_switch
)");

// A fresh stack whose first switch "returns" into `entry` as if it had been called.
static void* fresh_stack(void* top, void (*entry)()) {
    uintptr_t t = (uintptr_t)top & ~(uintptr_t)15;
    void** sp = (void**)t;
    *--sp = nullptr;  // entry's return address (entry never returns)
    *--sp = (void*)entry;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    return sp;
}
#else
#error "tests/cuda_emu: the fiber switch is written for x86-64 only"
#endif

namespace gsemu {

static void fail(const std::string& msg) {
    if (launch_error.empty()) launch_error = msg;
}

// Whether a waiting thread may go on: everyone live has arrived where it waits.
static bool may_go(const Fiber& f) {
    if (f.wait == 1) return bar_arrivals[(f.bar - 1) & 1].all(f.bar - 1, live_block);
    if (f.wait == 2) return shfl_arrivals[f.warp][(f.shfl - 1) & 1].all(f.shfl - 1, live_warp[f.warp]);
    return true;
}

// The current thread stops (it waits, or it is done): the next thread after it in `thread_dir`'s
// order that may go is resumed directly (one switch, not two through the scheduler); when none
// may, the scheduler is (the block is done, or deadlocked). Any order of running threads between
// barriers and exchanges is one a GPU may take.
static void switch_on() {
    Fiber* f = current;
    int n = block_threads;
    for (int k = 1, i = f->linear + thread_dir; k < n; k++, i += thread_dir) {
        if (i >= n) i = 0;
        if (i < 0) i = n - 1;
        Fiber& g = fibers[i];
        if (g.done || !may_go(g)) continue;
        current = &g;
        gsemu_switch(&f->sp, g.sp);
        return;  // resumed by another thread, which set `current`
    }
    gsemu_switch(&f->sp, sched_sp);
}

static void yield() { switch_on(); }

static void fiber_entry() {
    kernel_invoke(kernel_fn, kernel_params);
    current->done = true;
    live_block--;
    live_warp[current->warp]--;
    switch_on();
    __builtin_trap();  // never resumed
}

static std::string where_block() {
    return "block (" + std::to_string(block_idx.x) + ", " + std::to_string(block_idx.y) + ", " +
           std::to_string(block_idx.z) + ")";
}

void sync_threads(int line) {
    Fiber* f = current;
    unsigned g = f->bar++;
    if (bar_arrivals[g & 1].gen != g) bar_site[g & 1] = line;
    else if (bar_site[g & 1] != line)
        fail("threads of " + where_block() + " met at different __syncthreads (lines " + std::to_string(bar_site[g & 1]) +
             " and " + std::to_string(line) + ", thread " + std::to_string(f->linear) + "): a barrier in divergent code");
    bar_arrivals[g & 1].arrive(g);
    f->wait = 1;
    if (!may_go(*f)) yield();  // resumed once everyone has arrived
    f->wait = 0;
}

unsigned shfl_xor(unsigned bits, int lane_mask) {
    Fiber* f = current;
    unsigned g = f->shfl++;
    warp_slot[f->warp][g & 1][f->lane] = bits;
    shfl_arrivals[f->warp][g & 1].arrive(g);
    f->wait = 2;
    if (!may_go(*f)) yield();
    f->wait = 0;
    int first = f->warp * 32, end = std::min(first + 32, block_threads);
    int src = f->lane ^ lane_mask;
    if (first + src >= end || src >= 32) return bits;  // outside the warp: the lane's own value
    const Fiber& p = fibers[first + src];
    if (p.done && p.shfl <= g) {
        fail("a shuffle read a lane that had exited (thread " + std::to_string(f->linear) + ")");
        return bits;
    }
    return warp_slot[f->warp][g & 1][src];
}

// Runs the kernel over the grid; false with launch_error set when a block could not finish.
static bool run_grid() {
    int n = block_threads;
    if ((int)fibers.size() < n) fibers.resize(n, Fiber{});
    for (int i = 0; i < n; i++) {
        if (!fibers[i].stack) {
            void* m = mmap(nullptr, STACK_BYTES + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) {
                fail("no memory for a thread's stack");
                return false;
            }
            mprotect(m, PAGE, PROT_NONE);  // overflow faults instead of corrupting a neighbour
            fibers[i].stack = m;
        }
    }
    // Blocks run one after another in a scrambled order (block i of the grid's linear order
    // runs (i * stride + start) mod blocks-th, stride prime to the count), as a GPU gives no
    // order: a kernel whose result depends on which block runs first or last shows it.
    unsigned long long blocks = (unsigned long long)grid_dim.x * grid_dim.y * grid_dim.z;
    unsigned long long stride = 1;
    for (unsigned long long c : {7919ull, 104729ull, 1299709ull})
        if (blocks % c != 0) {  // (c prime)
            stride = c;
            break;
        }
    unsigned long long start = blocks * 5 / 7;
    for (unsigned long long step = 0; step < blocks; step++) {
        unsigned long long b = (step * stride + start) % blocks;
        unsigned bx = (unsigned)(b % grid_dim.x), by = (unsigned)(b / grid_dim.x % grid_dim.y),
                 bz = (unsigned)(b / grid_dim.x / grid_dim.y);
        block_idx = dim3{bx, by, bz};
        live_block = n;
        for (int w = 0; w < 32; w++) live_warp[w] = std::max(0, std::min(32, n - 32 * w));
        for (int k = 0; k < 2; k++) {
            bar_arrivals[k] = Arrivals{~0u, 0};
            for (int w = 0; w < 32; w++) shfl_arrivals[w][k] = Arrivals{~0u, 0};
        }
        for (int i = 0; i < n; i++) {
            Fiber& f = fibers[i];
            f.tid = dim3{(unsigned)i % block_dim.x, ((unsigned)i / block_dim.x) % block_dim.y,
                         (unsigned)i / (block_dim.x * block_dim.y)};
            f.linear = i;
            f.lane = i & 31;
            f.warp = i >> 5;
            f.done = false;
            f.bar = 0;
            f.shfl = 0;
            f.wait = 0;
            // Tops staggered so that the threads' frames do not all fall in the same cache sets.
            f.sp = fresh_stack((char*)f.stack + STACK_BYTES + PAGE - (size_t)(i % 61) * 208, fiber_entry);
        }
        // Between barriers and exchanges a block's threads run in turn, by linear index up in
        // one block and down in the next (and a one-block grid's, launch by launch): a thread
        // reading what another writes without a barrier between (a race on a GPU) reads it
        // unwritten in one of the two orders.
        thread_dir = (step + grids_run) % 2 == 0 ? 1 : -1;
        while (live_block > 0) {
            bool resumed = false;
            for (int j = 0; j < n; j++) {
                int i = thread_dir > 0 ? j : n - 1 - j;
                if (fibers[i].done || !may_go(fibers[i])) continue;
                resumed = true;
                current = &fibers[i];
                gsemu_switch(&sched_sp, fibers[i].sp);
            }
            if (!resumed) {
                fail("deadlock in " + where_block() + ": " + std::to_string(live_block) +
                     " threads wait at a barrier or shuffle the others never reach");
                current = nullptr;
                return false;
            }
        }
        current = nullptr;
    }
    grids_run++;
    return launch_error.empty();
}

}  // namespace gsemu

// ---------------------------------------------------------------------------------------------
// The kernels by name, each with a trampoline from the driver's parameter array.

// Parameter values copied at capture (the caller's array is gone by the time a graph runs),
// with the array of pointers to them a launch takes.
struct SavedParams {
    std::shared_ptr<void> values;
    std::vector<void*> ptrs;
};

struct Kernel {
    const char* name;
    void (*invoke)(void* fn, void** params);
    void* fn;
    SavedParams (*save)(void** params);
};

template <typename... A, size_t... I>
static void invoke_with(void (*fn)(A...), void** p, std::index_sequence<I...>) {
    fn(*static_cast<A*>(p[I])...);
}

template <typename... A, size_t... I>
static SavedParams save_with(void** p, std::index_sequence<I...>) {
    auto values = std::make_shared<std::tuple<A...>>(*static_cast<A*>(p[I])...);
    return SavedParams{values, {static_cast<void*>(&std::get<I>(*values))...}};
}

template <typename... A>
static Kernel kernel(const char* name, void (*fn)(A...)) {
    return Kernel{name,
                  [](void* f, void** p) {
                      invoke_with(reinterpret_cast<void (*)(A...)>(f), p, std::index_sequence_for<A...>{});
                  },
                  reinterpret_cast<void*>(fn),
                  [](void** p) { return save_with<A...>(p, std::index_sequence_for<A...>{}); }};
}

#define K(n) kernel(#n, n),
#define TYPED(t) K(matmul_##t) K(matvec_##t) K(matvec2_##t) K(matvec4_##t) K(embed_##t) K(accumulate_##t) K(mma_##t)
static const Kernel KERNELS[] = {
    TYPED(f32) TYPED(f16) TYPED(bf16) TYPED(q4_0) TYPED(q4_1) TYPED(q5_0) TYPED(q8_0) TYPED(q4_k) TYPED(q5_k)
        TYPED(q6_k) TYPED(iq4_nl) TYPED(mxfp4) TYPED(q2_k) TYPED(q3_k) TYPED(iq4_xs) TYPED(q5_1) K(accumulate_reduce) K(argmax_rows) K(top_k_rows) K(activate_mul) K(activate_mul_q8_k) K(add_rms_norm) K(act_q8_32) K(act_q8_k) K(rms_norm) K(add) K(mul) K(add_bias)
            K(activate) K(softcap) K(select_rows) K(scatter_cols) K(gather_cols) K(rope_norm) K(rope_norm_kv) K(kv_write)
                K(attention) K(attention_split) K(attention_merge) K(attention_tiles) K(act_q8_k_blocks) K(matvec_i8_q4_k) K(matvec_i8_q6_k)
                    K(matvec_i8x3_q4_k) K(matvec_i8x3_q6_k) K(matvec_i8f_q4_k) K(matvec_i8f_q6_k) K(matvec_i8n_q4_k)
                    K(matvec_i8n_q6_k) K(mmq_q4_k) K(mmq_q6_k) K(mmq_plain_q4_k) K(mmq_plain_q6_k) K(matvec_i8n_norm_q4_k) K(matvec_i8n_norm_q6_k) K(matvec_i8nx3_act) K(matvec_i8nx3_rope_kv) K(act_f16_rows) K(matvec_i8_norm_q4_k)
                        K(matvec_i8_norm_q6_k) K(matvec_i8f_norm_q4_k) K(matvec_i8f_norm_q6_k) K(matvec_i8x3_act_q4_k)
                            K(matvec_i8x3_act_q6_k) K(matvec_i8x3_mixed) K(matvec_i8x3_rope_kv) K(matvec_i8nx3)};
#undef K
#undef TYPED

// ---------------------------------------------------------------------------------------------
// Driver state.

static std::mutex lock;
static bool initialized = false;
static int primary_refs = 0;
static char primary_ctx_tag;  // its address is the one context
static thread_local CUcontext bound = nullptr;
static std::map<CUdeviceptr, size_t> allocations;  // device memory: start -> bytes
static size_t allocated = 0;
static std::map<uintptr_t, size_t> registered;  // page-locked host ranges (registered)
static std::map<uintptr_t, size_t> mapped;      // of those, mapped for kernels (DEVICEMAP)
static std::map<void*, size_t> host_allocs;     // page-locked host memory (allocated)
// The emulated device's memory: 16 GiB, or GATESTREAM_EMU_MEMORY bytes (tests of what a run does
// on a device too small for its model).
static size_t total_mem() {
    static const size_t total = [] {
        const char* v = std::getenv("GATESTREAM_EMU_MEMORY");
        return v ? (size_t)std::strtoull(v, nullptr, 10) : (16ull << 30);
    }();
    return total;
}
#define TOTAL_MEM total_mem()

struct Module {
    std::vector<char> image;
};
// A recorded operation: a launch with its parameters copied, or a memset.
struct Node {
    const Kernel* kernel;  // null: memset
    dim3 grid, block;
    SavedParams params;
    CUdeviceptr dst;
    unsigned char value;
    size_t bytes;
};
struct Graph {
    std::vector<Node> nodes;
};
struct Event;
// Work queued on a stream; it runs when something waits for it (see `run_one`).
enum TaskKind { T_KERNEL, T_MEMSET, T_HTOD, T_DTOH, T_DTOD, T_FREE, T_RECORD, T_WAIT };
struct Task {
    TaskKind kind;
    const Kernel* kernel;
    dim3 grid, block;
    SavedParams params;
    CUdeviceptr dst, src;  // device addresses
    void* host_dst;        // a device-to-host copy's destination (page-locked)
    const void* host_src;  // a host-to-device copy's source: page-locked memory, read when it runs,
    std::shared_ptr<std::vector<char>> snapshot;  // or pageable memory, copied when queued
    unsigned char value;
    size_t bytes;
    Event* event;
    unsigned long long gen;  // T_RECORD: the recording; T_WAIT: the recording waited for
};
struct Stream {
    unsigned flags;
    Graph* capture;  // being captured into (owned until cuStreamEndCapture)
    bool invalid;    // the capture was spoiled by a call it refused
    std::deque<Task> queue;
};
// The legacy default stream (handles 0, 1, 2), and the streams made by cuStreamCreate.
static Stream legacy{0, nullptr, false, {}};
static std::set<Stream*> streams{&legacy};
// The stream this thread captures, if any.
static thread_local Stream* capturing_here = nullptr;

static CUresult capture_violation(Stream* s) {
    if (s) s->invalid = true;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

static bool real_stream(CUstream s) { return s != nullptr && s != (CUstream)0x1 && s != (CUstream)0x2; }
static Stream* stream_of(CUstream s) { return real_stream(s) ? (Stream*)s : &legacy; }

// Work for stream `s` other than a launch or memset: refused while it, or this thread, captures.
static CUresult not_capturing(CUstream s) {
    if (capturing_here) return capture_violation(capturing_here);
    if (real_stream(s) && ((Stream*)s)->capture) return capture_violation((Stream*)s);
    return CUDA_SUCCESS;
}
// An event: `gen` counts its recordings, `done` is the last one whose point in its stream has
// been reached (with the host clock then).
struct Event {
    unsigned flags;
    bool recorded;
    double ms;
    Stream* stream;
    unsigned long long gen, done;
};
// The first failure of queued work; returned by every wait from then on (sticky, as on a GPU).
static CUresult async_error = CUDA_SUCCESS;

static double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// [p, p + n) inside one allocation.
static bool device_range(CUdeviceptr p, size_t n) {
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p >= it->first && p - it->first + n <= it->second;
}

static bool ready() { return initialized; }

#define API extern "C" __attribute__((visibility("default")))
// Every call takes the lock; all but a few are refused while this thread captures a stream.
#define GUARD_IN_CAPTURE                     \
    std::lock_guard<std::mutex> guard(lock); \
    if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
#define GUARD        \
    GUARD_IN_CAPTURE \
    if (capturing_here) return capture_violation(capturing_here);

API CUresult cuInit(unsigned flags) {
    std::lock_guard<std::mutex> guard(lock);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    initialized = true;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int* n) {
    GUARD
    *n = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    GUARD
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetAttribute(int* v, int attrib, CUdevice d) {
    GUARD
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
        case 1: *v = 1024; break;   // max threads per block
        case 10: *v = 32; break;    // warp size
        case 16: *v = 1; break;     // multiprocessors
        case 75: *v = 9; break;     // compute capability 9.0: NVRTC builds for sm_90
        case 76: *v = 0; break;
        case 115: *v = 1; break;    // memory pools (cuMemAllocAsync), as on an H100
        default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    GUARD
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    std::snprintf(name, (size_t)len, "host emulation of the CUDA driver (tests/cuda_emu; not a GPU)");
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    GUARD
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = TOTAL_MEM;
    return CUDA_SUCCESS;
}

API CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
    GUARD
    *free = TOTAL_MEM - allocated;
    *total = TOTAL_MEM;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    GUARD
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    primary_refs++;
    *ctx = &primary_ctx_tag;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    GUARD
    if (d != 0 || primary_refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
    primary_refs--;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    GUARD_IN_CAPTURE
    if (ctx && ctx != &primary_ctx_tag) return CUDA_ERROR_INVALID_CONTEXT;
    bound = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext* ctx) {
    GUARD_IN_CAPTURE
    *ctx = bound;
    return CUDA_SUCCESS;
}

#define NEED_CTX \
    if (!bound) return CUDA_ERROR_INVALID_CONTEXT;

static void flush_all();

API CUresult cuCtxSynchronize() {
    GUARD
    NEED_CTX
    flush_all();
    return async_error;
}

// The errors this driver returns: code, name, description.
static const struct {
    CUresult code;
    const char *name, *text;
} ERRORS[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the host range is already registered"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "host range not registered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure (see stderr: cuda_emu)"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

// Name and text of error `e`; an unknown code gets the last entry.
static const auto& error_of(CUresult e) {
    for (const auto& x : ERRORS)
        if (x.code == e) return x;
    return ERRORS[sizeof(ERRORS) / sizeof(ERRORS[0]) - 1];
}

API CUresult cuGetErrorString(CUresult e, const char** s) {
    *s = error_of(e).text;
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult e, const char** s) {
    *s = error_of(e).name;
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// Modules: the image NVRTC made is kept (a function must be named in it), the code run is the
// host build of the same source.

API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    GUARD
    NEED_CTX
    const unsigned char* p = (const unsigned char*)image;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    size_t len;
    if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F' && p[4] == 2) {
        // ELF64 (a cubin): the section headers end the file.
        unsigned long long shoff;
        unsigned short shentsize, shnum;
        std::memcpy(&shoff, p + 0x28, 8);
        std::memcpy(&shentsize, p + 0x3a, 2);
        std::memcpy(&shnum, p + 0x3c, 2);
        len = shoff + (size_t)shentsize * shnum;
    } else {
        len = std::strlen((const char*)p);  // PTX text
        if (len == 0) return CUDA_ERROR_INVALID_IMAGE;
    }
    *m = new Module{std::vector<char>((const char*)p, (const char*)p + len)};
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule m) {
    GUARD
    flush_all();
    delete (Module*)m;
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    GUARD
    const Module* mod = (const Module*)m;
    if (!mod) return CUDA_ERROR_INVALID_HANDLE;
    size_t n = std::strlen(name);
    bool in_image = false;
    for (size_t i = 0; i + n <= mod->image.size() && !in_image; i++)
        in_image = std::memcmp(&mod->image[i], name, n) == 0 && (i + n == mod->image.size() || mod->image[i + n] == 0);
    if (!in_image) return CUDA_ERROR_NOT_FOUND;
    for (const Kernel& k : KERNELS) {
        if (std::strcmp(k.name, name) == 0) {
            *f = (CUfunction)&k;
            return CUDA_SUCCESS;
        }
    }
    std::fprintf(stderr, "cuda_emu: kernel %s is in the module but not in tests/cuda_emu/driver.cpp's list\n", name);
    return CUDA_ERROR_NOT_FOUND;
}

// Runs kernel k now (the lock held).
static CUresult run_kernel(const Kernel* k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, void** params) {
    static const bool skip = [] {
        const char* v = std::getenv("GSEMU_SKIP_KERNELS");
        return v && std::strcmp(v, "1") == 0;
    }();
    static const bool trace = [] {
        const char* v = std::getenv("GSEMU_TRACE");
        return v && std::strcmp(v, "1") == 0;
    }();
    if (trace)
        std::fprintf(stderr, "cuda_emu: launch %s grid %u,%u,%u block %u,%u,%u\n", k->name, gx, gy, gz, bx, by, bz);
    if (skip) {
        // Greedy tokens and candidates still come back (token 0 for every row; ids 0 to k - 1,
        // values 0), so a greedy or sampled run goes on.
        if (std::strcmp(k->name, "argmax_rows") == 0) {
            unsigned* out = *static_cast<unsigned**>(params[4]);
            for (unsigned r = 0; r < gx; r++) out[r] = 0;
        }
        if (std::strcmp(k->name, "top_k_rows") == 0) {
            int n = *static_cast<int*>(params[4]);
            int lse = *static_cast<int*>(params[5]);
            unsigned* out = *static_cast<unsigned**>(params[6]);
            unsigned stride = 2 * n + (lse ? 2 : 0);
            for (unsigned r = 0; r < gx; r++) {
                for (int j = 0; j < n; j++) {
                    out[r * stride + 2 * j] = (unsigned)j;
                    out[r * stride + 2 * j + 1] = 0;
                }
                if (lse) {
                    out[r * stride + 2 * n] = 0;
                    out[r * stride + 2 * n + 1] = 0;
                }
            }
        }
        return CUDA_SUCCESS;
    }
    unsigned long long threads = (unsigned long long)bx * by * bz;
    gsemu::grid_dim = dim3{gx, gy, gz};
    gsemu::block_dim = dim3{bx, by, bz};
    gsemu::block_threads = (int)threads;
    gsemu::kernel_invoke = k->invoke;
    gsemu::kernel_fn = k->fn;
    gsemu::kernel_params = params;
    gsemu::launch_error.clear();
    if (!gsemu::run_grid()) {
        std::fprintf(stderr, "cuda_emu: kernel %s (grid %u,%u,%u block %u,%u,%u): %s\n", k->name, gx, gy, gz, bx, by,
                     bz, gsemu::launch_error.c_str());
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// Memory.

static CUresult alloc(CUdeviceptr* p, size_t n) {
    if (n == 0) return CUDA_ERROR_INVALID_VALUE;
    if (allocated + n > TOTAL_MEM) return CUDA_ERROR_OUT_OF_MEMORY;
    // Exactly n bytes (a build with AddressSanitizer then catches a kernel reading past them).
    void* m = nullptr;
    if (posix_memalign(&m, 256, n) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (CUdeviceptr)m;
    allocations[*p] = n;
    allocated += n;
    return CUDA_SUCCESS;
}

static CUresult release(CUdeviceptr p) {
    auto it = allocations.find(p);
    if (it == allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    allocated -= it->second;
    allocations.erase(it);
    std::free((void*)p);
    return CUDA_SUCCESS;
}

// [p, p + n) inside page-locked host memory (registered or allocated): a copy reads or writes
// it when the copy runs, as the GPU's copy engine does.
static bool page_locked(const void* p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    auto r = registered.upper_bound(a);
    if (r != registered.begin() && a + n <= std::prev(r)->first + std::prev(r)->second) return true;
    auto h = host_allocs.upper_bound((void*)p);
    if (h != host_allocs.begin()) {
        --h;
        if (a >= (uintptr_t)h->first && a + n <= (uintptr_t)h->first + h->second) return true;
    }
    return false;
}

// ---------------------------------------------------------------------------------------------
// Queued work. A stream's work runs in order, and only when something waits for it: a stream or
// context synchronize, an event synchronize or query, a copy to pageable host memory, a
// stream that waits on an event (its producer's work up to the event runs first), freeing or
// destroying what work may use. So work runs as late as the program allows, and a missing wait
// shows: a kernel reading a copy nobody waited for sees the memory from before it, and host
// memory rewritten before its copy ran is copied as rewritten.

static bool run_one(Stream* s);

static void fail_async(CUresult r) {
    if (r && !async_error) async_error = r;
}

static void run_task(Task& t) {
    switch (t.kind) {
        case T_KERNEL:
            fail_async(run_kernel(t.kernel, t.grid.x, t.grid.y, t.grid.z, t.block.x, t.block.y, t.block.z,
                                  t.params.ptrs.data()));
            break;
        case T_MEMSET:
            if (!device_range(t.dst, t.bytes)) return fail_async(CUDA_ERROR_LAUNCH_FAILED);  // freed since
            std::memset((void*)t.dst, t.value, t.bytes);
            break;
        case T_HTOD:
            if (!device_range(t.dst, t.bytes)) return fail_async(CUDA_ERROR_LAUNCH_FAILED);
            std::memcpy((void*)t.dst, t.snapshot ? t.snapshot->data() : t.host_src, t.bytes);
            break;
        case T_DTOH:
            if (!device_range(t.src, t.bytes)) return fail_async(CUDA_ERROR_LAUNCH_FAILED);
            std::memcpy(t.host_dst, (const void*)t.src, t.bytes);
            break;
        case T_DTOD:
            if (!device_range(t.dst, t.bytes) || !device_range(t.src, t.bytes))
                return fail_async(CUDA_ERROR_LAUNCH_FAILED);
            std::memmove((void*)t.dst, (const void*)t.src, t.bytes);
            break;
        case T_FREE:
            fail_async(release(t.dst));
            break;
        case T_RECORD:
            if (t.gen > t.event->done) {
                t.event->done = t.gen;
                t.event->recorded = true;
                t.event->ms = now_ms();
            }
            break;
        case T_WAIT:
            // The producer's work up to the recording waited for (it is in its queue: recorded
            // before this wait was queued).
            while (t.event->done < t.gen && run_one(t.event->stream)) {
            }
            break;
    }
}

static bool run_one(Stream* s) {
    if (s->queue.empty()) return false;
    Task t = std::move(s->queue.front());
    s->queue.pop_front();
    run_task(t);
    return true;
}

static void flush(Stream* s) {
    while (run_one(s)) {
    }
}

// Every stream's work (running one stream's work only ever runs other streams' older work, so
// one pass empties them all).
static void flush_all() {
    for (Stream* s : streams) flush(s);
}

// What a call on the legacy stream waits for first: its own work and that of blocking streams
// (flags 0; cudarc's streams are non-blocking, so their work is not waited for).
static void flush_legacy() {
    for (Stream* s : streams)
        if (s->flags == 0) flush(s);
}

static Task task(TaskKind kind) {
    Task t{};
    t.kind = kind;
    return t;
}

// The stream a launch or memset is recorded into instead of queued (null: queue it); an error
// when the call is refused.
static CUresult capture_target(CUstream s, Stream** into) {
    *into = nullptr;
    Stream* st = real_stream(s) ? (Stream*)s : nullptr;
    if (capturing_here && st != capturing_here) return capture_violation(capturing_here);
    if (st && st->capture) {
        if (st != capturing_here) return capture_violation(st);  // another thread's capture
        if (st->invalid) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        *into = st;
    }
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, CUstream s, void** params, void** extra) {
    const Kernel* k = (const Kernel*)f;
    if (!k || extra) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long threads = (unsigned long long)bx * by * bz;
    if (threads == 0 || threads > 1024 || gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || shared != 0)
        return CUDA_ERROR_INVALID_VALUE;
    Stream* into;
    if (CUresult r = capture_target(s, &into)) return r;
    if (into) {
        into->capture->nodes.push_back(
            Node{k, dim3{gx, gy, gz}, dim3{bx, by, bz}, k->save(params), 0, 0, 0});
        return CUDA_SUCCESS;
    }
    Task t = task(T_KERNEL);
    t.kernel = k;
    t.grid = dim3{gx, gy, gz};
    t.block = dim3{bx, by, bz};
    t.params = k->save(params);
    stream_of(s)->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shared, CUstream s, void** params, void** extra) {
    GUARD_IN_CAPTURE
    NEED_CTX
    return launch(f, gx, gy, gz, bx, by, bz, shared, s, params, extra);
}

API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    GUARD
    NEED_CTX
    return alloc(p, n);
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream s) {
    GUARD
    NEED_CTX
    if (CUresult r = not_capturing(s)) return r;
    return alloc(p, n);
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
    GUARD
    flush_all();  // a synchronous free waits for the device
    return release(p);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    GUARD
    if (CUresult r = not_capturing(s)) return r;
    if (!allocations.count(p)) return CUDA_ERROR_INVALID_VALUE;
    Task t = task(T_FREE);
    t.dst = p;
    stream_of(s)->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}

// Copies. The synchronous ones run on the legacy stream, now.
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    GUARD
    NEED_CTX
    if (!device_range(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    flush_legacy();
    std::memcpy((void*)dst, src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    GUARD
    NEED_CTX
    if (CUresult r = not_capturing(s)) return r;
    if (!device_range(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    Task t = task(T_HTOD);
    t.dst = dst;
    t.bytes = n;
    if (page_locked(src, n))
        t.host_src = src;
    else  // the driver stages pageable memory before the call returns
        t.snapshot = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + n);
    stream_of(s)->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    GUARD
    NEED_CTX
    if (!device_range(src, n)) return CUDA_ERROR_INVALID_VALUE;
    flush_legacy();
    std::memcpy(dst, (const void*)src, n);
    return async_error;
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    GUARD
    NEED_CTX
    if (CUresult r = not_capturing(s)) return r;
    if (!device_range(src, n)) return CUDA_ERROR_INVALID_VALUE;
    Task t = task(T_DTOH);
    t.src = src;
    t.host_dst = dst;
    t.bytes = n;
    Stream* st = stream_of(s);
    st->queue.push_back(std::move(t));
    // Into pageable memory the call returns once the copy is done.
    if (!page_locked(dst, n)) flush(st);
    return async_error;
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    GUARD
    NEED_CTX
    if (!device_range(dst, n) || !device_range(src, n)) return CUDA_ERROR_INVALID_VALUE;
    flush_legacy();
    std::memmove((void*)dst, (const void*)src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    GUARD
    NEED_CTX
    if (CUresult r = not_capturing(s)) return r;
    if (!device_range(dst, n) || !device_range(src, n)) return CUDA_ERROR_INVALID_VALUE;
    Task t = task(T_DTOD);
    t.dst = dst;
    t.src = src;
    t.bytes = n;
    stream_of(s)->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    GUARD
    NEED_CTX
    if (!device_range(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    flush_legacy();
    std::memset((void*)dst, v, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    GUARD_IN_CAPTURE
    NEED_CTX
    if (!device_range(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    Stream* into;
    if (CUresult r = capture_target(s, &into)) return r;
    if (into) {
        into->capture->nodes.push_back(Node{nullptr, dim3{}, dim3{}, SavedParams{}, dst, v, n});
        return CUDA_SUCCESS;
    }
    Task t = task(T_MEMSET);
    t.dst = dst;
    t.value = v;
    t.bytes = n;
    stream_of(s)->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}

API CUresult cuMemHostAlloc(void** p, size_t n, unsigned flags) {
    GUARD
    NEED_CTX
    if (n == 0 || flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
    void* m = std::aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    host_allocs[m] = n;
    *p = m;
    return CUDA_SUCCESS;
}
API CUresult cuMemFreeHost(void* p) {
    GUARD
    auto it = host_allocs.find(p);
    if (it == host_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
    flush_all();  // waits for the device, as the driver's does
    host_allocs.erase(it);
    std::free(p);
    return CUDA_SUCCESS;
}
API CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned flags) {
    GUARD
    NEED_CTX
    if (!p || n == 0 || flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t a = (uintptr_t)p;
    auto it = registered.upper_bound(a + n - 1);
    if (it != registered.begin()) {
        --it;
        if (it->first + it->second > a) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    registered[a] = n;
    if (flags & CU_MEMHOSTREGISTER_DEVICEMAP) mapped[a] = n;
    return CUDA_SUCCESS;
}
API CUresult cuMemHostUnregister(void* p) {
    GUARD
    auto it = registered.find((uintptr_t)p);
    if (it == registered.end()) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    registered.erase(it);
    mapped.erase((uintptr_t)p);
    return CUDA_SUCCESS;
}
// The device address of mapped host memory: with unified addressing, the host address itself
// (kernels here read host memory anyway). Refused for memory not registered with DEVICEMAP.
API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned flags) {
    GUARD
    NEED_CTX
    if (!d || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t a = (uintptr_t)p;
    auto r = mapped.upper_bound(a);
    if (r == mapped.begin() || a >= std::prev(r)->first + std::prev(r)->second) return CUDA_ERROR_INVALID_VALUE;
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

API CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    GUARD
    NEED_CTX
    if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
    Stream* st = new Stream{flags, nullptr, false, {}};
    streams.insert(st);
    *s = st;
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(CUstream s) {
    GUARD
    if (!real_stream(s) || !streams.count((Stream*)s)) return CUDA_ERROR_INVALID_HANDLE;
    if (((Stream*)s)->capture) return CUDA_ERROR_ILLEGAL_STATE;
    flush((Stream*)s);  // its work still runs
    streams.erase((Stream*)s);
    delete (Stream*)s;
    return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(CUstream s) {
    GUARD
    if (CUresult r = not_capturing(s)) return r;
    if (real_stream(s) && !streams.count((Stream*)s)) return CUDA_ERROR_INVALID_HANDLE;
    flush(stream_of(s));
    return async_error;
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    GUARD
    if (CUresult r = not_capturing(s)) return r;
    if (!e || flags > 1 || (real_stream(s) && !streams.count((Stream*)s))) return CUDA_ERROR_INVALID_HANDLE;
    Event* ev = (Event*)e;
    if (ev->gen == 0) return CUDA_SUCCESS;  // never recorded: nothing to wait for
    Task t = task(T_WAIT);
    t.event = ev;
    t.gen = ev->gen;
    stream_of(s)->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}
API CUresult cuEventCreate(CUevent* e, unsigned flags) {
    GUARD
    NEED_CTX
    if (flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
    *e = new Event{flags, false, 0.0, nullptr, 0, 0};
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent e) {
    GUARD
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    flush_all();  // queued work may refer to it
    delete (Event*)e;
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s) {
    GUARD
    if (CUresult r = not_capturing(s)) return r;
    if (!e || (real_stream(s) && !streams.count((Stream*)s))) return CUDA_ERROR_INVALID_HANDLE;
    Event* ev = (Event*)e;
    Stream* st = stream_of(s);
    // Waits on its last recording there stay whole (a destroyed stream ran all its work).
    if (ev->stream && ev->stream != st && streams.count(ev->stream)) flush(ev->stream);
    ev->stream = st;
    Task t = task(T_RECORD);
    t.event = ev;
    t.gen = ++ev->gen;
    st->queue.push_back(std::move(t));
    return CUDA_SUCCESS;
}
// Runs e's stream up to its last recording.
static void reach(Event* ev) {
    while (ev->stream && ev->done < ev->gen && streams.count(ev->stream) && run_one(ev->stream)) {
    }
}
API CUresult cuEventSynchronize(CUevent e) {
    GUARD
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    reach((Event*)e);
    return async_error;
}
API CUresult cuEventQuery(CUevent e) {
    GUARD
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    reach((Event*)e);  // a query finds the work done (what it waits for then runs)
    return async_error;
}
API CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    GUARD
    const Event *a = (const Event*)start, *b = (const Event*)end;
    // Events made with CU_EVENT_DISABLE_TIMING (2), or never recorded, cannot be timed.
    if (!a || !b || (a->flags & 2) || (b->flags & 2) || a->gen == 0 || b->gen == 0) return CUDA_ERROR_INVALID_HANDLE;
    // Their last recordings not reached yet.
    if (a->done < a->gen || b->done < b->gen) return CUDA_ERROR_NOT_READY;
    *ms = (float)(b->ms - a->ms);
    return CUDA_SUCCESS;
}
API CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) { return cuEventElapsedTime(ms, start, end); }

// ---------------------------------------------------------------------------------------------
// Stream capture and graphs. A graph's nodes run in the order they were captured (one stream).

API CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    GUARD
    NEED_CTX
    if (!real_stream(s)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // legacy streams cannot be captured
    Stream* st = (Stream*)s;
    if (st->capture) return CUDA_ERROR_ILLEGAL_STATE;
    // Modes: 0 global, 1 thread-local, 2 relaxed; this emulation checks as thread-local for all.
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    st->capture = new Graph{};
    st->invalid = false;
    capturing_here = st;
    return CUDA_SUCCESS;
}

API CUresult cuStreamEndCapture(CUstream s, CUgraph* graph) {
    GUARD_IN_CAPTURE
    if (!real_stream(s) || !((Stream*)s)->capture) return CUDA_ERROR_ILLEGAL_STATE;
    Stream* st = (Stream*)s;
    if (st != capturing_here) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // ended by another thread
    capturing_here = nullptr;
    Graph* g = st->capture;
    st->capture = nullptr;
    if (st->invalid) {
        delete g;
        *graph = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *graph = g;
    return CUDA_SUCCESS;
}

API CUresult cuStreamIsCapturing(CUstream s, int* status) {
    GUARD_IN_CAPTURE
    Stream* st = real_stream(s) ? (Stream*)s : nullptr;
    *status = !st || !st->capture ? 0 : st->invalid ? 2 : 1;
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long flags) {
    GUARD
    NEED_CTX
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;  // none of the flags is emulated
    *exec = new Graph(*(Graph*)graph);
    return CUDA_SUCCESS;
}

// Queues the graph's nodes on the stream (a later launch of the same graph may follow them).
API CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) {
    GUARD
    NEED_CTX
    if (!exec) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = not_capturing(s)) return r;
    Stream* st = stream_of(s);
    for (const Node& n : ((Graph*)exec)->nodes) {
        Task t = task(n.kernel ? T_KERNEL : T_MEMSET);
        t.kernel = n.kernel;
        t.grid = n.grid;
        t.block = n.block;
        t.params = n.params;  // shared: the values captured
        t.dst = n.dst;
        t.value = n.value;
        t.bytes = n.bytes;
        st->queue.push_back(std::move(t));
    }
    return CUDA_SUCCESS;
}

API CUresult cuGraphUpload(CUgraphExec exec, CUstream s) {
    GUARD
    if (!exec) return CUDA_ERROR_INVALID_VALUE;
    return not_capturing(s);
}

API CUresult cuGraphExecDestroy(CUgraphExec exec) {
    GUARD
    if (!exec) return CUDA_ERROR_INVALID_VALUE;
    delete (Graph*)exec;  // queued launches hold their own copies of the parameters
    return CUDA_SUCCESS;
}

API CUresult cuGraphDestroy(CUgraph graph) {
    GUARD
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    delete (Graph*)graph;
    return CUDA_SUCCESS;
}

// NVRTC opens libcuda.so.1 when it is loaded and asks for the driver's private tables; there are
// none here (NVRTC then compiles without them).
API CUresult cuGetExportTable(const void** table, const void*) {
    if (table) *table = nullptr;
    return CUDA_ERROR_NOT_FOUND;
}
